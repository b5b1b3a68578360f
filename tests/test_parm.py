"""Parm's analytic model: the operations and bytes of each schedule on a hand-worked layer, the
times under a one-level cluster, the choice against the explicit comparison, bad layers refused
with the field named, the event model's hierarchy, and the 1,296-layer grid."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.cluster import Cluster, Link
from poise.core.errors import ConfigError
from poise.cost.collectives import AlphaBeta, CollectiveFit
from poise.layouts.parm import (
    SCHEDULES,
    GemmModel,
    ParmLayer,
    choose_schedule,
    fastest_schedule,
    layer_breakdown,
    layer_time,
    schedule_condition,
    schedule_ops,
)
from poise.sim.parm_events import (
    all_to_all_seconds,
    event_layer_time,
    event_times,
    ring_seconds,
)
from poise.sim.parm_grid import (
    AXES,
    EXTRA_CLUSTERS,
    PARM_CLUSTERS,
    grid_layers,
    grid_size,
    run_grid,
)
from poise.sim.scenarios.parm import run_parm

LAT, BW, FLOPS = 1e-6, 1e9, 1e12


def tiny_layer(**kw: object) -> ParmLayer:
    """T = 8 tokens, M = 4, H = 8, E = 4, top-1, f = 1, N_MP = N_ESP = 2, N_EP = 2, fp16."""
    args = dict(
        batch=1,
        seq_len=8,
        d_model=4,
        d_expert=8,
        experts=4,
        top_k=1,
        capacity_factor=1.0,
        mp=2,
        esp=2,
        ep=2,
        heads=2,
        dtype_bytes=2,
    )
    args.update(kw)
    return ParmLayer(**args)  # type: ignore[arg-type]


def flat_cluster(devices: int = 4) -> Cluster:
    """One node, every link 1 GB/s and 1 us, 1 TFLOP/s at any row count."""
    link = Link(BW, LAT)
    return Cluster("flat", devices, 1, 1, FLOPS, 1e9, link, link, link, 0.0)


# ------------------------------------------------------------------------------- the operations
def test_bytes_and_flops_of_each_schedule_on_a_hand_worked_layer() -> None:
    layer = tiny_layer()
    # baseline: C = ceil(1 * 1 * 8 / 4) = 2; E C M b = 4 * 2 * 4 * 2 = 64 bytes
    base = {(o.label, o.phase): o for o in schedule_ops(layer, "baseline")}
    assert base[("EP-AllToAll (dispatch)", "forward")].nbytes == 64
    assert base[("ESP-AllGather", "forward")].nbytes == 128  # N_ESP copies
    assert base[("ESP-ReduceScatter", "backward")].nbytes == 128
    # experts: 2 local experts x 2 GEMMs x 2 * rows * M * H / N_ESP, rows = N_EP C N_ESP = 8
    assert base[("Experts", "forward")].flops == 2 * 2 * 2 * 8 * 4 * 4
    assert base[("Experts", "forward")].rows == 8
    assert base[("Experts", "backward")].flops == 2 * base[("Experts", "forward")].flops
    assert base[("Gate", "forward")].flops == 2 * 8 * 4 * 4
    assert not any("MP" in label for label, _ in base)
    # s1: C' = ceil(4 / 4) = 1; E C' M b = 32 bytes; MP-AllGather of T M b = 64 bytes
    s1 = {(o.label, o.phase): o for o in schedule_ops(layer, "s1")}
    assert s1[("EP-AllToAll (combine)", "forward")].nbytes == 32
    assert s1[("ESP-AllGather", "backward")].nbytes == 64
    assert s1[("MP-AllGather", "forward")].nbytes == 64
    assert s1[("MP-AllGather", "backward")].nbytes == 64  # MP-Split's gradient
    assert s1[("Experts", "forward")].flops == base[("Experts", "forward")].flops / 2
    assert s1[("Gate", "forward")].rows == 4
    # s2: the unified all-to-all carries N_ESP E C' M b over all 4 ranks
    s2 = schedule_ops(layer, "s2")
    unified = [o for o in s2 if o.label.startswith("unified")]
    assert len(unified) == 4 and {o.group for o in unified} == {"world"}
    assert {o.nbytes for o in unified} == {64}
    order = [o.label for o in schedule_ops(layer, "s1") if o.phase == "forward"]
    assert order == [
        "Gate",
        "EP-AllToAll (dispatch)",
        "ESP-AllGather",
        "Experts",
        "ESP-ReduceScatter",
        "EP-AllToAll (combine)",
        "MP-AllGather",
    ]


def test_times_on_a_one_level_cluster_by_hand() -> None:
    """(n - 1)(alpha + beta m / n) per collective, GEMMs at 1 TFLOP/s, forward + backward."""
    layer, c = tiny_layer(), flat_cluster()

    def ab(n: int, m: float) -> float:
        return (n - 1) * (LAT + m / n / BW)

    base_comm = 2 * (2 * ab(2, 64) + 2 * ab(2, 128))
    base_flops = (256 + 512) + (1024 + 2048)  # gate fwd + bwd, experts fwd + bwd
    s1_comm = 2 * (2 * ab(2, 32) + 2 * ab(2, 64) + ab(2, 64))
    s2_comm = 2 * (2 * ab(4, 64) + ab(2, 64))
    half_flops = base_flops / 2
    assert layer_time(layer, "baseline", c) == pytest.approx(base_comm + base_flops / FLOPS)
    assert layer_time(layer, "s1", c) == pytest.approx(s1_comm + half_flops / FLOPS)
    assert layer_time(layer, "s2", c) == pytest.approx(s2_comm + half_flops / FLOPS)
    assert schedule_condition(layer, c) == pytest.approx(
        (2 * ab(2, 32) + 2 * ab(2, 64)) - 2 * ab(4, 64)
    )
    assert choose_schedule(layer, c) == "s1"
    # a layer this small is latency-bound: pausing MP's extra MP-AllGather does not pay
    assert fastest_schedule(layer, c) == "baseline"
    assert fastest_schedule(layer, c, schedules=("s1", "s2")) == "s1"
    parts = layer_breakdown(layer, "s1", c)
    assert parts["MP-AllGather"] == pytest.approx(2 * ab(2, 64))
    assert sum(parts.values()) == pytest.approx(layer_time(layer, "s1", c))


def test_choice_agrees_with_the_explicit_comparison() -> None:
    """S1 and S2 share gate, experts and MP-AllGather, so the condition must pick the one with
    the smaller layer time, on clusters where either wins."""
    picked = set()
    for cluster in [*PARM_CLUSTERS.values(), *EXTRA_CLUSTERS.values()]:
        for i, layer in enumerate(grid_layers(cluster.num_devices)):
            if i % 9:
                continue
            t1, t2 = layer_time(layer, "s1", cluster), layer_time(layer, "s2", cluster)
            if abs(t1 - t2) <= 1e-12 * max(t1, t2):
                continue
            want = "s2" if t2 < t1 else "s1"
            assert choose_schedule(layer, cluster) == want
            assert fastest_schedule(layer, cluster, schedules=("s1", "s2")) == want
            picked.add(want)
    assert picked == {"s1", "s2"}


def test_choice_runs_from_a_measured_fit() -> None:
    """Parm chooses from measured alpha and beta: an all-to-all measured cheaper per byte than
    the all-gather and reduce-scatter flips the choice to S2."""
    layer = tiny_layer(batch=64, ep=1, experts=4)  # 2 ranks: one node, as calibrated
    slow_ag = AlphaBeta(1e-6, 4e-9)
    fit = CollectiveFit(
        {
            ("all_to_all", "intra_node"): AlphaBeta(1e-6, 1e-9),
            ("all_gather", "intra_node"): slow_ag,
            ("reduce_scatter", "intra_node"): slow_ag,
        },
        2,
        2,
        "measured",
    )
    assert choose_schedule(layer, fit) == "s2"
    fast_ag = AlphaBeta(1e-7, 1e-10)
    fit2 = dataclasses.replace(
        fit,
        params={
            **fit.params,
            ("all_gather", "intra_node"): fast_ag,
            ("reduce_scatter", "intra_node"): fast_ag,
        },
    )
    assert choose_schedule(layer, fit2) == "s1"
    with pytest.raises(ConfigError) as info:
        layer_time(layer, "s1", fit)  # GEMMs need a model
    assert info.value.field == "gemm"
    gemm = GemmModel(FLOPS)
    # without the MP-AllGather (absent from this fit) only the baseline can be priced here
    assert layer_time(layer, "baseline", fit2, gemm) > 0


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"batch": 0}, "batch"),
        ({"d_model": 2.5}, "d_model"),
        ({"esp": 4, "mp": 2}, "esp"),
        ({"experts": 3, "top_k": 1}, "ep"),
        ({"d_expert": 9}, "esp"),
        ({"heads": 3}, "mp"),
        ({"seq_len": 7}, "mp"),
        ({"top_k": 5}, "top_k"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"capacity_factor": float("inf")}, "capacity_factor"),
        ({"heads": 0}, "heads"),
    ],
)
def test_bad_layers_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        tiny_layer(**kw)
    assert info.value.field == field
    assert info.value.source == "parm layer"


def test_degrees_must_divide_the_world() -> None:
    common = dict(batch=1, seq_len=8, d_model=4, d_expert=8, experts=4, top_k=1)
    layer = ParmLayer.for_world(8, mp=2, capacity_factor=1.0, **common)  # type: ignore[arg-type]
    assert (layer.ep, layer.esp, layer.world) == (4, 2, 8)
    with pytest.raises(ConfigError) as info:
        ParmLayer.for_world(12, mp=8, capacity_factor=1.0, **common)  # type: ignore[arg-type]
    assert info.value.field == "mp"
    with pytest.raises(ConfigError) as info:
        schedule_ops(tiny_layer(), "s3")
    assert info.value.field == "schedule"
    with pytest.raises(ConfigError) as info:
        event_layer_time(flat_cluster(2), tiny_layer(), "s1")  # 4 ranks on 2 devices
    assert info.value.field == "devices"


# ---------------------------------------------------------------------------------- event model
def two_nodes() -> Cluster:
    """2 nodes of 4: intra 10 GB/s, 1 us; one 8 GB/s NIC per node (shared by 4), 5 us."""
    return Cluster(
        "two", 4, 2, 1, FLOPS, 1e9, Link(10e9, 1e-6), Link(8e9, 5e-6, 4), Link(8e9, 5e-6, 4)
    )


def test_event_all_to_all_overlaps_its_levels() -> None:
    c = two_nodes()
    m = 8e6
    intra = 3 * 1e-6 + m * 3 / 8 / 10e9
    inter = 4 * 5e-6 + m * 4 / 8 / 2e9  # 8 GB/s shared by the node's 4 devices
    assert all_to_all_seconds(c, 8, m) == pytest.approx(max(intra, inter))
    assert all_to_all_seconds(c, 8, m) < intra + inter
    # EP-like group, one rank per node
    assert all_to_all_seconds(c, 2, m, stride=4) == pytest.approx(5e-6 + m / 2 / 2e9)
    assert all_to_all_seconds(c, 1, m) == 0.0


def test_event_rings_share_the_nic_among_concurrent_groups() -> None:
    c = two_nodes()
    m = 8e6
    # 8 consecutive ranks: one ring flow leaves each node, at the NIC's full 8 GB/s
    step = max(1e-6 + m / 8 / 10e9, 5e-6 + m / 8 / 8e9)
    assert ring_seconds(c, "all_gather", 8, m) == pytest.approx(7 * step)
    assert ring_seconds(c, "all_reduce", 8, m) == pytest.approx(14 * step)
    # 2 ranks 4 apart: 4 such groups leave each node through one NIC: 2 GB/s each
    assert ring_seconds(c, "reduce_scatter", 2, m, stride=4) == pytest.approx(5e-6 + m / 2 / 2e9)
    # one node: intra-node link only
    assert ring_seconds(c, "all_gather", 4, m) == pytest.approx(3 * (1e-6 + m / 4 / 10e9))


def test_event_model_matches_alpha_beta_on_one_level_groups() -> None:
    """On a single node where every group is one level, the two models differ only in the
    all-to-all's latency terms being the same: they agree exactly."""
    layer, c = tiny_layer(), flat_cluster()
    for s in SCHEDULES:
        assert event_layer_time(c, layer, s) == pytest.approx(layer_time(layer, s, c))


# ------------------------------------------------------------------------------------- the grid
def test_grid_has_parms_size_and_runs() -> None:
    assert grid_size() == int(np.prod([len(v) for v in AXES.values()])) == 1296
    assert len(list(grid_layers(8))) == len(list(grid_layers(32))) == 1296
    result = run_grid(PARM_CLUSTERS["parm-32gpu"])
    summary = result.summary()
    assert summary["configs"] == 1296
    for which in ("s1", "s2", "choice", "oracle"):
        stats = summary[which]
        assert stats["min"] <= stats["p10"] <= stats["median"] <= stats["p90"] <= stats["max"]
    # the choice is never better than the oracle, and pausing MP pays everywhere here
    assert np.all(result.speedup("choice") <= result.speedup("oracle") * (1 + 1e-12))
    assert summary["choice"]["min"] > 1.0
    assert 0.0 <= summary["choice_accuracy"] <= 1.0
    assert sum(summary["chosen"].values()) == 1296


def test_grid_choice_accuracy_counts_against_the_event_model() -> None:
    result = run_grid(EXTRA_CLUSTERS["parm-32gpu-nic-per-gpu"], quick=True)
    t = result.truth_s
    right = np.where(result.chosen == "s2", t["s2"], t["s1"]) <= np.minimum(t["s1"], t["s2"]) * (
        1 + 1e-9
    )
    assert result.choice_accuracy == pytest.approx(right.mean())
    for layer, i in zip(result.layers, range(3), strict=False):
        times = event_times(EXTRA_CLUSTERS["parm-32gpu-nic-per-gpu"], layer)
        assert times == {s: t[s][i] for s in SCHEDULES}


def test_parm_scenario_rows() -> None:
    res = run_parm(quick=True)
    assert len(res.rows) == 4
    assert {r.published for r in res.rows} == {1.13, 5.77}
    assert all(r.ours > 1.0 and r.auto >= r.ours * (1 - 1e-12) for r in res.rows)
    assert set(res.means) == set(PARM_CLUSTERS)
