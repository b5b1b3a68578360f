"""FasterMoE dynamic shadowing (`plan/policies/shadow.py`) on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from poise.cost.model import CostModel
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.shadow import (
    first_non_improvement,
    network_bw,
    shadow_latencies,
    shadow_layers,
)

from .helpers import toy_cluster, toy_spec


def _skewed(devices: int, experts: int, hot: dict[int, float], cold: float = 1.0) -> np.ndarray:
    """`[1, D, E]`: every device sends `hot[e]` tokens to each hot expert, `cold` to the rest."""
    loads = np.full((1, devices, experts), cold)
    for e, n in hot.items():
        loads[0, :, e] = n
    return loads


def _ctx(cluster, spec, slots: int) -> PlanContext:
    return PlanContext.create(cluster, spec, slots_per_device=slots, cost=CostModel(cluster, spec))


def test_hot_expert_on_slow_network_is_shadowed() -> None:
    # 4 devices, one per node: W_net = inter-node 1e8 B/s. fp32 experts 4 -> 8 -> 4:
    # W_e = 2*4*8*4 = 256 B, B_t = 16 B, F_t = 128 FLOP, P = 1e12.
    # t_comp = 3*128/1e12 = 3.84e-10, t_feat = 4*16/1e8 = 6.4e-7,
    # t_shadow = 256/1e8 * (1 + 2*3/4) = 6.4e-6.
    cluster = toy_cluster(1, 4, 1, bw=1e9, inter_bw=1e8, flops=1e12)
    spec = toy_spec(experts=4, d_model=4, d_expert=8)
    loads = _skewed(4, 4, {0: 100.0})  # expert 0 (home device 0) gets 100 from every device
    plan = make_plan("shadow", loads, None, _ctx(cluster, spec, slots=4))
    # lat_0: device 0 computes 400 tokens and receives 300: 3.84e-10*400 + 6.4e-7*300.
    lat0 = 3.84e-10 * 400 + 6.4e-7 * 300
    # lat_1 (expert 0 shadowed): devices 1-3 compute 100 + 4, send 2, receive 3.
    lat1 = 3.84e-10 * 104 + 6.4e-7 * 3 + 6.4e-6
    # lat_2 (expert 1 too, the lowest index of the tied rest): devices 2, 3 compute 105, receive
    # 3: 3.84e-10*105 + 6.4e-7*3 + 2*6.4e-6 > lat_1, so the walk stops after expert 0.
    assert plan.notes["shadowed"] == [[0]]
    np.testing.assert_allclose(plan.notes["fastermoe_lat_s"][0], [lat0, lat1], rtol=1e-12)
    assert np.all(plan.placement.copies[0, :, 0] == 1)  # a copy on every device
    assert plan.placement.home[0, 0] == 0  # homes never move
    assert len(plan.transfers.migrations) == 0
    # Every source holds expert 0, so none of its tokens travel.
    assert np.all(plan.assignment.received(plan.placement, loads)[0, :, 0] == 100)
    static = make_plan("static", loads, None, _ctx(cluster, spec, slots=4))
    assert plan.cost.step_s < static.cost.step_s


def test_huge_experts_on_fast_network_are_not_shadowed() -> None:
    # W_e = 2*1024*4096*4 = 33.5 MB; t_shadow = 33.5e6/1e11 * 2.5 = 8.4e-4 s, while
    # lat_0 = 3*16.8e6/1e15*400 + 4*4096/1e11*300 = 2.0e-5 + 4.9e-5 = 6.9e-5 s: never worth it.
    cluster = toy_cluster(1, 4, 1, bw=1e11, inter_bw=1e11, flops=1e15)
    spec = toy_spec(experts=4, d_model=1024, d_expert=4096)
    loads = _skewed(4, 4, {0: 100.0})
    plan = make_plan("shadow", loads, None, _ctx(cluster, spec, slots=4))
    assert plan.notes["shadowed"] == [[]]
    assert not plan.placement.replicas().any()
    lat0 = 3 * 2 * 2 * 1024 * 4096 / 1e15 * 400 + 4 * 4096 / 1e11 * 300
    np.testing.assert_allclose(plan.notes["fastermoe_lat_s"][0], [lat0, lat0], rtol=1e-12)


def test_greedy_stops_at_first_non_improvement() -> None:
    assert first_non_improvement(np.array([5.0, 4.0, 3.0])) == 2
    assert first_non_improvement(np.array([5.0, 4.0, 4.0, 1.0])) == 1  # a tie stops the walk
    assert first_non_improvement(np.array([5.0, 6.0, 1.0])) == 0  # later gains are never seen
    assert first_non_improvement(np.array([5.0])) == 0


def test_two_hot_experts_shadowed_in_load_order() -> None:
    # 8 experts on 4 devices (two homes each); experts 2 (home 1) and 0 (home 0) are hot,
    # expert 2 hotter: it is shadowed first. 4 slots: 2 free per device, both fit.
    cluster = toy_cluster(1, 4, 1, bw=1e9, inter_bw=1e8, flops=1e12)
    spec = toy_spec(experts=8, d_model=4, d_expert=8)
    loads = _skewed(4, 8, {2: 200.0, 0: 100.0})
    plan = make_plan("shadow", loads, None, _ctx(cluster, spec, slots=4))
    assert plan.notes["shadowed"] == [[2, 0]]
    lat = plan.notes["fastermoe_lat_s"][0]
    assert lat[1] < lat[0]


@pytest.mark.parametrize(("slots", "expected"), [(2, []), (3, [2]), (4, [2, 0])])
def test_slots_bound_the_shadow_set(slots: int, expected: list[int]) -> None:
    # Two homes per device: with 2 slots nothing fits, with 3 slots one shadow fits (it takes
    # the one free slot of every device but its home), with 4 slots both.
    cluster = toy_cluster(1, 4, 1, bw=1e9, inter_bw=1e8, flops=1e12)
    spec = toy_spec(experts=8, d_model=4, d_expert=8)
    loads = _skewed(4, 8, {2: 200.0, 0: 100.0})
    plan = make_plan("shadow", loads, None, _ctx(cluster, spec, slots=slots))
    assert plan.notes["shadowed"] == [expected]
    assert plan.placement.slots_used().max() <= slots


def test_replanning_drops_old_shadows_and_is_deterministic() -> None:
    cluster = toy_cluster(1, 4, 1, bw=1e9, inter_bw=1e8, flops=1e12)
    spec = toy_spec(experts=4, d_model=4, d_expert=8)
    ctx = _ctx(cluster, spec, slots=4)
    hot0 = make_plan("shadow", _skewed(4, 4, {0: 100.0}), None, ctx)
    hot3 = make_plan("shadow", _skewed(4, 4, {3: 100.0}), hot0, ctx)
    assert hot3.notes["shadowed"] == [[3]]
    assert not hot3.placement.replicas()[0, :, 0].any()
    again = make_plan("shadow", _skewed(4, 4, {3: 100.0}), hot0, ctx)
    np.testing.assert_array_equal(again.placement.copies, hot3.placement.copies)


def test_network_bw_is_slowest_level() -> None:
    assert network_bw(toy_cluster(4, 2, 1, bw=1e10, inter_bw=1e9)) == 1e9
    assert network_bw(toy_cluster(4, 1, 1, bw=1e10, inter_bw=1e9)) == 1e10  # one node
    assert network_bw(toy_cluster(2, 1, 2, bw=1e10, inter_bw=1e9, wan_bw=1e7)) == 1e7


def test_walk_in_chunks_equals_each_layer_alone_also_over_its_slots() -> None:
    # The chunked walk (row 0 from the first chunk) and the all-at-once walk of a layer over
    # its slots from the start both equal each layer's full latencies, cut at the first
    # non-improvement; a layer that cannot take one shadow stays at lat_0.
    rng = np.random.default_rng(12)
    for trial in range(60):
        L, D, E = int(rng.integers(1, 4)), int(rng.integers(2, 7)), int(rng.integers(1, 30))
        counts = np.floor(rng.zipf(1.4, (L, D, E)) * rng.random((L, D, E)) * 100)
        home = rng.integers(0, D, (L, E))
        free = rng.integers(-1 if trial % 3 == 0 else 0, E + 1, (L, D))
        times = (1e-9, 1e-7, float(rng.choice([1e-9, 1e-6, 1e-4])))
        order, k, lat0, lat_k = shadow_layers(counts, home, free, *times)
        for layer in range(L):
            want_order, lat = shadow_latencies(counts[layer], home[layer], free[layer], *times)
            np.testing.assert_array_equal(order[layer], want_order)
            n = first_non_improvement(lat) if lat.size else 0
            assert k[layer] == n
            if lat.size:
                assert lat0[layer] == lat[0] and lat_k[layer] == lat[n]
            else:  # over its slots from the start: nothing shadowed
                assert lat_k[layer] == lat0[layer]
