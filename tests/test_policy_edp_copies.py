"""More devices than experts (issue 17, item 6): `shadow` and `prophet` keep the static placement's
expert-data-parallel copies instead of routing every token of an expert to its one home. Since
issue 66 the static placement is DeepSpeed-MoE's expert-parallel groups (device d holds expert
d mod E, each token goes to the copy inside its own group of E devices, `poise.core.static_ep`),
no longer a block of devices per expert with every token split over all copies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from poise.core.placement import Placement, Plan
from poise.core.presets import get_cluster
from poise.core.spec import MODELS, ModelSpec
from poise.core.static_ep import static_assignment
from poise.cost.model import CostModel
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.base import static_placement
from poise.plan.policies.shadow import first_non_improvement, shadow_layers_on_copies
from poise.trace.generate import generate
from poise.trace.importers import import_smartmoe
from poise.trace.loads import fit_devices

from .helpers import toy_cluster, toy_spec

BALANCERS = ("shadow", "prophet")


def _drift_case(slots: int | None = None) -> tuple[np.ndarray, PlanContext]:
    """32 devices (four DGX H100 nodes), 16 experts (DeepSpeed's EP groups of 16 devices, two
    nodes each), 4 layers, one step of a drift trace; `slots` defaults to the simulator's
    ceil(E / D) + 1 (one spare slot per device). Priced without the H100's per-call floor: the
    tiny model's GEMMs sit under it, and `shadow`'s FasterMoE model does not know the floor (a
    known gap: there it can shadow at a loss). Another gap of that model: it charges every
    token that leaves its device at the slowest link's bandwidth, so with EP groups inside one
    node (8 experts on these nodes) it shadows although the tokens never leave their node, and
    prices below static only here, where half of each group's tokens cross the node link."""
    cluster = dataclasses.replace(get_cluster("dgx-h100:4"), expert_call_floor_s=0.0)
    spec = MODELS["tiny"].with_(experts=16, moe_layers=4)
    trace = generate(
        "drift", steps=1, layers=4, devices=32, experts=16, top_k=2, tokens_per_device=2048, seed=1
    )
    ctx = PlanContext.create(cluster, spec, slots_per_device=2 if slots is None else slots)
    return trace.counts[0].astype(np.float64), ctx


def _smartmoe_case(smartmoe_dir: Path) -> tuple[np.ndarray, PlanContext]:
    """The SmartMoE-AE sample (32 experts, 16 ranks) spread over 64 devices (8 DGX H100 nodes):
    its last step's loads, two slots per device."""
    trace = import_smartmoe(smartmoe_dir)
    cluster = get_cluster("dgx-h100:8")
    spec = MODELS["smartmoe-gpt"].with_(moe_layers=trace.layers)
    loads = fit_devices(trace.counts[-1], cluster.num_devices).astype(np.float64)
    return loads, PlanContext.create(cluster, spec, slots_per_device=2)


def _assert_not_worse_than_static(plan: Plan, static: Plan) -> None:
    assert (plan.placement.copies >= static.placement.copies).all()  # every EDP copy kept
    np.testing.assert_array_equal(plan.placement.home, static.placement.home)
    assert plan.cost.max_over_mean <= static.cost.max_over_mean * (1 + 1e-12)
    assert plan.cost.step_s <= static.cost.step_s * (1 + 1e-12)


@pytest.mark.parametrize("name", BALANCERS)
def test_drift_keeps_static_copies_and_balance(name: str) -> None:
    loads, ctx = _drift_case()
    static = make_plan("static", loads, None, ctx)
    plan = make_plan(name, loads, None, ctx)
    _assert_not_worse_than_static(plan, static)
    assert plan.notes["edp_copies"] is True


@pytest.mark.parametrize("name", BALANCERS)
def test_smartmoe_sample_keeps_static_copies_and_balance(name: str, smartmoe_dir: Path) -> None:
    loads, ctx = _smartmoe_case(smartmoe_dir)
    static = make_plan("static", loads, None, ctx)
    plan = make_plan(name, loads, None, ctx)
    _assert_not_worse_than_static(plan, static)


def test_shadow_beats_static_where_a_slot_is_free() -> None:
    # With a spare slot per device the hot experts are shadowed on top of the copies: each
    # shadow fills the devices without a copy, the copies stay, and the step is faster.
    loads, ctx = _drift_case()
    static = make_plan("static", loads, None, ctx)
    plan = make_plan("shadow", loads, None, ctx)
    assert all(len(s) == 1 for s in plan.notes["shadowed"])  # one spare slot: one shadow
    for layer, (e,) in enumerate(plan.notes["shadowed"]):
        assert (plan.placement.copies[layer, :, e] == 1).all()  # held everywhere
    added = plan.placement.copies - static.placement.copies
    assert added.sum() == 4 * (32 - 2)  # per layer: every device but the 2 copies of e
    assert plan.cost.step_s < static.cost.step_s
    assert plan.cost.max_over_mean < static.cost.max_over_mean
    # Experts not shadowed keep static's routing inside the EP groups of 16 devices.
    assert plan.assignment.group_size == static.assignment.group_size == 16
    for layer, (e,) in enumerate(plan.notes["shadowed"]):
        rest = np.arange(16) != e
        np.testing.assert_array_equal(
            plan.assignment.group_weights[layer, rest],
            static.assignment.group_weights[layer, rest],
        )


@pytest.mark.parametrize("name", BALANCERS)
def test_no_spare_slot_gives_static_plan(name: str) -> None:
    # One slot per device (the least with E < D): the copies fill every slot, nothing is added.
    loads, ctx = _drift_case(slots=1)
    static = make_plan("static", loads, None, ctx)
    plan = make_plan(name, loads, None, ctx)
    np.testing.assert_array_equal(plan.placement.copies, static.placement.copies)
    np.testing.assert_array_equal(plan.assignment.weights, static.assignment.weights)
    np.testing.assert_array_equal(plan.assignment.group_weights, static.assignment.group_weights)
    assert plan.cost.step_s == static.cost.step_s


def test_prophet_plan_is_static_with_more_devices_than_experts() -> None:
    loads, ctx = _drift_case(slots=3)
    static = make_plan("static", loads, None, ctx)
    plan = make_plan("prophet", loads, static, ctx)
    np.testing.assert_array_equal(plan.placement.copies, static.placement.copies)
    np.testing.assert_array_equal(plan.assignment.weights, static.assignment.weights)
    np.testing.assert_array_equal(plan.assignment.group_weights, static.assignment.group_weights)
    assert plan.notes["replicated"] == [[] for _ in range(4)]
    assert len(plan.transfers.migrations) == 0


def _fastermoe_lat(counts: np.ndarray, placement: Placement, t_comp: float, t_feat: float) -> float:
    """FasterMoE's latency of one layer (`counts[D, E]`) with static's routing over the holders
    (`static_assignment`), priced the plain way: compute C[d] and max(sent, received) tokens
    B[d] per device."""
    one = placement.take_layers([0])
    held = one.holders()[0]
    computed = static_assignment(one).received(one, counts[None])[0]  # [D, E]
    sent = np.where(held, 0.0, counts).sum(axis=1)
    received = (computed - np.where(held, counts, 0.0)).sum(axis=1)
    return float((t_comp * computed.sum(axis=1) + t_feat * np.maximum(sent, received)).max())


def test_walk_on_copies_equals_pricing_each_prefix() -> None:
    # The walk from static's copies: lat[k] equals the FasterMoE model of the placement with
    # the k hottest experts shadowed (every device holding them), plus k t_shadow.
    rng = np.random.default_rng(3)
    t_comp, t_feat, t_shadow = 1e-9, 1e-7, 1e-6
    for _ in range(20):
        D = int(rng.integers(2, 13))
        E = int(rng.integers(1, min(D, 6)))
        counts = np.floor(rng.zipf(1.4, (2, D, E)) * rng.random((2, D, E)) * 100)
        static = static_placement(2, E, D, E + 1)  # room to shadow every expert
        order, k, lat0, lat_k = shadow_layers_on_copies(
            counts, static, static_assignment(static), t_comp, t_feat, t_shadow
        )
        for layer in range(2):
            lat = []
            for n in range(E + 1):
                shadowed = static.take_layers([layer])
                shadowed.copies[0][:, order[layer, :n]] = np.maximum(
                    shadowed.copies[0][:, order[layer, :n]], 1
                )
                lat.append(_fastermoe_lat(counts[layer], shadowed, t_comp, t_feat) + n * t_shadow)
            want = first_non_improvement(np.array(lat))
            assert k[layer] == want
            assert lat0[layer] == pytest.approx(lat[0], rel=1e-12)
            assert lat_k[layer] == pytest.approx(lat[want], rel=1e-12)


def test_a_shadow_takes_slots_only_where_no_copy_is() -> None:
    # 8 devices, one per node (W_net 1e8 B/s), 2 experts in DeepSpeed's EP groups of 2: expert
    # 0 on the even devices, expert 1 on the odd ones. The even devices send 1000 tokens each
    # to expert 1 (each to its group's odd partner): t_feat = 4*16/1e8 = 6.4e-7 s per token
    # crossing, t_shadow = 256/1e8 * (1 + 2*7/8) = 7.04e-6 s, so expert 1 is shadowed. Its
    # shadow takes one slot on the even devices alone, and fits with 2 slots per device.
    cluster = toy_cluster(1, 8, 1, bw=1e9, inter_bw=1e8, flops=1e12)
    spec: ModelSpec = toy_spec(experts=2, d_model=4, d_expert=8)
    loads = np.full((1, 8, 2), 10.0)
    loads[0, ::2, 1] = 1000.0
    ctx = PlanContext.create(cluster, spec, slots_per_device=2, cost=CostModel(cluster, spec))
    plan = make_plan("shadow", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    np.testing.assert_array_equal(static.placement.copies[0, :, 1], [0, 1] * 4)
    assert plan.notes["shadowed"] == [[1]]
    added = plan.placement.copies - static.placement.copies
    np.testing.assert_array_equal(added[0, :, 1], [1, 0] * 4)
    assert not added[0, :, 0].any()
    np.testing.assert_array_equal(plan.placement.slots_used()[0], [2, 1] * 4)
    # The even devices now compute their own 1000 tokens of expert 1; nothing crosses for it.
    computed = plan.assignment.received(plan.placement, loads)[0]
    np.testing.assert_array_equal(computed[:, 1], [1000, 10] * 4)
    t_comp, t_feat, t_shadow = 3 * 128 / 1e12, 6.4e-7, 256 / 1e8 * (1 + 2 * 7 / 8)
    # lat_0: each odd device computes its own 10 tokens of expert 1 and receives its partner's
    # 1000 (and sends its 10 of expert 0). lat_1: each even device computes its own 10 of
    # expert 0, the 10 its partner sends for it and its own 1000 of expert 1; it receives 10.
    lat0 = t_comp * 1010 + t_feat * 1000
    lat1 = t_comp * 1020 + t_feat * 10 + t_shadow
    np.testing.assert_allclose(plan.notes["fastermoe_lat_s"][0], [lat0, lat1], rtol=1e-12)
    assert plan.cost.step_s < static.cost.step_s


def test_every_expert_shadowed_in_one_spare_slot() -> None:
    # As above, and the odd devices send 900 tokens each to expert 0: both experts are shadowed,
    # and with one copy already on each device both shadows fit in its one spare slot.
    cluster = toy_cluster(1, 8, 1, bw=1e9, inter_bw=1e8, flops=1e12)
    spec: ModelSpec = toy_spec(experts=2, d_model=4, d_expert=8)
    loads = np.full((1, 8, 2), 10.0)
    loads[0, ::2, 1] = 1000.0
    loads[0, 1::2, 0] = 900.0
    ctx = PlanContext.create(cluster, spec, slots_per_device=2, cost=CostModel(cluster, spec))
    plan = make_plan("shadow", loads, None, ctx)
    assert plan.notes["shadowed"] == [[1, 0]]
    assert (plan.placement.copies == 1).all()
    np.testing.assert_array_equal(plan.assignment.received(plan.placement, loads), loads)
