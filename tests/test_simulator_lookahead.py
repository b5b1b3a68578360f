"""The simulator never looks ahead: a plan in force at step s was made from steps before s.

The trace's hot expert jumps from expert 1 to expert 6 at step S0. With the `last` predictor
and a re-plan every step, the plan made at step s sees step s - 1, so the plans in force up to
S0 are the ones made from expert 1's skew (all equal: those steps are equal), and only the plan
of step S0 + 1 may react to expert 6. A simulator that planned on step s's own loads would
react at S0 (and tests that only compare policies would not notice)."""

from __future__ import annotations

import numpy as np
import pytest

import poise.sim.simulator as simulator
from poise.core.placement import Plan
from poise.sim.simulator import simulate

from .helpers import toy_cluster, toy_spec

S, S0, D, E = 10, 5, 4, 8
OLD, NEW = 1, 6  # the hot expert before S0 and from S0 on


def jump_trace(new_hot: int = NEW) -> np.ndarray:
    """`[S, 1, D, E]` counts: 10 per cell, plus 400 per source device for the hot expert (OLD
    before S0, `new_hot` from S0 on). Every step sends the same number of tokens."""
    counts = np.full((S, 1, D, E), 10, dtype=np.int64)
    counts[:S0, 0, :, OLD] += 400
    counts[S0:, 0, :, new_hot] += 400
    return counts


def replay(
    monkeypatch: pytest.MonkeyPatch, counts: np.ndarray, policy: str, background: bool = False
) -> tuple[simulator.PolicyRun, list[Plan]]:
    """One policy re-planning every step with the `last` predictor; the plans it made, in step
    order (one policy, one plan per step)."""
    made: list[Plan] = []
    real = simulator.make_plan_reusing

    def spy(name, loads, previous, ctx):  # type: ignore[no-untyped-def]
        plan, reused_cpu_s = real(name, loads, previous, ctx)
        if name == policy:
            made.append(plan)
        return plan, reused_cpu_s

    monkeypatch.setattr(simulator, "make_plan_reusing", spy)
    cluster = toy_cluster(D, bw=1e9, lat=1e-6, flops=1e10)
    spec = toy_spec(experts=E, layers=1, d_model=64, d_expert=256, tokens=480)
    result = simulate(
        counts, cluster, spec, [policy], "sync", 1, "last",
        count_planning=False, background_planning=background, workers=1,
    )  # fmt: skip
    assert len(made) == S
    return result.runs[policy], made


@pytest.mark.parametrize("policy", ["eplb", "vexpert"])
def test_no_plan_reacts_before_the_jump(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    run, made = replay(monkeypatch, jump_trace(), policy)
    copies = np.array([p.placement.copies[0] for p in made])  # [S, D, E]
    # Steps 1..S0 plan from equal steps 0..S0-1: the same placement, the old hot expert copied,
    # the new one not (its single copy).
    for s in range(1, S0 + 1):
        assert np.array_equal(copies[s], copies[1]), s
    assert copies[1, :, OLD].sum() >= 2
    assert copies[S0, :, NEW].sum() == 1
    # It reacts once it has seen the jump: the plan made at S0 + 1 copies expert 6.
    assert copies[S0 + 1, :, NEW].sum() >= 2
    # Priced on the actual loads: step S0 runs the stale plan, far out of balance; S0 + 1 the
    # plan that saw the jump.
    assert run.max_over_mean[S0] > 1.5 * run.max_over_mean[S0 + 1]
    assert run.max_over_mean[S0 - 1] < run.max_over_mean[S0]


def test_background_plans_react_one_step_later(monkeypatch: pytest.MonkeyPatch) -> None:
    # A plan made at step s from step s - 1 takes effect at s + 1: the stale plan runs at S0 and
    # S0 + 1, the reaction at S0 + 2.
    run, _ = replay(monkeypatch, jump_trace(), "eplb", background=True)
    stale, fresh = run.max_over_mean[S0 + 1], run.max_over_mean[S0 + 2]
    assert run.max_over_mean[S0] > 1.5 * fresh
    assert stale > 1.5 * fresh


@pytest.mark.parametrize("background", [False, True])
def test_the_future_changes_nothing_before_it(
    monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """Two traces equal before S0 and different from S0 on (the hot expert jumps to 6 or to 3):
    every plan made at a step <= S0 is the same, and so is every step before S0."""
    a_run, a_made = replay(monkeypatch, jump_trace(NEW), "eplb", background)
    b_run, b_made = replay(monkeypatch, jump_trace(3), "eplb", background)
    for s in range(S0 + 1):
        assert np.array_equal(a_made[s].placement.copies, b_made[s].placement.copies), s
        assert np.array_equal(a_made[s].assignment.weights, b_made[s].assignment.weights), s
    np.testing.assert_array_equal(a_run.step_s[:S0], b_run.step_s[:S0])
    np.testing.assert_array_equal(a_run.device_load[:S0], b_run.device_load[:S0])
    # From S0 + 1 on the plans follow their own traces.
    assert not np.array_equal(a_made[S0 + 1].placement.copies, b_made[S0 + 1].placement.copies)
