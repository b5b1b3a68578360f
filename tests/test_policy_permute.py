"""SmartMoE's online re-placement: the greedy by hand, rejection, stickiness, history window."""

from __future__ import annotations

import numpy as np

from poise.core.presets import get_cluster
from poise.core.spec import ModelSpec
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.permute import greedy_homes

SPEC = ModelSpec("four", d_model=64, d_expert=128, experts=4, top_k=1, moe_layers=1)


def _ctx(history: np.ndarray | None = None, **options: object) -> PlanContext:
    return PlanContext.create(
        get_cluster("cpu-2"),
        SPEC,
        history=None if history is None else history.sum(axis=2),
        options={"permute": options},
    )


def _loads(per_expert: list[float]) -> np.ndarray:
    """All tokens from source device 0: `[1, 2, 4]`."""
    loads = np.zeros((1, 2, 4))
    loads[0, 0] = per_expert
    return loads


def test_greedy_by_hand_is_accepted() -> None:
    # Static homes [0, 0, 1, 1]: device loads [18, 2]. Greedy: 0 -> dev 0 (tie, sticky),
    # 1 -> dev 1, 2 -> dev 1 (8 < 10), 3 -> dev 0 (dev 1 full): loads [11, 9] < 18.
    plan = make_plan("permute", _loads([10, 8, 1, 1]), None, _ctx())
    assert plan.placement.home.tolist() == [[0, 1, 1, 0]]
    assert plan.notes["accepted"] == [True]
    assert plan.notes["max_load_before"] == [18.0] and plan.notes["max_load_after"] == [11.0]
    assert plan.placement.replicas().sum() == 0
    assert np.allclose(plan.assignment.weights.argmax(axis=2), plan.placement.home)
    # Moving from it again finds nothing better: the homes stay and nothing migrates.
    again = make_plan("permute", _loads([10, 8, 1, 1]), plan, _ctx())
    assert again.placement.home.tolist() == [[0, 1, 1, 0]]
    assert len(again.transfers.migrations) == 0
    # The first plan (from the static placement, previous None) priced two migrations' worth of
    # transfers relative to a previous static plan.
    static = make_plan("static", _loads([10, 8, 1, 1]), None, _ctx())
    moved = make_plan("permute", _loads([10, 8, 1, 1]), static, _ctx())
    assert moved.transfers.migrations[:, 1].tolist() == [1, 3]


def test_rejected_when_no_strict_improvement() -> None:
    # The greedy reaches loads [11, 9], which the static placement [0, 0, 1, 1] already has.
    plan = make_plan("permute", _loads([10, 1, 1, 8]), None, _ctx())
    assert plan.notes["accepted"] == [False]
    assert plan.placement.home.tolist() == [[0, 0, 1, 1]]


def test_stickiness() -> None:
    # Current homes [1, 1, 0, 0], loads [6, 6, 1, 1] (device loads [2, 12]). Expert 0 ties at
    # load 0 on both devices and stays on 1; expert 2 ties at 6 and stays on 0.
    homes = greedy_homes(np.array([[6.0, 6.0, 1.0, 1.0]]), np.array([[1, 1, 0, 0]]), 2, 2)
    assert homes.tolist() == [[1, 0, 0, 1]]
    # All currently on device 1: 0 stays (tie at 0), 1 -> 0, 2 stays (tie at 6), 3 -> 0.
    homes = greedy_homes(np.array([[6.0, 6.0, 1.0, 1.0]]), np.array([[1, 1, 1, 1]]), 2, 2)
    assert homes.tolist() == [[1, 0, 1, 0]]
    # A tie without the current device goes to the lowest device index: one slot each on 3
    # devices; expert 0 stays on device 2, expert 1 (current device 2, now full) ties at 0 on
    # devices 0 and 1 and takes 0.
    homes = greedy_homes(np.array([[1.0, 1.0]]), np.array([[2, 2]]), 3, 1)
    assert homes.tolist() == [[2, 0]]
    homes = greedy_homes(np.array([[6.0, 6.0, 1.0, 1.0]]), np.array([[0, 0, 1, 1]]), 2, 2)
    assert homes.tolist() == [[0, 1, 1, 0]]


def test_history_window_and_layers_independent() -> None:
    # Ten old steps say experts 0 and 1 are hot, the last two that all are equal; the planner's
    # own `loads` (expert 3 hot) are ignored when there is history.
    history = np.zeros((12, 2, 2, 4))
    history[:, :, 0] = [9, 9, 1, 1]
    history[-2:, :, 0] = [1, 1, 1, 1]
    loads = np.zeros((2, 2, 4))
    loads[:, 0] = [0, 0, 0, 9]
    spec2 = SPEC.with_(moe_layers=2)

    def plan_with(window: int, hist: np.ndarray) -> object:
        ctx = PlanContext.create(
            get_cluster("cpu-2"),
            spec2,
            history=hist.sum(axis=2),
            options={"permute": {"window": window}},
        )
        return make_plan("permute", loads, None, ctx)

    # Window 2: h = [1, 1, 1, 1]; the greedy reaches [2, 2], as static does: rejected.
    assert plan_with(2, history).notes["accepted"] == [False, False]
    # Window 12: h = [23/3, 23/3, 1, 1]; [25/3, 25/3] beats 46/3: accepted.
    plan = plan_with(12, history)
    assert plan.notes["accepted"] == [True, True]
    assert plan.placement.home.tolist() == [[0, 1, 1, 0]] * 2
    # Default window 10 covers the flat steps and 8 skewed ones: still accepted.
    assert plan_with(10, history).notes["accepted"] == [True, True]
    # Layers are planned independently: flatten layer 0 only.
    history[:, 0, 0] = [1, 1, 1, 1]
    plan = plan_with(12, history)
    assert plan.notes["accepted"] == [False, True]
    assert plan.placement.home.tolist() == [[0, 0, 1, 1], [0, 1, 1, 0]]
    # No history: the loads decide (expert 3 hot, static [0, 0, 1, 1] max 9; greedy can't beat).
    assert plan_with(10, np.zeros((0, 2, 2, 4))).notes["accepted"] == [False, False]


def test_deterministic_on_zipf() -> None:
    rng = np.random.default_rng(3)
    spec = ModelSpec("z", d_model=64, d_expert=128, experts=64, top_k=2, moe_layers=3)
    cluster = get_cluster("dgx-h100:2")
    p = 1.0 / np.arange(1, 65) ** 1.0
    loads = np.stack(
        [rng.multinomial(4096, rng.permutation(p / p.sum()), size=16) for _ in range(3)]
    ).astype(np.float64)
    ctx = PlanContext.create(cluster, spec)
    a = make_plan("permute", loads, None, ctx)
    b = make_plan("permute", loads, None, ctx)
    assert np.array_equal(a.placement.home, b.placement.home)
    assert np.all(a.placement.slots_used() <= 4)
    static = make_plan("static", loads, None, ctx)
    assert a.cost.max_over_mean <= static.cost.max_over_mean
