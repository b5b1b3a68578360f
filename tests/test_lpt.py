"""`policies.lpt.lpt_assign` on the shapes where its rows run in lockstep (EPLB's packing: every
row has exactly `packs * capacity` items) and where they fall out of it (ties, sticky packs,
rows of different weights), against the greedy written as one loop per row."""

from __future__ import annotations

import numpy as np
import pytest

from poise.plan.policies.lpt import MIN_PACKS, lpt_assign


def _greedy(
    weight: np.ndarray, packs: int, capacity: int, sticky: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Each item to the least-loaded pack with room (lowest index), or to its sticky pack when
    that one has room and ties the least."""
    R, n = weight.shape
    pack_of = np.zeros((R, n), dtype=np.int64)
    rank = np.zeros((R, n), dtype=np.int64)
    for r in range(R):
        load, count = [0.0] * packs, [0] * packs
        for t in range(n):
            least = min((load[p], p) for p in range(packs) if count[p] < capacity)
            p = least[1]
            if sticky is not None:
                s = int(sticky[r, t])
                if count[s] < capacity and load[s] == least[0]:
                    p = s
            pack_of[r, t], rank[r, t] = p, count[p]
            load[p] += float(weight[r, t])
            count[p] += 1
    return pack_of, rank


def _check(weight: np.ndarray, packs: int, capacity: int, sticky: np.ndarray | None) -> None:
    got = lpt_assign(weight, packs, capacity, sticky)
    want = _greedy(weight, packs, capacity, sticky)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("packs", [MIN_PACKS, 32])
def test_full_rows_in_lockstep(packs: int) -> None:
    # Distinct weights, every pack filled: whole rounds, every row at the same item.
    rng = np.random.default_rng(1)
    for capacity in (1, 2, 9):
        weight = -np.sort(-rng.random((8, packs * capacity)) * 1e3, axis=1)
        _check(weight, packs, capacity, None)


def test_rows_leaving_and_rejoining_lockstep() -> None:
    rng = np.random.default_rng(2)
    for _ in range(12):
        packs, capacity = int(rng.choice([16, 20, 33])), int(rng.integers(2, 7))
        weight = -np.sort(-rng.random((6, packs * capacity)), axis=1)
        # One row of ties and one of zeros from some item on: short rounds in those rows only.
        weight[1, int(rng.integers(0, packs)) :] = 1.0
        weight[4, int(rng.integers(0, packs * capacity)) :] = 0.0
        weight[2] *= 1e6
        _check(weight, packs, capacity, None)


def test_sticky_rows() -> None:
    rng = np.random.default_rng(3)
    for trial in range(12):
        packs, capacity = int(rng.choice([16, 24])), int(rng.integers(1, 6))
        n = packs * capacity - int(rng.integers(0, packs))
        weight = -np.sort(-rng.integers(1, 40, (5, n)).astype(float), axis=1)
        if trial % 2:
            sticky = np.tile(np.arange(n) % packs, (5, 1))  # a static placement's homes
        else:
            sticky = rng.integers(0, packs, (5, n))
        _check(weight, packs, capacity, sticky)


def test_non_contiguous_weights() -> None:
    rng = np.random.default_rng(4)
    weight = -np.sort(-rng.random((4, 128)), axis=1)
    _check(np.asfortranarray(weight[:, :64]), 16, 4, None)
    _check(weight[:, ::2], 16, 4, None)  # a strided view
