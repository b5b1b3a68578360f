"""Host costs (`poise.cost.host`): the non-MoE compute at its measured rate and the
dispatcher's host work, on hand-computed cases; the defaults give the cost model's FNEC/BNEC."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.cluster import HostCosts
from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement
from poise.cost.host import (
    busiest_sharing,
    dense_rates,
    dense_seconds,
    dispatch_host_seconds,
    dispatch_rows,
    gpt_non_moe_flops_per_token,
)
from poise.cost.model import CostModel

from .helpers import assert_priced_as_the_cost_model, toy_cluster, toy_spec


def test_gpt_block_flops_of_the_tiny_model() -> None:
    # d 128, context 128, 8 experts, vocabulary 256, 4 MoE layers:
    # 8 d^2 = 131072, 2 d (T + 1) = 33024, 2 d E = 2048, 2 V d / L = 16384
    assert gpt_non_moe_flops_per_token(128, 128, 8, 256, 4) == 182_528.0


def test_default_dense_rate_is_the_cost_models_fnec() -> None:
    cluster = toy_cluster(flops=2e9)
    spec = toy_spec(tokens=300, non_moe=1e4)
    fnec, bnec = dense_seconds(cluster, spec.non_moe_flops_fwd, spec.tokens_per_device, "fp32")
    assert fnec == pytest.approx(300 * 1e4 / 2e9)  # N F / gemm_flops
    assert bnec == pytest.approx(2 * fnec)
    placement = Placement.from_homes(np.array([[0, 1]]), 2, 1)
    priced = CostModel(cluster, spec).price(
        placement, Assignment.to_home(placement), np.full((1, 2, 2), 5.0)
    )
    assert priced.phases.non_moe_fwd_s[0] == pytest.approx(fnec, rel=1e-12)
    assert priced.phases.non_moe_bwd_s[0] == pytest.approx(bnec, rel=1e-12)


def test_measured_dense_rates_with_half_tokens() -> None:
    host = HostCosts(
        dense_fwd_flops=1e9,
        dense_fwd_half_tokens=100.0,
        dense_bwd_flops=5e8,
        dense_bwd_half_tokens=20.0,
    )
    cluster = dataclasses.replace(toy_cluster(flops=9e9), host=host)
    assert dense_rates(cluster, "fp32") == (1e9, 100.0, 5e8, 20.0)
    fnec, bnec = dense_seconds(cluster, 1e4, 300, "fp32")
    # F (N + h_f) / R_f = 1e4 * 400 / 1e9; 2 F (N + h_b) / R_b = 2e4 * 320 / 5e8
    assert fnec == pytest.approx(4e-3)
    assert bnec == pytest.approx(1.28e-2)
    assert dense_seconds(cluster, 1e4, 0, "fp32") == (0.0, 0.0)


def test_backward_rate_defaults_to_the_forwards() -> None:
    host = HostCosts(dense_fwd_flops=1e9, dense_fwd_half_tokens=100.0)
    cluster = dataclasses.replace(toy_cluster(), host=host)
    fnec, bnec = dense_seconds(cluster, 1e4, 300, "fp32")
    assert bnec == pytest.approx(2 * fnec)


def test_dispatcher_rows_and_slowest_device() -> None:
    counts = np.array(
        [
            [[3.0, 1.0], [2.0, 2.0]],  # layer 0: device 0 routes 4 rows, device 1 routes 4
            [[6.0, 0.0], [1.0, 1.0]],  # layer 1: 6 and 2
        ]
    )
    load = np.array([[5.0, 3.0], [7.0, 1.0]])  # rows computed
    rows = dispatch_rows(counts, load)
    np.testing.assert_array_equal(rows, [[9.0, 7.0], [13.0, 3.0]])
    host = HostCosts(
        dispatch_fwd_s=1e-3, dispatch_fwd_s_per_row=1e-4, dispatch_bwd_s=2e-3,
        dispatch_bwd_s_per_row=1e-5,
    )  # fmt: skip
    fwd, bwd = dispatch_host_seconds(host, rows)
    np.testing.assert_allclose(fwd, [1e-3 + 9e-4, 1e-3 + 13e-4])
    np.testing.assert_allclose(bwd, [2e-3 + 9e-5, 2e-3 + 13e-5])
    zero_f, zero_b = dispatch_host_seconds(HostCosts(), rows)
    assert not zero_f.any() and not zero_b.any()
    with pytest.raises(ValueError, match="layers, devices"):
        dispatch_host_seconds(host, np.ones(3))


def test_ranks_sharing_cores_bound_the_host_work_by_the_total() -> None:
    """4 ranks on 2 cores: a waiting rank lends its core, so a layer's host work is the larger
    of the busiest device's rows and the total over the cores (hand-computed)."""
    rows = np.array(
        [
            [10.0, 2.0, 2.0, 2.0],  # busiest 10 > total 16 / 2 = 8: the busiest device's
            [6.0, 4.0, 4.0, 4.0],  # busiest 6 < 18 / 2 = 9: the total's share
        ]
    )
    np.testing.assert_array_equal(busiest_sharing(rows, 0.0), [10.0, 6.0])
    np.testing.assert_array_equal(busiest_sharing(rows, 2.0), [10.0, 9.0])
    np.testing.assert_array_equal(busiest_sharing(rows, 4.0), [10.0, 6.0])  # a core each: as before
    host = HostCosts(dispatch_fwd_s=1e-3, dispatch_fwd_s_per_row=1e-4, shared_cores=2.0)
    fwd, _ = dispatch_host_seconds(host, rows)
    np.testing.assert_allclose(fwd, [1e-3 + 10e-4, 1e-3 + 9e-4])
    # moving rows off the busiest device saves nothing while the total binds
    evened = np.array([[10.0, 2.0, 2.0, 2.0], [4.5, 4.5, 4.5, 4.5]])
    assert dispatch_host_seconds(host, evened)[0][1] == pytest.approx(fwd[1])


HOST = HostCosts(
    dense_fwd_flops=5e8,
    dense_bwd_flops=4e8,
    dispatch_fwd_s=1e-4,
    dispatch_fwd_s_per_row=1e-6,
    dispatch_bwd_s=5e-5,
    dispatch_bwd_s_per_row=2e-6,
)


def test_the_cost_model_prices_the_host_terms_by_hand() -> None:
    """1 layer, 2 devices, 2 experts (one each), 100 tokens per device, top-1, d_model 4,
    d_expert 8 (F_t = 128 FLOPs, 16 bytes per token), no latency: the planners' price includes
    the measured non-MoE rates and the dispatcher's host work, as the simulator charges them."""
    counts = np.array([[[60.0, 40.0], [30.0, 70.0]]])  # [L=1, D=2, E=2]
    spec = toy_spec(experts=2, layers=1, d_model=4, d_expert=8, tokens=100, non_moe=1e4)
    cluster = dataclasses.replace(toy_cluster(2, bw=1e9, lat=0.0, flops=1e9), host=HOST)
    placement = Placement.from_homes(np.array([[0, 1]]), 2, 1)
    priced = CostModel(cluster, spec).price(placement, Assignment.to_home(placement), counts)
    fec = 110 * 128 / 1e9  # device 1 computes 40 + 70 rows
    a2a = 4 * 40 * 16 / 1e9  # at most 40 rows of 16 bytes each way, 4 all-to-alls
    fnec, bnec = 100 * 1e4 / 5e8, 2 * 100 * 1e4 / 4e8
    h_fwd, h_bwd = 1e-4 + 210 * 1e-6, 5e-5 + 210 * 2e-6  # device 1: 100 routed + 110 computed
    assert priced.phases.dispatch_host_fwd_s[0] == pytest.approx(h_fwd, rel=1e-12)
    assert priced.phases.non_moe_bwd_s[0] == pytest.approx(bnec, rel=1e-12)
    expected = fnec + bnec + a2a + 3 * fec + h_fwd + h_bwd
    assert priced.layer_s[0] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("schedule", "transfer_scale"), [("sync", 1.0), ("pipelined(4)", 1.0), ("prophet", 1.0),
                                     ("sync", 3.0), ("prophet", 3.0)]
)  # fmt: skip
def test_every_policy_prices_its_plan_with_the_host_terms(
    schedule: str, transfer_scale: float
) -> None:
    """On a calibrated cluster each policy's plan costs what `CostModel.price` says, including
    those that hand `finish_plan` the price their search kept (`vexpert`, `prophet`, `hybrid`),
    with bulk transfers at `transfer_scale` times their link time too."""
    from poise.cost.schedule import parse_schedule
    from poise.plan.policies import REGISTRY, PlanContext, make_plan

    host = dataclasses.replace(HOST, transfer_scale=transfer_scale)
    cluster = dataclasses.replace(toy_cluster(4, 2, bw=1e10, inter_bw=1e9, flops=1e12), host=host)
    spec = toy_spec(experts=16, layers=2, d_model=64, d_expert=128, tokens=4096, non_moe=1e6)
    cost = CostModel(cluster, spec, parse_schedule(schedule))
    ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=cost)
    rng = np.random.default_rng(5)
    loads = np.floor(200 * rng.zipf(1.3, size=(2, 8, 16)).astype(float))
    first = make_plan("eplb", loads, None, ctx)  # a placement in force: later plans migrate
    for policy in sorted(REGISTRY):
        plan = make_plan(policy, loads, None, ctx)
        assert plan.cost.phases.dispatch_host_fwd_s.min() > 1e-4, policy
        assert_priced_as_the_cost_model(plan, cost, loads, device_load_rtol=1e-9)
        again = make_plan(policy, loads[::-1].copy(), first, ctx)
        assert_priced_as_the_cost_model(again, cost, loads[::-1].copy(), device_load_rtol=1e-9)


def test_transfer_scale_stretches_bulk_transfers_not_tokens() -> None:
    """`HostCosts.transfer_scale`: Trans, Agg and migration take k times their link time, the
    token all-to-all and the compute do not. The replica case of tests/test_cost.py (Trans =
    Agg = 256 ns: one 256-byte expert at 1e9 B/s; all-to-all 2 x 20 x 16 B = 640 ns) with one
    home moved (migration 256 B of weights + its optimizer bytes)."""
    spec = toy_spec(experts=2)
    base = toy_cluster(bw=1e9, flops=1e9)
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    p.copies[0, 0, 1] = 1
    counts = np.array([[[10, 30], [20, 40]]], dtype=float)
    moves = np.array([[0, 0, 0, 1]])  # layer 0, expert 0: home 0 -> 1
    one = CostModel(base, spec).phases(p, Assignment.to_home(p), counts, moves)[0]
    scaled = dataclasses.replace(base, host=HostCosts(transfer_scale=3.0))
    three = CostModel(scaled, spec).phases(p, Assignment.to_home(p), counts, moves)[0]
    assert one.trans_s[0] == pytest.approx(256e-9) and one.agg_s[0] == pytest.approx(256e-9)
    assert three.trans_s[0] == pytest.approx(3 * 256e-9)
    assert three.agg_s[0] == pytest.approx(3 * 256e-9)
    assert one.migrate_s[0] > 0 and three.migrate_s[0] == pytest.approx(3 * one.migrate_s[0])
    assert three.dispatch_s[0] == one.dispatch_s[0] == pytest.approx(640e-9 / 2)
    assert three.expert_fwd_s[0] == one.expert_fwd_s[0]
    with pytest.raises(ConfigError, match="transfer_scale"):
        HostCosts(transfer_scale=0.0)
