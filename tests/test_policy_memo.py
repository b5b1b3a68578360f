"""`PlanMemo`: the plans made on one forecast are shared by the callers that agree on what each
policy builds on, with the CPU seconds of their making; the simulator's figures do not depend
on it."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Placement, Plan
from poise.cost.model import CostModel
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies import base as policies_base
from poise.plan.policies.base import PlanMemo, previous_key
from poise.plan.policies.registry import make_plan_reusing
from poise.sim.simulator import simulate
from poise.trace.generate import generate

from .helpers import toy_cluster, toy_spec


def _ctx(loads: np.ndarray) -> PlanContext:
    cluster = toy_cluster(2, 2, 1, 1e9, 2e8, 1e7)
    spec = toy_spec(experts=8, layers=3, d_model=64, d_expert=128, tokens=1000, non_moe=1e5)
    return PlanContext(cluster, spec, CostModel(cluster, spec), 3, memo=PlanMemo(loads))


def _loads(seed: int = 0) -> np.ndarray:
    skew = np.random.default_rng(seed).zipf(1.5, size=(3, 4, 8)).astype(float)
    return np.floor(1000 * skew / skew.max(axis=2, keepdims=True))


def test_a_second_call_that_agrees_reuses_the_plan_and_its_cpu_seconds() -> None:
    loads = _loads()
    ctx = _ctx(loads)
    start = make_plan("static", loads, None, ctx)
    first, reused_first = make_plan_reusing("vexpert", loads, start, ctx)
    assert reused_first == 0.0  # made by this call
    # Another plan in force with the same placement (vexpert builds on the placement).
    same = Plan("other", start.placement.copy(), start.assignment, start.transfers)
    second, reused_second = make_plan_reusing("vexpert", loads, same, ctx)
    assert second is first
    assert reused_second == ctx.memo.entries[("vexpert", 3, previous_key("vexpert", start))][1]


def test_what_a_policy_builds_on_keys_the_memo() -> None:
    loads = _loads()
    ctx = _ctx(loads)
    start = make_plan("static", loads, None, ctx)
    copied = start.placement.copy()
    copied.copies[0, (start.placement.home[0, 0] + 1) % 4, 0] = 1  # a replica: homes unchanged
    with_replica = Plan("other", copied, start.assignment, start.transfers)
    assert previous_key("prophet", with_replica) == previous_key("prophet", start)  # homes
    assert previous_key("vexpert", with_replica) != previous_key("vexpert", start)  # placement
    moved = Placement.from_homes(np.roll(start.placement.home, 1, axis=1), 4, 3)
    other_homes = Plan("other", moved, start.assignment, start.transfers)
    # Migrations are priced from the homes: a policy that ignores `previous` still keys on them.
    assert previous_key("static", other_homes) != previous_key("static", start)
    assert previous_key("static", None) is None


@pytest.mark.parametrize("name", ["static", "eplb"])
def test_a_policy_of_the_loads_alone_is_finished_from_each_plan_in_force(name: str) -> None:
    """`static` and `eplb` build on nothing of the plan in force: from another one, the memo
    finishes the first call's placement from it, as the policy itself would."""
    loads = _loads()
    ctx = _ctx(loads)
    start = make_plan("static", loads, None, ctx)
    moved = Placement.from_homes(np.roll(start.placement.home, 1, axis=1), 4, 3)
    other = Plan("other", moved, start.assignment, start.transfers)
    first, _ = make_plan_reusing(name, loads, start, ctx)
    second, reused = make_plan_reusing(name, loads, other, ctx)
    assert reused == ctx.memo.entries[(name, 3, policies_base.LOADS_ONLY)][1]
    fresh = policies_base.REGISTRY[name](loads, other, _ctx(loads))
    assert len(second.transfers.migrations) == len(fresh.transfers.migrations) > 0
    for a, b in ((second, fresh), (first, policies_base.REGISTRY[name](loads, start, ctx))):
        np.testing.assert_array_equal(a.placement.copies, b.placement.copies)
        np.testing.assert_array_equal(a.assignment.weights, b.assignment.weights)
        np.testing.assert_array_equal(a.transfers.migrations, b.transfers.migrations)
        np.testing.assert_array_equal(a.cost.layer_s, b.cost.layer_s)
        np.testing.assert_array_equal(a.cost.phases.migrate_s, b.cost.phases.migrate_s)


def test_other_loads_are_planned_afresh() -> None:
    loads = _loads()
    ctx = _ctx(loads)
    make_plan("eplb", loads, None, ctx)
    kept = set(ctx.memo.entries)
    other = _loads(1)
    plan = make_plan("eplb", other, None, ctx)
    fresh = make_plan("eplb", other, None, _ctx(other))
    np.testing.assert_array_equal(plan.placement.copies, fresh.placement.copies)
    assert set(ctx.memo.entries) == kept


def test_the_simulator_prices_the_same_with_and_without_the_memo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inline planning, planning time not charged: the replay does not depend on timing."""
    cluster = toy_cluster(2, 2, 1, 1e9, 2e8, 1e7)
    spec = toy_spec(experts=8, layers=3, d_model=64, d_expert=128, tokens=1000, non_moe=1e5)
    trace = generate(
        "drift", steps=12, layers=3, devices=4, experts=8, top_k=2, tokens_per_device=1000, seed=3
    )
    names = sorted(policies_base.REGISTRY)

    def run() -> dict[str, np.ndarray]:
        result = simulate(
            trace, cluster, spec, names, "sync", 2, "ema",
            count_planning=False, workers=1,
        )  # fmt: skip
        return {n: r.step_s for n, r in result.runs.items()}

    shared = run()
    monkeypatch.setattr(
        PlanMemo,
        "plan",
        lambda self, name, loads, previous, ctx: (
            policies_base.REGISTRY[name](loads, previous, ctx),
            0.0,
        ),
    )
    alone = run()
    for name in names:
        np.testing.assert_array_equal(shared[name], alone[name], err_msg=name)
