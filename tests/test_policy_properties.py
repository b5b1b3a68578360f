"""Every registered policy keeps the invariants on random loads, including the corner cases:
zero loads, one device, more devices than experts, tiny and huge counts, multi-node and
multi-domain clusters."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.cost.model import CostModel
from poise.plan.policies import REGISTRY, PlanContext, make_plan

from .helpers import toy_cluster, toy_spec

POLICIES = sorted(REGISTRY)


@st.composite
def planning_case(draw):
    devices_per_node = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.sampled_from([1, 2]))
    domains = draw(st.sampled_from([1, 2]))
    devices = devices_per_node * nodes * domains
    experts = draw(st.integers(1, 12))
    layers = draw(st.integers(1, 3))
    scale = draw(st.sampled_from([0, 1, 3, 1000, 10**7]))
    seed = draw(st.integers(0, 2**32 - 1))
    extra_slots = draw(st.integers(0, 3))
    rng = np.random.default_rng(seed)
    skew = rng.zipf(1.5, size=(layers, devices, experts)).astype(float)
    loads = np.floor(rng.random((layers, devices, experts)) * scale * skew / skew.max())
    cluster = toy_cluster(
        devices_per_node, nodes, domains, bw=1e9, inter_bw=2e8, wan_bw=1e7, lat=1e-6, flops=1e12
    )
    spec = toy_spec(
        experts=experts,
        layers=layers,
        d_model=64,
        d_expert=128,
        tokens=max(1, int(loads.sum(axis=2).max())),
    )
    slots = -(-experts // devices) + extra_slots
    return cluster, spec, slots, loads


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=planning_case())
def test_policy_keeps_invariants(policy: str, case) -> None:
    cluster, spec, slots, loads = case
    ctx = PlanContext.create(
        cluster,
        spec,
        slots_per_device=slots,
        cost=CostModel(cluster, spec),
        history=loads.sum(axis=1)[None],
    )
    plan = make_plan(policy, loads, None, ctx)
    plan.validate()
    p = plan.placement
    assert p.home.shape == (spec.moe_layers, spec.experts)
    assert p.slots_used().max() <= slots
    assert np.all(p.copies.sum(axis=1) >= 1)  # every expert has a holder
    received = plan.assignment.received(p, loads)
    np.testing.assert_allclose(received.sum(axis=1), loads.sum(axis=1), rtol=1e-9, atol=1e-6)
    assert np.all(received[~p.holders()] <= 1e-9)  # only holders compute tokens
    assert np.isfinite(plan.cost.step_s) and plan.cost.step_s >= 0
    # Re-planning from its own plan keeps the invariants too, and is deterministic.
    again = make_plan(policy, loads, plan, ctx)
    again.validate()
    twice = make_plan(policy, loads, plan, ctx)
    np.testing.assert_array_equal(again.placement.copies, twice.placement.copies)
    np.testing.assert_array_equal(again.placement.home, twice.placement.home)


def test_auto_never_slower_than_any_candidate() -> None:
    rng = np.random.default_rng(3)
    cluster = toy_cluster(4, 2, 1, bw=1e10, inter_bw=1e9, lat=2e-6, flops=1e13)
    spec = toy_spec(experts=16, layers=4, d_model=512, d_expert=1024, tokens=4096)
    loads = rng.zipf(1.3, size=(4, 8, 16)).astype(float) * 50
    ctx = PlanContext.create(cluster, spec, slots_per_device=4, cost=CostModel(cluster, spec))
    auto = make_plan("auto", loads, None, ctx)
    for name in POLICIES:
        other = make_plan(name, loads, None, ctx)
        assert auto.cost.step_s <= other.cost.step_s * (1 + 1e-12), name


def test_auto_breaks_ties_toward_the_fewest_copies() -> None:
    """A uniform forecast (the first step) prices many placements alike; auto keeps the tied one
    with the fewest copies, leaving free slots for later re-planning."""
    cluster = toy_cluster(4, 2, 1, bw=1e10, inter_bw=1e9, lat=2e-6, flops=1e13)
    spec = toy_spec(experts=16, layers=2, d_model=512, d_expert=1024, tokens=4096)
    loads = np.full((2, 8, 16), 64.0)
    ctx = PlanContext.create(cluster, spec, slots_per_device=4, cost=CostModel(cluster, spec))
    auto = make_plan("auto", loads, None, ctx)
    plans = {n: make_plan(n, loads, None, ctx) for n in POLICIES if n != "auto"}
    for layer, chosen in enumerate(auto.notes["chosen"]):
        best = min(p.cost.layer_s[layer] for p in plans.values())
        tied = [
            p.placement.copies[layer].sum()
            for p in plans.values()
            if p.cost.layer_s[layer] <= best * (1 + 1e-9)
        ]
        assert plans[chosen].placement.copies[layer].sum() == min(tied)
    assert auto.placement.copies.sum() < plans["eplb"].placement.copies.sum()


def test_auto_plans_the_same_with_candidates_in_threads(monkeypatch) -> None:
    """On large problems auto's candidates plan in threads; the plan does not change, and the
    helper threads' CPU time is reported for the planning charge."""
    from poise.plan.policies import auto as auto_module
    from poise.plan.policies.base import HELPER_CPU_NOTE

    rng = np.random.default_rng(5)
    cluster = toy_cluster(4, 2, 1, bw=1e10, inter_bw=1e9, lat=2e-6, flops=1e13)
    spec = toy_spec(experts=16, layers=3, d_model=512, d_expert=1024, tokens=4096)
    loads = rng.zipf(1.3, size=(3, 8, 16)).astype(float) * 50
    ctx = PlanContext.create(cluster, spec, slots_per_device=4, cost=CostModel(cluster, spec))
    alone = make_plan("auto", loads, None, ctx)
    assert alone.notes[HELPER_CPU_NOTE] == 0.0
    monkeypatch.setattr(auto_module, "PARALLEL_CELLS", 1)
    monkeypatch.setattr(auto_module.os, "cpu_count", lambda: 2)
    threaded = make_plan("auto", loads, None, ctx)
    assert threaded.notes[HELPER_CPU_NOTE] > 0.0
    assert threaded.notes["chosen"] == alone.notes["chosen"]
    np.testing.assert_array_equal(threaded.placement.copies, alone.placement.copies)
    np.testing.assert_array_equal(threaded.assignment.weights, alone.assignment.weights)
    assert threaded.cost.step_s == alone.cost.step_s


def test_auto_migration_scale_weighs_the_one_off_moves() -> None:
    """`total = K * recurring + m * migrate` per layer: from the static placement on skewed
    loads, m = 0 makes moving free, so each layer takes a candidate whose recurring time is the
    least of all (to the tie window); a prohibitive m leaves only candidates that move nothing
    (`keep`, or replicas whose fill the cost model counts as Trans, not migration)."""
    rng = np.random.default_rng(5)
    cluster = toy_cluster(4, 2, 1, bw=1e10, inter_bw=1e9, lat=2e-6, flops=1e13)
    spec = toy_spec(experts=16, layers=3, d_model=512, d_expert=1024, tokens=4096)
    loads = rng.zipf(1.3, size=(3, 8, 16)).astype(float) * 50

    def ctx(scale: float) -> PlanContext:
        return PlanContext.create(
            cluster, spec, slots_per_device=3, cost=CostModel(cluster, spec),
            options={"auto": {"migration_scale": scale}},
        )  # fmt: skip

    static = make_plan("static", loads, None, ctx(1.0))
    free = make_plan("auto", loads, static, ctx(0.0))
    dear = make_plan("auto", loads, static, ctx(1e12))
    others = [make_plan(n, loads, static, ctx(0.0)) for n in POLICIES if n != "auto"]
    recurring = free.cost.layer_s - free.cost.phases.migrate_s
    for p in others:
        assert np.all(recurring <= (p.cost.layer_s - p.cost.phases.migrate_s) * (1 + 1e-9))
    assert free.cost.phases.migrate_s.sum() > 0  # moving homes pays when it is free
    assert np.all(dear.cost.phases.migrate_s == 0)
    barred = make_plan("auto", loads, static, ctx(np.inf))  # no migration at all: no NaN
    assert np.all(barred.cost.phases.migrate_s == 0)
    assert np.all(np.isfinite(barred.cost.layer_s))
    assert barred.placement.replicas().any()  # replicas still balance the skew
