"""The lockstep (all layers at once) planners equal their plain per-item / per-layer forms.

The policies run their greedy searches on every layer together and replace loops by block
computations (`plan/policies/lpt.py`, D'Hondt's quotients in `eplb`, chunked walks in `shadow`,
`LayerState.for_homes`); these tests hold them to the plain loops they replace, bit for bit,
on random and tie-heavy inputs (equal, zero and integer weights)."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement
from poise.core.presets import get_cluster
from poise.core.spec import MODELS
from poise.core.water_fill import balanced_weights
from poise.cost.incremental import LayerState
from poise.cost.model import CostModel
from poise.cost.network import MIN_TRAFFIC_BYTES
from poise.cost.traffic import level_traffic
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.eplb import replicate_experts
from poise.plan.policies.lpt import lpt_assign
from poise.plan.policies.shadow import first_non_improvement, shadow_latencies, shadow_layers

from .helpers import toy_cluster


def _weights(rng: np.random.Generator, kind: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random weights of one of six kinds, most of them full of ties."""
    if kind == 0:
        return rng.zipf(1.3, shape).astype(float)
    if kind == 1:
        return rng.integers(0, 3, shape).astype(float)
    if kind == 2:
        return np.zeros(shape)
    if kind == 3:
        return np.full(shape, 7.0)
    if kind == 4:
        return rng.random(shape) * 1e6
    return np.where(rng.random(shape) < 0.6, 0.0, rng.integers(1, 9, shape) * 0.1)


def _plain_lpt(
    weight: np.ndarray, packs: int, capacity: int, sticky: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The greedy of `lpt_assign`, one item at a time."""
    R, n = weight.shape
    pack_of = np.zeros((R, n), dtype=np.int64)
    rank = np.zeros((R, n), dtype=np.int64)
    for r in range(R):
        load = np.zeros(packs)
        count = np.zeros(packs, dtype=np.int64)
        for t in range(n):
            key = np.where(count < capacity, load, np.inf)
            p = int(key.argmin())
            if sticky is not None and key[sticky[r, t]] == key[p]:
                p = int(sticky[r, t])
            pack_of[r, t], rank[r, t] = p, count[p]
            load[p] += weight[r, t]
            count[p] += 1
    return pack_of, rank


@pytest.mark.parametrize("with_sticky", [False, True])
def test_lpt_assign_equals_the_plain_greedy(with_sticky: bool) -> None:
    rng = np.random.default_rng(4)
    for trial in range(120):
        packs = int(rng.integers(1, 40))  # below and above `lpt.MIN_PACKS`
        n = int(rng.integers(1, 150))
        capacity = -(-n // packs) + int(rng.integers(0, 3))
        rows = int(rng.integers(1, 5))
        weight = -np.sort(-_weights(rng, trial % 6, (rows, n)), axis=1)  # heaviest first
        sticky = rng.integers(0, packs, (rows, n)) if with_sticky else None
        got = lpt_assign(weight, packs, capacity, sticky)
        want = _plain_lpt(weight, packs, capacity, sticky)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_replicate_experts_equals_the_loop() -> None:
    rng = np.random.default_rng(5)
    for trial in range(300):
        rows, experts = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        slots = experts + int(rng.choice([0, 1, 3, experts, 3 * experts, 40 * experts + 7]))
        w = _weights(rng, trial % 6, (rows, experts))
        phy2log, rank, logcnt = replicate_experts(w, slots)
        # The loop: each extra slot to argmax w / count, lowest expert on ties.
        count = np.ones((rows, experts), dtype=np.int64)
        for i in range(experts, slots):
            e = np.argmax(w / count, axis=1)
            np.testing.assert_array_equal(phy2log[:, i], e)
            np.testing.assert_array_equal(rank[:, i], count[np.arange(rows), e])
            count[np.arange(rows), e] += 1
        np.testing.assert_array_equal(logcnt, count)


@pytest.mark.parametrize("preset", ["dgx-h100:2", "a800-eth10", "cpu-2", "toy-20x8"])
def test_for_homes_equals_stacked_bit_for_bit(preset: str) -> None:
    """`for_homes` against the generic `stacked` (traffic, compute and messages) and its
    `carried` multiplicities against a plain count over experts; `toy-20x8` (160 devices) is
    past `messages.DIRECT_RUN`, where the messages come from `homes_messages`."""
    cluster = toy_cluster(20, 8) if preset == "toy-20x8" else get_cluster(preset)
    spec = MODELS["zipf-256"].with_(experts=24, moe_layers=3)
    cost = CostModel(cluster, spec)
    rng = np.random.default_rng(6)
    D = cluster.num_devices
    counts = rng.random((3, D, 24)) * 1000
    counts[1] = 0.0
    counts[2, rng.random((D, 24)) < 0.5] = 0.0  # sources that send some experts nothing
    home = rng.integers(0, D, (3, 24))
    placement = Placement.from_homes(home, D, 99)
    a = LayerState.stacked(cost, placement, counts)
    b = LayerState.for_homes(cost, home, counts)
    for name in ("R", "comp", "tok_send", "tok_recv", "par_send", "par_recv"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for name in ("tok_msg_out", "tok_msg_in", "par_msg_out", "par_msg_in"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    send, recv = level_traffic(cluster, placement, Assignment.to_home(placement), counts)
    assert np.array_equal(send.transpose(1, 0, 2), b.tok_send)
    assert np.array_equal(recv.transpose(1, 0, 2), b.tok_recv)
    carried = np.zeros((3, D, D))
    for layer in range(3):
        for expert in range(24):
            h = home[layer, expert]
            for source in range(D):
                if (
                    source != h
                    and counts[layer, source, expert] * spec.token_bytes >= MIN_TRAFFIC_BYTES
                ):
                    carried[layer, source, h] += 1
    assert np.array_equal(b.carried, carried)
    # `home_pairs` in chunks of one layer gives the same multiplicities
    import poise.cost.incremental as incremental

    whole = incremental._PAIR_CELLS
    incremental._PAIR_CELLS = 24 * D
    try:
        assert np.array_equal(incremental.home_pairs(home, counts, spec.token_bytes), carried)
    finally:
        incremental._PAIR_CELLS = whole


def _shadow_one_pass(
    counts: np.ndarray, home: np.ndarray, free: np.ndarray, t_c: float, t_f: float, t_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """FasterMoE's latencies for every prefix of one layer in one pass over all E steps (the
    form the chunked walk replaces): `(order[E], lat[K + 1])`."""
    D, E = counts.shape
    order = np.argsort(-counts.sum(axis=0), kind="stable")
    is_home = np.arange(D)[:, None] == home[None, :]
    away = np.where(is_home, 0.0, counts)
    remote_total = away.sum(axis=0)
    homed = np.bincount(home, weights=counts.sum(axis=0), minlength=D)
    recv0 = np.bincount(home, weights=remote_total, minlength=D)
    send0 = away.sum(axis=1)
    a = away[:, order].T
    hit = np.zeros((E, D))
    hit[np.arange(E), home[order]] = remote_total[order]
    d_comp = np.vstack([np.zeros(D), np.cumsum(a - hit, axis=0)])
    d_send = np.vstack([np.zeros(D), np.cumsum(a, axis=0)])
    d_recv = np.vstack([np.zeros(D), np.cumsum(hit, axis=0)])
    crossing = np.maximum(send0[None, :] - d_send, recv0[None, :] - d_recv)
    lat = (t_c * (homed[None, :] + d_comp) + t_f * np.maximum(crossing, 0.0)).max(axis=1)
    lat = lat + t_s * np.arange(E + 1)
    used = np.vstack([np.zeros(D), np.cumsum(~is_home[:, order].T, axis=0)])
    fits = (used <= free[None, :]).all(axis=1)
    K = int(np.argmin(fits)) - 1 if not fits.all() else E
    return order, lat[: K + 1]


def test_shadow_walk_in_chunks_equals_one_pass() -> None:
    rng = np.random.default_rng(7)
    for trial in range(40):
        L, D, E = int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(1, 40))
        counts = _weights(rng, trial % 6, (L, D, E)) * 100
        home = rng.integers(0, D, (L, E))
        used = np.stack([np.bincount(h, minlength=D) for h in home])
        free = used.max() + int(rng.integers(0, E + 1)) - used
        times = (1e-9, 1e-7, float(rng.choice([1e-9, 1e-6, 1e-4])))
        order, k, lat0, lat_k = shadow_layers(counts, home, free, *times)
        for layer in range(L):
            want_order, lat = _shadow_one_pass(counts[layer], home[layer], free[layer], *times)
            n = first_non_improvement(lat)
            np.testing.assert_array_equal(order[layer], want_order)
            assert k[layer] == n
            assert lat0[layer] == lat[0] and lat_k[layer] == lat[n]
            got_order, got_lat = shadow_latencies(counts[layer], home[layer], free[layer], *times)
            np.testing.assert_array_equal(got_order, want_order)
            np.testing.assert_array_equal(got_lat, lat)


def test_balanced_assignment_equals_water_filling_on_all_rows() -> None:
    rng = np.random.default_rng(8)
    for L in (1, 3):
        D, E = 6, 9
        home = rng.integers(0, D, (L, E))
        placement = Placement.from_homes(home, D, 6)
        placement.copies[rng.random((L, D, E)) < 0.3] += 1
        loads = rng.random((L, D, E)) * 100
        got = Assignment.balanced(placement, loads).weights
        held = placement.holders()
        want = balanced_weights(
            np.where(held, loads, 0.0).transpose(0, 2, 1),
            np.where(held, 0.0, loads).sum(axis=1),
            placement.copies.transpose(0, 2, 1).astype(np.float64),
        )
        assert np.array_equal(got, want)
        assert got.strides == want.strides  # same memory order, so the same sums downstream


@pytest.mark.parametrize("policy", ["hybrid", "prophet", "shadow", "permute", "eplb", "vexpert"])
def test_layers_planned_together_equal_each_layer_alone(policy: str) -> None:
    # Lockstep across layers must not couple them: every layer's placement and price are the
    # ones it gets when planned on its own.
    cluster = toy_cluster(4, 2, 2, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=1e-6, flops=1e13)
    spec = MODELS["zipf-256"].with_(experts=16, moe_layers=4, d_model=64, d_expert=128)
    rng = np.random.default_rng(9)
    loads = np.floor(rng.zipf(1.4, (4, 16, 16)) * rng.random((4, 16, 16)) * 200)
    loads[2] = 0.0
    ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=CostModel(cluster, spec))
    together = make_plan(policy, loads, None, ctx)
    for layer in range(4):
        one_spec = spec.with_(moe_layers=1)
        one_ctx = PlanContext.create(
            cluster, one_spec, slots_per_device=3, cost=CostModel(cluster, one_spec)
        )
        alone = make_plan(policy, loads[layer : layer + 1], None, one_ctx)
        np.testing.assert_array_equal(together.placement.copies[layer], alone.placement.copies[0])
        np.testing.assert_array_equal(together.placement.home[layer], alone.placement.home[0])
        np.testing.assert_allclose(together.cost.layer_s[layer], alone.cost.layer_s[0], rtol=1e-12)
