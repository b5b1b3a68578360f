import numpy as np
import pytest

from poise.core.errors import PlanError
from poise.core.placement import Placement
from poise.nn.slots import slot_maps


def test_static_layout_gives_contiguous_home_slots() -> None:
    placement = Placement.from_homes(np.array([[0, 0, 1, 1]]), devices=2, slots_per_device=3)
    maps = slot_maps(placement, layer=0, slots=3)
    assert maps[0].expert.tolist() == [0, 1, -1]
    assert maps[1].expert.tolist() == [2, 3, -1]
    assert maps[0].home.tolist() == [True, True, False]
    assert maps[1].slot_of(4).tolist() == [-1, -1, 0, 1]


def test_replicas_follow_homes_and_duplicate_copies_share_a_slot() -> None:
    placement = Placement.from_homes(np.array([[0, 1, 1, 0]]), devices=2, slots_per_device=4)
    placement.copies[0, 0, 2] = 1  # replica of expert 2 on rank 0
    placement.copies[0, 1, 1] = 2  # two copies of expert 1 on its home
    maps = slot_maps(placement, layer=0, slots=4)
    assert maps[0].expert.tolist() == [0, 3, 2, -1]
    assert maps[0].home.tolist() == [True, True, False, False]
    assert maps[1].expert.tolist() == [1, 2, -1, -1]


def test_too_few_slots_is_a_plan_error() -> None:
    placement = Placement.from_homes(np.array([[0, 0, 0]]), devices=2, slots_per_device=3)
    with pytest.raises(PlanError, match="slots"):
        slot_maps(placement, layer=0, slots=2)


def test_previous_maps_keep_staying_homes_in_their_slots() -> None:
    """Expert 1 moves from rank 0 to rank 1 (hand-worked): rank 0's expert 2 fills the hole
    expert 1 left (slot 1) instead of every home shifting; rank 1 appends expert 1 after its
    homes, which stay where they were. The replica of expert 0 follows the homes."""
    before = Placement.from_homes(np.array([[0, 0, 0, 1, 1, 1]]), devices=2, slots_per_device=5)
    after = Placement.from_homes(np.array([[0, 1, 0, 1, 1, 1]]), devices=2, slots_per_device=5)
    after.copies[0, 1, 0] = 1
    previous = slot_maps(before, 0, 5)
    canonical = slot_maps(after, 0, 5)
    kept = slot_maps(after, 0, 5, previous=previous)
    assert canonical[1].expert.tolist() == [1, 3, 4, 5, 0]  # every home behind expert 1 shifts
    assert kept[0].expert.tolist() == [0, 2, -1, -1, -1]
    assert kept[1].expert.tolist() == [3, 4, 5, 1, 0]
    assert kept[1].home.tolist() == [True, True, True, True, False]


@pytest.mark.parametrize("seed", range(20))
def test_previous_maps_hold_the_same_experts_and_move_only_what_they_must(seed: int) -> None:
    rng = np.random.default_rng(seed)
    E, D, S = 12, 3, 6
    placements = []
    for _ in range(2):
        homes = rng.permutation(np.repeat(np.arange(D), E // D))
        homes[rng.integers(E)] = rng.integers(D)  # sometimes an uneven share
        p = Placement.from_homes(homes[None, :], devices=D, slots_per_device=S)
        for d in range(D):  # a replica where a slot is free
            spare = [e for e in range(E) if homes[e] != d]
            if (homes == d).sum() < S:
                p.copies[0, d, rng.choice(spare)] = 1
        placements.append(p)
    previous = slot_maps(placements[0], 0, S)
    kept = slot_maps(placements[1], 0, S, previous=previous)
    canonical = slot_maps(placements[1], 0, S)
    for old, new, ref in zip(previous, kept, canonical, strict=True):
        assert np.array_equal(new.home, ref.home)  # homes are the same prefix
        assert sorted(new.expert[new.home]) == sorted(ref.expert[ref.home])
        assert np.array_equal(new.expert[~new.home], ref.expert[~ref.home])  # replicas, empties
        h = int(new.home.sum())
        for slot in range(h):  # a home that stays on its rank inside the prefix keeps its slot
            e = old.expert[slot]
            if old.home[slot] and e in new.expert[new.home]:
                assert new.expert[slot] == e
