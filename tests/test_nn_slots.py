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
