"""`poise.runtime.moves.homes`: homes re-chosen among an expert's holders (hand-worked cases)."""

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.runtime.moves.homes import choose_homes, keep_homes

SPEC = ModelSpec("t", 8, 16, 6, 1, 1, dtype_bytes=4, optimizer_bytes_per_param=8.0)


def test_single_holders_fix_the_home_kept_homes_stay_the_rest_balance() -> None:
    # 3 devices, 6 experts. Expert 0 only on device 2 (forced); expert 1 on 0 and 1, home in
    # force 1 (kept); experts 2..5 held on several devices with homes in force on devices
    # that no longer hold them: placed, fewest holders first, on the holder with fewest homes.
    copies = np.array(
        [
            # e: 0  1  2  3  4  5
            [0, 1, 1, 0, 1, 1],  # device 0
            [0, 1, 1, 1, 0, 1],  # device 1
            [1, 0, 0, 1, 1, 1],  # device 2
        ]
    )
    previous = np.array([0, 1, 2, 0, 1, 2])  # experts 2, 3, 4: home in force not a holder
    home = choose_homes(copies, previous)
    # forced 0 -> 2, kept 1 -> 1 and 5 -> 2: homes on (0, 1, 2) = (0, 1, 2). Then expert 2
    # (holders 0, 1 with 0, 1 homes) -> 0; 3 (holders 1, 2 with 1, 2) -> 1; 4 (holders 0, 2
    # with 1, 2) -> 0.
    assert home.tolist() == [2, 1, 0, 1, 0, 2]
    assert np.bincount(home, minlength=3).tolist() == [2, 2, 2]


def test_free_homes_go_to_the_holder_with_fewest_homes() -> None:
    copies = np.array(
        [
            # e: 0  1  2  3  4  5
            [1, 1, 0, 1, 0, 1],  # device 0: two forced homes
            [0, 0, 1, 0, 1, 1],  # device 1: one
            [0, 0, 0, 1, 1, 0],  # device 2: none
        ]
    )
    previous = np.array([0, 0, 1, 1, 0, 2])  # experts 3, 4, 5: home in force not a holder
    # homes on (0, 1, 2) after the forced ones: (2, 1, 0). Expert 3 (holders 0, 2) -> 2;
    # 4 (holders 1, 2 with 1, 1: the lower) -> 1; 5 (holders 0, 1 with 2, 2) -> 0.
    assert choose_homes(copies, previous).tolist() == [0, 0, 1, 2, 1, 0]


def test_keep_homes_moves_no_home_that_a_holder_already_has() -> None:
    """EPLB-like: a plan that replicates expert 0 on both devices but names device 1 its home
    (its first copy there) keeps the home in force, so nothing migrates and homes stay 2 + 2."""
    before = Placement.from_homes(np.array([[0, 0, 1, 1]]), devices=2, slots_per_device=3)
    after = Placement.from_homes(np.array([[1, 0, 1, 1]]), devices=2, slots_per_device=3)
    after.copies[0, 0, 0] = 1  # expert 0 on both devices, its home named on device 1
    after.copies[0, 1, 1] = 1
    candidate = Plan("eplb", after, Assignment.even(after), transfers_between(before, after, SPEC))
    assert candidate.transfers.migrate_bytes.sum() > 0
    rehomed = keep_homes(candidate, before, SPEC)
    assert rehomed.placement.home.tolist() == [[0, 0, 1, 1]]
    np.testing.assert_array_equal(rehomed.placement.copies, after.copies)
    np.testing.assert_array_equal(rehomed.assignment.weights, candidate.assignment.weights)
    assert rehomed.transfers.migrate_bytes.sum() == 0
    assert keep_homes(rehomed, before, SPEC) is rehomed  # nothing left to change
