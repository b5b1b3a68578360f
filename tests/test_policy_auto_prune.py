"""`auto` skips candidates that cannot win (`policies.bounds`): the bound never exceeds the price
of a one-copy-per-expert plan, and pruning never changes the plan."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.core.cluster import HostCosts
from poise.core.placement import Assignment, Placement
from poise.core.presets import get_cluster
from poise.core.spec import MODELS
from poise.cost.model import CostModel
from poise.cost.schedule import parse_schedule
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.bounds import homes_only_layer_s
from poise.trace.generate import generate

from .helpers import toy_cluster, toy_spec

SCHEDULES = ["sync", "pipelined(4)", "prophet", "hybrid"]


@st.composite
def homes_case(draw):
    """A random cluster (bandwidths falling outward or not, small-GEMM loss or not, measured
    host costs or not), skewed loads, a schedule and a random one-copy-per-expert placement
    within the slots."""
    dpn = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.sampled_from([1, 2]))
    domains = draw(st.sampled_from([1, 2]))
    devices = dpn * nodes * domains
    experts = draw(st.integers(devices, 16))
    layers = draw(st.integers(1, 3))
    bws = draw(st.sampled_from([(1e9, 2e8, 1e7), (1e9, 1e9, 1e9), (1e8, 1e9, 5e8)]))
    cluster = toy_cluster(dpn, nodes, domains, *bws, lat=draw(st.sampled_from([0.0, 1e-5])))
    cluster = dataclasses.replace(cluster, gemm_half_rows=draw(st.sampled_from([0.0, 64.0])))
    if draw(st.booleans()):  # measured host costs: backward non-MoE compute below 2x forward
        host = HostCosts(dense_fwd_flops=4e8, dense_bwd_flops=2e9, dispatch_fwd_s_per_row=1e-7)
        cluster = dataclasses.replace(cluster, host=host)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([0, 1, 50, 10**5]))
    skew = rng.zipf(1.3, size=(layers, devices, experts)).astype(float)
    loads = np.floor(rng.random((layers, devices, experts)) * scale * skew / skew.max())
    spec = toy_spec(
        experts=experts, layers=layers, d_model=64, d_expert=128, tokens=1000, non_moe=1e5
    )
    slots = -(-experts // devices) + draw(st.integers(0, 2))
    # Random homes with at most `slots` per device: a shuffled list of device slots.
    seats = np.repeat(np.arange(devices), slots)
    home = np.stack([rng.permutation(seats)[:experts] for _ in range(layers)])
    schedule = parse_schedule(draw(st.sampled_from(SCHEDULES)))
    return cluster, spec, slots, loads, home, schedule


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=homes_case())
def test_bound_never_exceeds_a_homes_only_plan(case) -> None:
    cluster, spec, slots, loads, home, schedule = case
    cost = CostModel(cluster, spec, schedule)
    ctx = PlanContext.create(cluster, spec, slots_per_device=slots, cost=cost)
    bound = homes_only_layer_s(loads, ctx)
    assert bound is not None
    placement = Placement.from_homes(home, cluster.num_devices, slots)
    priced = cost.price(placement, Assignment.to_home(placement), loads)
    recurring = priced.layer_s - priced.phases.migrate_s
    assert np.all(bound <= recurring * (1 + 1e-12) + 1e-15)
    for policy in ("static", "permute"):
        plan = make_plan(policy, loads, None, ctx)
        assert np.all(bound <= plan.cost.layer_s * (1 + 1e-12) + 1e-15)


def test_no_bound_with_more_devices_than_experts() -> None:
    cluster = toy_cluster(4, 1, 1)
    spec = toy_spec(experts=2)
    ctx = PlanContext.create(cluster, spec, cost=CostModel(cluster, spec))
    assert homes_only_layer_s(np.ones((1, 4, 2)), ctx) is None


def _same_plan(a, b) -> None:
    assert a.notes["chosen"] == b.notes["chosen"]
    np.testing.assert_array_equal(a.placement.home, b.placement.home)
    np.testing.assert_array_equal(a.placement.copies, b.placement.copies)
    np.testing.assert_array_equal(a.assignment.weights, b.assignment.weights)
    np.testing.assert_array_equal(a.cost.layer_s, b.cost.layer_s)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=homes_case(), horizon=st.sampled_from([1, 10]))
def test_pruning_never_changes_the_plan(case, horizon: int) -> None:
    cluster, spec, slots, loads, _, schedule = case
    cost = CostModel(cluster, spec, schedule)
    plans = {}
    ctxs = {
        prune: PlanContext.create(
            cluster,
            spec,
            slots_per_device=slots,
            cost=cost,
            options={"auto": {"prune": prune, "horizon": horizon}},
        )
        for prune in (True, False)
    }
    unpruned_first = make_plan("auto", loads, None, ctxs[False])
    for prune, ctx in ctxs.items():
        first = make_plan("auto", loads, None, ctx)
        # Again from a plan in force (a `keep` candidate, migrations and the rivals' trails),
        # on shifted loads: the same one for both, the unpruned first plan (a rival pruned in
        # the first call has no trail to continue; module docstring of `auto`).
        plans[prune] = (first, make_plan("auto", loads[:, ::-1], unpruned_first, ctx))
    for pruned, full in zip(plans[True], plans[False], strict=True):
        _same_plan(pruned, full)
        assert not full.notes["pruned_bound_step_s"]


def test_pruning_skips_the_homes_only_candidates_on_a_skewed_trace() -> None:
    """The planner benchmark's zipf-256x32 case: `static` and `permute` cannot come near the
    replicating plans (their hottest expert alone sets the step), so `auto` does not run them
    and returns the plan it returns without pruning."""
    cluster = get_cluster("dgx-h100:4")
    spec = dataclasses.replace(MODELS["zipf-256"], moe_layers=2)
    trace = generate(
        "zipf",
        steps=1,
        layers=2,
        devices=cluster.num_devices,
        experts=spec.experts,
        top_k=spec.top_k,
        tokens_per_device=spec.tokens_per_device,
        seed=0,
        s=0.8,
    )
    loads = trace.counts[0].astype(np.float64)
    made = {}
    for prune in (True, False):
        ctx = PlanContext.create(
            cluster,
            spec,
            slots_per_device=9,
            cost=CostModel(cluster, spec),
            options={"auto": {"prune": prune}},
        )
        made[prune] = make_plan("auto", loads, None, ctx)
    assert sorted(made[True].notes["pruned_bound_step_s"]) == ["permute", "static"]
    assert "permute" not in made[True].notes["candidate_step_s"]
    bound = made[True].notes["pruned_bound_step_s"]["permute"]
    assert bound <= made[False].notes["candidate_step_s"]["permute"]
    _same_plan(made[True], made[False])
