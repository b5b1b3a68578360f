from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement, transfers_between

from .helpers import toy_spec


def two_by_two() -> Placement:
    """Layer 0: e0 on d0, e1 on d1; plus a replica of e1 on d0."""
    p = Placement.from_homes(np.array([[0, 1]]), devices=2, slots_per_device=2)
    p.copies[0, 0, 1] += 1
    return p


def test_invariants_detected() -> None:
    p = two_by_two()
    p.validate()
    bad = p.copy()
    bad.copies[0, 1, 1] = 0  # home no longer holds its expert
    with pytest.raises(PlanError, match="home device holds no copy"):
        bad.validate()
    full = p.copy()
    full.slots_per_device = 1
    with pytest.raises(PlanError, match="more than 1 slots"):
        full.validate()
    w = Assignment.even(p)
    w.weights[0, 0] = [0.5, 0.5]  # e0 is held only by d0
    with pytest.raises(PlanError, match="holds no copy"):
        w.validate(p)
    w = Assignment.even(p)
    w.weights[0, 1] = [0.5, 0.4]
    with pytest.raises(PlanError, match="not conserved"):
        w.validate(p)


def test_received_keeps_local_tokens() -> None:
    p = two_by_two()
    counts = np.array([[[10, 30], [20, 40]]], dtype=float)  # [L=1, D=2, E=2]
    recv = Assignment.to_home(p).received(p, counts)
    # d0 keeps its e0 and (replica) e1 tokens and gets d1's e0 tokens; d1 keeps its e1 tokens.
    np.testing.assert_allclose(recv[0], [[30, 30], [0, 40]])
    even = Assignment.even(p).received(p, counts)
    np.testing.assert_allclose(even[0], [[30, 30], [0, 40]])  # d1 holds e1: nobody remote


def test_balanced_levels_copies() -> None:
    p = Placement.from_homes(np.array([[0, 0, 0]]), devices=3, slots_per_device=3)
    p.copies[0, 1, 0] = 1
    p.copies[0, 2, 0] = 1
    # e0 held by all three; all tokens are local, nothing to split.
    counts = np.array([[[9, 0, 0], [3, 0, 0], [0, 0, 0]]], dtype=float)
    a = Assignment.balanced(p, counts)
    a.validate(p)
    # Now a fourth device without a copy sends 12 tokens: d2 (0 local) should fill first to 6,
    # then d1 (3 local) joins: levels 7.5 on d1 and d2, d0 stays at 9.
    p4 = Placement.from_homes(np.array([[0, 3, 3]]), devices=4, slots_per_device=3)
    p4.copies[0, 1, 0] = 1
    p4.copies[0, 2, 0] = 1
    counts4 = np.array([[[9, 0, 0], [3, 0, 0], [0, 0, 0], [12, 0, 0]]], dtype=float)
    a4 = Assignment.balanced(p4, counts4)
    a4.validate(p4)
    recv = a4.received(p4, counts4)
    np.testing.assert_allclose(recv[0, :, 0], [9, 7.5, 7.5, 0])


@settings(max_examples=60, deadline=None)
@given(
    devices=st.integers(1, 6),
    experts=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0, 1, 7, 10**6]),
)
def test_split_conserves_every_token(devices: int, experts: int, seed: int, scale: int) -> None:
    rng = np.random.default_rng(seed)
    home = rng.integers(0, devices, size=(2, experts))
    p = Placement.from_homes(home, devices, slots_per_device=experts * 2)
    extra = rng.random((2, devices, experts)) < 0.3
    p.copies += extra.astype(np.int32)
    counts = rng.integers(0, scale + 1, size=(2, devices, experts))
    for a in (Assignment.even(p), Assignment.to_home(p), Assignment.balanced(p, counts)):
        a.validate(p)
        routes = a.split(p, counts)
        np.testing.assert_array_equal(routes.sum(axis=3), counts)
        held_by_dst = p.holders().transpose(0, 2, 1)  # [L, E, D_dst]
        # Only holders receive tokens.
        assert not np.any(routes.sum(axis=1)[~held_by_dst])
        np.testing.assert_allclose(a.received(p, counts).sum(axis=1), counts.sum(axis=1))


def test_transfers_between() -> None:
    spec = toy_spec(experts=2)
    before = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    after = two_by_two()
    t = transfers_between(before, after, spec)
    assert t.trans_bytes[0] == spec.expert_bytes  # one replica refreshed every step
    assert t.agg_bytes[0] == spec.expert_bytes
    assert len(t.migrations) == 0
    moved = Placement.from_homes(np.array([[1, 1]]), 2, 2)
    t2 = transfers_between(before, moved, spec)
    np.testing.assert_array_equal(t2.migrations, [[0, 0, 0, 1]])
    assert t2.migrate_bytes[0] == spec.migration_bytes
    assert transfers_between(None, moved, spec).migrate_bytes.sum() == 0


def test_water_fill_of_a_row_does_not_depend_on_its_batch() -> None:
    # A row of few holders is filled packed on its holders when its batch has only such rows,
    # on all D devices when a row with many holders shares the batch: the same bits either way
    # (with NumPy's pairwise sum of the shares, 56 of these 200 rows differed).
    from poise.core.water_fill import balanced_weights

    D = 32
    for seed in range(200):
        rng = np.random.default_rng(seed)
        copies = np.zeros((2, D))
        copies[0, rng.choice(D, int(rng.integers(3, 16)), replace=False)] = 1  # packed alone
        copies[1, rng.choice(D, 20, replace=False)] = 1  # many: the batch on all D devices
        local = np.where(copies > 0, rng.random((2, D)) * 1000, 0.0)
        remote = np.array([rng.random() * 5000, 1234.5])
        alone = balanced_weights(local[:1], remote[:1], copies[:1])
        batched = balanced_weights(local, remote, copies)
        assert np.array_equal(alone[0], batched[0]), seed
