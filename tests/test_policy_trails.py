"""`auto` continues each rival's own trail (`Plan.trails`): the plan the rival would have in
force had it run alone, so `auto` can always take that placement."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.cost.model import CostModel
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.auto import ALONE
from poise.plan.policies.base import BUILDS_ON, REGISTRY
from poise.sim.scenarios import SCENARIOS
from poise.sim.scenarios.core import build_trace
from poise.sim.simulator import simulate
from poise.trace.generate import generate

from .helpers import assert_priced_as_the_cost_model, toy_cluster, toy_spec

RIVALS = sorted(n for n in REGISTRY if n != "auto")


def _case(seed: int = 0):
    cluster = toy_cluster(2, 2, 1, 1e9, 2e8, 1e7)
    spec = toy_spec(experts=8, layers=3, d_model=64, d_expert=128, tokens=1000, non_moe=1e5)
    ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=CostModel(cluster, spec))
    rng = np.random.default_rng(seed)
    skew = rng.zipf(1.5, size=(3, 4, 8)).astype(float)
    loads = np.floor(1000 * skew / skew.max(axis=2, keepdims=True))
    return ctx, loads


def _random_previous(ctx: PlanContext, rng: np.random.Generator, weights: str) -> Plan:
    """A valid plan in force: shuffled homes, a replica of each layer's expert 0 where a slot is
    free, tokens routed evenly or to the homes."""
    L, D, E = ctx.spec.moe_layers, ctx.devices, ctx.experts
    seats = np.repeat(np.arange(D), ctx.slots_per_device)
    home = np.stack([rng.permutation(seats)[:E] for _ in range(L)])
    placement = Placement.from_homes(home, D, ctx.slots_per_device)
    for layer in range(L):
        free = np.flatnonzero(
            (placement.copies[layer].sum(axis=1) < ctx.slots_per_device)
            & (placement.copies[layer, :, 0] == 0)
        )
        if free.size:
            placement.copies[layer, free[0], 0] = 1
    assignment = Assignment.even(placement) if weights == "even" else Assignment.to_home(placement)
    return Plan("given", placement, assignment, transfers_between(None, placement, ctx.spec))


def _assert_same_plan(a: Plan, b: Plan, what: str) -> None:
    np.testing.assert_array_equal(a.placement.home, b.placement.home, err_msg=what)
    np.testing.assert_array_equal(a.placement.copies, b.placement.copies, err_msg=what)
    np.testing.assert_array_equal(a.assignment.weights, b.assignment.weights, err_msg=what)


def _without_replicas(plan: Plan) -> Plan:
    placement = Placement.from_homes(
        plan.placement.home, plan.placement.devices, plan.placement.slots_per_device
    )
    return dataclasses.replace(plan, placement=placement, assignment=Assignment.to_home(placement))


@pytest.mark.parametrize("name", RIVALS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_policy_builds_on_what_it_declares(name: str, seed: int) -> None:
    """What `auto`'s trails rely on (`BUILDS_ON`): plans in force that agree on what a policy
    declares it builds on give the same plan. Every policy sees only the placement (not the
    token shares); a `homes` policy only the homes (not the replicas); an undeclared one
    (`static`, `eplb`) nothing."""
    ctx, loads = _case(seed)
    rng = np.random.default_rng(seed + 10)
    a = _random_previous(ctx, rng, "even")
    assert a.placement.replicas().any()
    reference = make_plan(name, loads, a, ctx)
    same_placement = dataclasses.replace(a, assignment=Assignment.to_home(a.placement))
    _assert_same_plan(reference, make_plan(name, loads, same_placement, ctx), "shares")
    if BUILDS_ON.get(name) in ("homes", None):
        _assert_same_plan(reference, make_plan(name, loads, _without_replicas(a), ctx), "copies")
    if name not in BUILDS_ON:
        other = make_plan(name, loads, _random_previous(ctx, rng, "home"), ctx)
        _assert_same_plan(reference, other, "homes")


def test_the_declarations_are_not_weaker_than_the_policies() -> None:
    """The declarations name what the policies do read: `vexpert` plans differently from
    two placements with the same homes, and every `homes` policy from two sets of homes."""
    assert {"static", "eplb"}.isdisjoint(BUILDS_ON)
    assert BUILDS_ON["vexpert"] == "placement"
    assert {n for n, on in BUILDS_ON.items() if on == "homes"} == {
        "permute",
        "prophet",
        "hybrid",
        "shadow",
    }
    ctx, loads = _case(0)
    rng = np.random.default_rng(3)
    a = _random_previous(ctx, rng, "even")
    differs = {}
    for name in RIVALS:
        if name not in BUILDS_ON:
            continue
        b = (
            _without_replicas(a)
            if BUILDS_ON[name] == "placement"
            else _random_previous(ctx, rng, "even")
        )
        pa, pb = make_plan(name, loads, a, ctx), make_plan(name, loads, b, ctx)
        differs[name] = not (
            np.array_equal(pa.placement.copies, pb.placement.copies)
            and np.array_equal(pa.placement.home, pb.placement.home)
        )
    assert all(differs.values()), differs


def test_auto_takes_a_rivals_own_placement_from_its_trail() -> None:
    """The plan in force is a poor placement; `vexpert`'s trail holds the placement `vexpert`
    reached from the static one. `auto` runs `vexpert` from both, offers the trail's plan as
    `vexpert:alone` priced with its migrations from the plan in force, and continues the
    trail from there."""
    ctx, loads = _case(3)
    poor = _random_previous(ctx, np.random.default_rng(5), "home")
    own = make_plan("vexpert", loads, None, ctx)
    assert not np.array_equal(own.placement.copies, poor.placement.copies)
    in_force = dataclasses.replace(poor, trails={"vexpert": own})
    plan = make_plan("auto", loads, in_force, ctx)
    assert "vexpert" in plan.notes["alone"]
    label = "vexpert" + ALONE
    assert label in plan.notes["candidate_step_s"]
    continued = make_plan("vexpert", loads, own, ctx)
    np.testing.assert_array_equal(
        plan.trails["vexpert"].placement.copies, continued.placement.copies
    )
    # The candidate is the continued trail's plan, priced from the plan in force.
    repriced = make_plan("vexpert", loads, poor, ctx)  # not the trail: another placement
    assert not np.array_equal(repriced.placement.copies, continued.placement.copies)
    fresh = ctx.cost.price(continued.placement, continued.assignment, loads)
    migrations = transfers_between(poor.placement, continued.placement, ctx.spec).migrations
    priced = ctx.cost.price(continued.placement, continued.assignment, loads, migrations)
    assert plan.notes["candidate_step_s"][label] == pytest.approx(priced.step_s, rel=1e-12)
    assert priced.step_s >= fresh.step_s  # the migrations are paid
    assert_priced_as_the_cost_model(plan, ctx.cost, loads)


def test_a_trail_on_the_placement_in_force_runs_once() -> None:
    """While `auto` holds a rival's own placement, the rival's run from the plan in force is
    its trail's continuation: no second run, no `:alone` candidate."""
    ctx, loads = _case(4)
    start = make_plan("static", loads, None, ctx)
    first = make_plan("auto", loads, start, ctx)
    assert first.notes["alone"] == []
    assert set(first.trails) == set(BUILDS_ON) - {"auto"} - set(first.notes["pruned_bound_step_s"])
    held = dataclasses.replace(
        first,
        trails={
            n: dataclasses.replace(p, placement=first.placement) for n, p in first.trails.items()
        },
    )
    second = make_plan("auto", loads, held, ctx)
    assert second.notes["alone"] == []
    assert not any(k.endswith(ALONE) for k in second.notes["candidate_step_s"])


def test_auto_trails_replay_each_policy_alone() -> None:
    """In a replay, `auto`'s trail of each rival equals the plan the rival made alone at the
    same step: `auto` could have taken any rival's placement at every re-plan."""
    cluster = toy_cluster(2, 2, 1, 1e9, 2e8, 1e7)
    spec = toy_spec(experts=8, layers=3, d_model=64, d_expert=128, tokens=1000, non_moe=1e5)
    trace = generate(
        "drift", steps=31, layers=3, devices=4, experts=8, top_k=2, tokens_per_device=1000, seed=2
    )
    rivals = sorted(set(BUILDS_ON) - {"auto"})
    plans: dict[str, list[Plan]] = {n: [] for n in [*rivals, "auto"]}
    import poise.sim.simulator as sim

    real = sim.make_plan_reusing

    def record(name, loads, previous, ctx):
        plan, reused_cpu_s = real(name, loads, previous, ctx)
        plans.setdefault(name, []).append(plan)
        return plan, reused_cpu_s

    sim.make_plan_reusing = record
    try:
        simulate(
            trace,
            cluster,
            spec,
            [*rivals, "auto"],
            "sync",
            10,
            "ema",
            options={"auto": {"prune": False}},
            background_planning=True,
            workers=1,
        )
    finally:
        sim.make_plan_reusing = real
    assert len(plans["auto"]) == 4
    alone_seen = False
    for step, made in enumerate(plans["auto"]):
        alone_seen |= bool(made.notes["alone"])
        for name in rivals:
            mine, theirs = made.trails[name].placement, plans[name][step].placement
            np.testing.assert_array_equal(mine.home, theirs.home, err_msg=f"{name} @ {step}")
            np.testing.assert_array_equal(mine.copies, theirs.copies, err_msg=f"{name} @ {step}")
    assert alone_seen, "auto left some rival's placement (the trail ran apart)"


def test_auto_is_not_slower_than_vexpert_over_a_long_flexmoe_replay() -> None:
    """The loss the trails fixed: on FlexMoE's 64-GPU BERT-MoE over 200 steps, `auto` took
    `eplb`'s placement early, and `vexpert`'s local search from there could not reach the placements
    `vexpert` alone reached from the static one; `auto` was 3.8% slower than `vexpert`."""
    s = SCENARIOS["flexmoe"]
    case = next(c for c in s.cases if c.label == "64 GPUs, BERT-MoE")
    case = dataclasses.replace(case, trace=dataclasses.replace(case.trace, steps=200))
    trace, _ = build_trace(case, False, None)
    result = simulate(
        trace,
        case.get_cluster(),
        case.spec,
        ["vexpert", "auto"],
        "sync",
        s.replan_every,
        s.predictor,
        count_planning=False,
        background_planning=s.background_planning,
    )
    w = s.warmup_steps
    auto, vexpert = (result.runs[n].step_s[w:].mean() for n in ("auto", "vexpert"))
    assert auto < vexpert


def test_trails_survive_a_checkpoint() -> None:
    """A resumed run re-plans as an uninterrupted one: the checkpoint keeps `auto`'s trails, and
    the next plan from the restored plan equals the next plan from the original."""
    from poise.train.checkpoint import plan_from_payload, plan_to_payload

    ctx, loads = _case(6)
    poor = _random_previous(ctx, np.random.default_rng(7), "home")
    in_force = dataclasses.replace(poor, trails={"vexpert": make_plan("vexpert", loads, None, ctx)})
    plan = make_plan("auto", loads, in_force, ctx)
    assert plan.trails
    restored = plan_from_payload(plan_to_payload(plan), None, ctx.spec)
    assert set(restored.trails) == set(plan.trails)
    for name, trail in plan.trails.items():
        _assert_same_plan(trail, restored.trails[name], name)
    shifted = loads[:, ::-1].copy()
    after, after_restored = (make_plan("auto", shifted, p, ctx) for p in (plan, restored))
    assert after.notes["chosen"] == after_restored.notes["chosen"]
    _assert_same_plan(after, after_restored, "next plan")
    no_trails = plan_to_payload(plan)
    del no_trails["trails"]  # a checkpoint from before trails
    assert plan_from_payload(no_trails, None, ctx.spec).trails == {}


def _totals(plan: Plan, horizon: float) -> np.ndarray:
    """`[L]` `auto`'s objective of the plan it chose: K steps of recurring time plus migration."""
    migrate = plan.cost.phases.migrate_s
    return horizon * (plan.cost.layer_s - migrate) + migrate


@pytest.mark.parametrize("seed", range(8))
def test_trails_only_add_candidates(seed: int) -> None:
    """With trails `auto` chooses among more candidates, never fewer: per layer its chosen
    total is at most the total it chooses without them (same loads, same plan in force), with
    pruning on and off."""
    ctx, loads = _case(seed)
    rng = np.random.default_rng(100 + seed)
    in_force = _random_previous(ctx, rng, "even")
    trails = {
        name: make_plan(
            name, rng.permutation(loads, axis=2), _random_previous(ctx, rng, "home"), ctx
        )
        for name in BUILDS_ON
        if name != "auto"
    }
    for prune in (True, False):
        opts = {"auto": {"prune": prune, "horizon": 10}}
        c = dataclasses.replace(ctx, options=opts)
        with_trails = make_plan("auto", loads, dataclasses.replace(in_force, trails=trails), c)
        without = make_plan("auto", loads, in_force, c)
        assert with_trails.notes["alone"], "some trail left the placement in force"
        assert np.all(_totals(with_trails, 10) <= _totals(without, 10) * (1 + 1e-9) + 1e-15)


def test_a_trail_with_other_slots_is_not_continued() -> None:
    """A trail made when devices had more slots than now is dropped (the rival starts again
    from the placement in force), not continued into a plan that does not fit."""
    ctx, loads = _case(9)
    wide = dataclasses.replace(ctx, slots_per_device=4)
    trail = make_plan("vexpert", loads, None, wide)
    in_force = dataclasses.replace(
        _random_previous(ctx, np.random.default_rng(11), "home"), trails={"vexpert": trail}
    )
    plan = make_plan("auto", loads, in_force, ctx)
    assert plan.notes["alone"] == []
    assert plan.trails["vexpert"].placement.slots_per_device == ctx.slots_per_device
    plan.validate()
