"""Pro-Prophet's lightweight placement (`policies/prophet.py`) on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from poise.cost import CostModel
from poise.policies import PlanContext, make_plan
from poise.policies.prophet import prophet_cost
from poise.schedule import Schedule

from .helpers import toy_cluster, toy_spec


def _hot_from_two(devices: int = 8, experts: int = 8) -> np.ndarray:
    """Expert 0 (home device 0) gets 2000 tokens from each of devices 2 and 5 and 10 from every
    other device; every other expert gets 10 tokens from every device."""
    loads = np.full((1, devices, experts), 10.0)
    loads[0, [2, 5], 0] = 2000.0
    return loads


def _ctx(cluster, spec, schedule: str = "prophet", slots: int = 2) -> PlanContext:
    return PlanContext.create(
        cluster, spec, slots_per_device=slots, cost=CostModel(cluster, spec, Schedule(schedule))
    )


def test_hot_expert_replicated_on_its_two_senders_only() -> None:
    # One node of 8 devices, 1e9 B/s, no latency, 1e12 FLOP/s. fp32 experts 64 -> 128 -> 64:
    # W_e = 2*64*128*4 = 65536 B, B_t = 256 B, F_t = 32768 FLOP. No non-expert compute.
    cluster = toy_cluster(8, 1, 1, bw=1e9, flops=1e12)
    spec = toy_spec(experts=8, d_model=64, d_expert=128, non_moe=0.0)
    loads = _hot_from_two()
    plan = make_plan("prophet", loads, None, _ctx(cluster, spec))
    assert plan.notes["replicated"] == [[0]]
    assert plan.notes["replica_devices"] == [[[2, 5]]]
    assert set(np.flatnonzero(plan.placement.replicas()[0, :, 0])) == {2, 5}
    # After: devices 2, 5 compute 2000 + 80 tokens: FEC = 2080*32768/1e12 = 6.815744e-5.
    # Every device sends or receives at most 70 tokens: A = 70*256/1e9 = 1.792e-5.
    # Trans: the home sends 2 W_e: 131072/1e9 = 1.31072e-4, exposed 1.31072e-4 - FEC - 0;
    # Agg hides under BEC = 1.3631488e-4. T = 4A + 3 FEC + (Trans - FEC).
    fec, a2a, trans = 2080 * 32768 / 1e12, 70 * 256 / 1e9, 131072 / 1e9
    after = 4 * a2a + 3 * fec + max(0.0, trans - fec) + max(0.0, trans - 2 * fec)
    # Before (static): device 0 computes 4060 tokens and receives 4050.
    before = 4 * 4050 * 256 / 1e9 + 3 * 4060 * 32768 / 1e12
    np.testing.assert_allclose(plan.notes["prophet_layer_s"][0], [before, after], rtol=1e-12)
    np.testing.assert_allclose(plan.cost.layer_s[0], after, rtol=1e-12)
    assert plan.cost.phases.trans_s[0] == pytest.approx(trans)
    # The lightest senders (10 tokens) got nothing: their Trans would only add exposed time.
    assert not plan.placement.replicas()[0, [1, 3, 4, 6, 7], 0].any()
    assert len(plan.transfers.migrations) == 0


def test_exposed_trans_blocks_replication_without_overlap_budget() -> None:
    # W_e = 2*64*8192*4 = 4.19 MB: Trans for the two senders is 8.4e-3 s, while the expert
    # compute it could hide under is only ~4e-5 s (1e14 FLOP/s) and there is no non-expert
    # compute: exposed Trans + Agg ~ 1.7e-2 s > the ~4.1e-3 s of all-to-all saved.
    cluster = toy_cluster(8, 1, 1, bw=1e9, flops=1e14)
    loads = _hot_from_two()
    tight = toy_spec(experts=8, d_model=64, d_expert=8192, non_moe=0.0)
    plan = make_plan("prophet", loads, None, _ctx(cluster, tight))
    assert plan.notes["replicated"] == [[]]
    # With 1e10 FLOP of non-expert compute per token (FNEC = 100 * 1e10 / 1e14 = 1e-2 s, more
    # than Trans), the same Trans hides completely and the two senders get replicas.
    roomy = tight.with_(non_moe_flops_per_token=1e10)
    plan = make_plan("prophet", loads, None, _ctx(cluster, roomy))
    assert plan.notes["replica_devices"] == [[[2, 5]]]
    ph = plan.cost.phases
    assert ph.trans_s[0] <= ph.expert_fwd_s[0] + ph.non_moe_fwd_s[0]  # fully hidden


def test_exposed_trans_is_priced_under_sync_too() -> None:
    # ctx.cost is sync: the search still uses the prophet schedule, the plan is priced by ctx.
    cluster = toy_cluster(8, 1, 1, bw=1e9, flops=1e12)
    spec = toy_spec(experts=8, d_model=64, d_expert=128, non_moe=0.0)
    ctx = _ctx(cluster, spec, schedule="sync")
    assert prophet_cost(ctx).schedule.kind == "prophet"
    plan = make_plan("prophet", _hot_from_two(), None, ctx)
    assert plan.cost.schedule == "sync"
    ph = plan.cost.phases
    expected = 4 * ph.dispatch_s[0] + 3 * ph.expert_fwd_s[0] + 2 * ph.trans_s[0]
    np.testing.assert_allclose(plan.cost.layer_s[0], expected, rtol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_never_slower_than_static_and_matches_cost_model(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cluster = toy_cluster(
        4, 2, 1 + seed % 2, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=2e-6, flops=1e13
    )
    D = cluster.num_devices
    spec = toy_spec(
        experts=16, layers=3, d_model=256, d_expert=512, tokens=2048, non_moe=1e6 * (seed % 3)
    )
    loads = np.floor(rng.zipf(1.4, size=(3, D, 16)) * 40.0)
    ctx = _ctx(cluster, spec, slots=-(-16 // D) + 1 + seed % 2)
    plan = make_plan("prophet", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert np.all(plan.cost.layer_s <= static.cost.layer_s * (1 + 1e-12))
    # The incremental pricing of the search equals the cost model on the final plan.
    np.testing.assert_allclose(
        np.array(plan.notes["prophet_layer_s"])[:, 1], plan.cost.layer_s, rtol=1e-9
    )
    assert plan.placement.slots_used().max() <= ctx.slots_per_device


def test_speed_256_experts_32_devices() -> None:
    import time

    from poise.spec import MODELS
    from poise.topology import get_cluster

    cluster = get_cluster("v100-ib50:4")
    spec = MODELS["zipf-256"].with_(moe_layers=4)
    rng = np.random.default_rng(0)
    w = rng.zipf(1.3, (4, 1, 256)).astype(float)
    loads = rng.poisson(w / w.sum(axis=2, keepdims=True) * 8192 * 8, (4, 32, 256)).astype(float)
    ctx = PlanContext.create(cluster, spec, slots_per_device=9)
    make_plan("prophet", loads, None, ctx)
    t = time.perf_counter()
    make_plan("prophet", loads, None, ctx)
    per_layer = (time.perf_counter() - t) / 4
    assert per_layer < 0.02  # target 2 ms; generous bound for loaded CI machines
