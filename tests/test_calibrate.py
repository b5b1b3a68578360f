"""`poise calibrate`: the two fits recover their own models exactly, bad input is refused with
one line, the expert backward GEMMs are the true gradients, and a real quick calibration writes
a cluster file that `get_cluster` loads."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from poise.calibrate import (
    COLLECTIVES,
    GROUP_COLLECTIVES,
    CalibrationConfig,
    CalibrationError,
    CommPoint,
    GemmPoint,
    HostPoint,
    LinkFit,
    expert_ffn_ops,
    expert_ffn_tensors,
    fit_all,
    fit_gemm_curve,
    fit_host,
    fit_latency_bandwidth,
    fit_line,
    load_collective_fit,
    measure_collectives,
    measurements_path,
    write_outputs,
)
from poise.calibrate.host import (
    balanced_experts,
    dense_grad_bytes,
    dense_points,
    expert_points,
    gpt_config,
    local_timer,
    rank_param_shapes,
    rank_params,
    step_points,
)
from poise.calibrate.host_fit import (
    HOST_FLOOR,
    KINDS_LOCAL,
    allreduce_after_compute,
    dispatcher_host_seconds,
)
from poise.cli import main
from poise.core.cluster import DTYPES, Cluster, Link
from poise.core.errors import ConfigError, PoiseError
from poise.core.presets import get_cluster
from poise.cost.host import gpt_non_moe_flops_per_token
from poise.layouts.parm import GemmModel, ParmLayer, choose_schedule, layer_time

ROWS = np.array([8, 32, 128, 512, 2048], dtype=float)
SIZES = np.array([4 * 2**10 * 4**i for i in range(7)], dtype=float)


def gemm_seconds(rows: np.ndarray, flops: np.ndarray, F: float, h: float) -> np.ndarray:
    """The model: time(n) = flops(n) * (n + h) / (F * n)."""
    return flops * (rows + h) / (F * rows)


# ----------------------------------------------------------------------------- GEMM curve fit
@pytest.mark.parametrize(("F", "h"), [(2.5e11, 64.0), (5e10, 16.0), (1e15, 512.0), (3e9, 0.0)])
def test_gemm_fit_recovers_its_own_model(F: float, h: float) -> None:
    flops = 4.0 * ROWS * 1024 * 2048  # forward FLOPs of a 1024 x 2048 expert
    fit = fit_gemm_curve(ROWS, gemm_seconds(ROWS, flops, F, h), flops)
    assert fit.gemm_flops == pytest.approx(F, rel=1e-9)
    assert fit.half_rows == pytest.approx(h, rel=1e-9, abs=1e-6)
    # and agrees with the cluster's own efficiency curve
    cluster = Cluster("c", 2, 1, 1, fit.gemm_flops, 1e9, *[Link(1e9, 0.0)] * 3, fit.half_rows)
    np.testing.assert_allclose(cluster.gemm_rate(ROWS, "fp32"), F * ROWS / (ROWS + h), rtol=1e-9)


def test_gemm_fit_mixes_operations_of_different_flops() -> None:
    """Forward and backward points (backward has twice the FLOPs) fit one curve."""
    rows = np.concatenate([ROWS, ROWS])
    flops = np.concatenate([4.0 * ROWS, 8.0 * ROWS]) * 256 * 512
    fit = fit_gemm_curve(rows, gemm_seconds(rows, flops, 7e10, 40.0), flops)
    assert (fit.gemm_flops, fit.half_rows) == pytest.approx((7e10, 40.0), rel=1e-9)
    assert fit.note == ""


def test_gemm_fit_two_points_is_exact() -> None:
    rows, flops = np.array([10.0, 1000.0]), np.array([1e6, 1e8])
    fit = fit_gemm_curve(rows, gemm_seconds(rows, flops, 1e9, 100.0), flops)
    assert (fit.gemm_flops, fit.half_rows) == pytest.approx((1e9, 100.0), rel=1e-12)


def test_gemm_fit_bounds_negative_half_rows_to_zero() -> None:
    """A rate that falls as n grows (cache effects) cannot be a half-rows curve: h = 0 and F
    the (relative least-squares) constant rate."""
    flops = ROWS * 1e6
    rates = np.array([1.2e11, 1.1e11, 1.0e11, 0.95e11, 0.9e11])
    fit = fit_gemm_curve(ROWS, flops / rates, flops)
    assert fit.half_rows == 0.0
    assert rates.min() < fit.gemm_flops < rates.max()
    assert "bounded" in fit.note


def test_gemm_fit_bounds_missing_peak_to_highest_rate() -> None:
    """A rate that still grows linearly in n (pure per-call overhead) has no finite peak."""
    flops = ROWS * 1e6
    seconds = np.full_like(ROWS, 1e-3)  # constant time: rate grows with n without bound
    fit = fit_gemm_curve(ROWS, seconds, flops)
    assert fit.gemm_flops == pytest.approx((flops / seconds).max())
    assert fit.half_rows >= 0
    assert "no finite peak" in fit.note


@pytest.mark.parametrize(
    ("rows", "seconds", "flops", "match"),
    [
        ([8.0], [1e-3], [1e6], "2 distinct row counts"),
        ([8.0, 8.0, 8.0], [1e-3, 2e-3, 3e-3], [1e6, 1e6, 1e6], "2 distinct row counts"),
        ([8.0, 16.0], [1e-3, 0.0], [1e6, 2e6], "seconds must be finite and > 0"),
        ([8.0, 16.0], [1e-3, float("nan")], [1e6, 2e6], "seconds must be finite and > 0"),
        ([8.0, -16.0], [1e-3, 2e-3], [1e6, 2e6], "rows must be finite and > 0"),
        ([8.0, 16.0], [1e-3, 2e-3], [1e6, 0.0], "flops must be finite and > 0"),
        ([8.0, 16.0, 32.0], [1e-3, 2e-3], [1e6, 2e6, 4e6], "one length"),
        ([], [], [], "2 distinct row counts"),
    ],
)
def test_gemm_fit_rejects_degenerate_input(
    rows: list[float], seconds: list[float], flops: list[float], match: str
) -> None:
    with pytest.raises(CalibrationError, match=match) as info:
        fit_gemm_curve(rows, seconds, flops)
    assert isinstance(info.value, PoiseError)
    assert info.value.source == "gemm fit"


# ----------------------------------------------------------------------- latency-bandwidth fit
@pytest.mark.parametrize(("lat", "bw"), [(30e-6, 4e9), (1e-3, 1.25e9), (0.0, 2e9), (2e-2, 1e6)])
def test_link_fit_recovers_its_own_model(lat: float, bw: float) -> None:
    fit = fit_latency_bandwidth(SIZES, lat + SIZES / bw)
    assert fit.bw_Bps == pytest.approx(bw, rel=1e-9)
    assert fit.lat_s == pytest.approx(lat, rel=1e-9, abs=1e-15)
    np.testing.assert_allclose(fit.seconds(SIZES), lat + SIZES / bw, rtol=1e-9)
    link = fit.link()
    assert (link.bw_Bps, link.lat_s) == (fit.bw_Bps, fit.lat_s)


def test_link_fit_bounds_negative_latency_to_zero() -> None:
    seconds = SIZES / 2e9 - 1e-6 * (SIZES / SIZES.max())  # slightly superlinear: lat < 0 fits
    seconds[0] = SIZES[0] / 2e9 * 0.5
    fit = fit_latency_bandwidth(SIZES, seconds)
    assert fit.lat_s == 0.0
    assert fit.bw_Bps > 0
    assert "bounded" in fit.note


@pytest.mark.parametrize(
    ("nbytes", "seconds", "match"),
    [
        ([4096.0], [1e-4], "2 distinct message sizes"),
        ([4096.0, 4096.0], [1e-4, 2e-4], "2 distinct message sizes"),
        ([4096.0, 8192.0], [2e-4, 1e-4], "does not grow with message size"),
        ([4096.0, 8192.0], [1e-4, 1e-4], "does not grow with message size"),
        ([4096.0, 8192.0], [1e-4, -1e-4], "seconds must be finite and > 0"),
        ([0.0, 8192.0], [1e-4, 2e-4], "bytes must be finite and > 0"),
        ([4096.0, 8192.0], [1e-4, math.inf], "seconds must be finite and > 0"),
        ([[4096.0, 8192.0]], [[1e-4, 2e-4]], "1-D columns"),
    ],
)
def test_link_fit_rejects_degenerate_input(nbytes: list, seconds: list, match: str) -> None:
    with pytest.raises(CalibrationError, match=match):
        fit_latency_bandwidth(nbytes, seconds)


# ------------------------------------------------------------------------------ measured work
def test_expert_backward_gemms_are_the_true_gradients() -> None:
    """The timed backward computes dX, dW1, dW2 of sum(y * dY) exactly as autograd does, and the
    timed forward is the expert FFN."""
    t = expert_ffn_tensors(d_model=16, d_expert=24, rows=5, seed=3)
    forward, backward = expert_ffn_ops(t)
    dX, dW1, dW2 = backward()
    x, W1, W2 = (t[k].clone().requires_grad_(True) for k in ("x", "W1", "W2"))
    y = torch.nn.functional.gelu(x @ W1) @ W2
    (y * t["dY"]).sum().backward()
    torch.testing.assert_close(forward(), y.detach())
    for mine, ref in ((dX, x.grad), (dW1, W1.grad), (dW2, W2.grad)):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def test_gemm_point_rate() -> None:
    assert GemmPoint("forward", 8, 2e-3, 4e9).rate == pytest.approx(2e12)


# ---------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"d_model": 0}, "d_model"),
        ({"d_expert": -4}, "d_expert"),
        ({"threads": 0}, "threads"),
        ({"rows": (8, 8)}, "rows"),
        ({"message_bytes": (4096, 4098)}, "message_bytes"),
        ({"gemm_repeats": 0}, "gemm_repeats"),
        ({"warmup": -1}, "warmup"),
        ({"min_time_s": -1.0}, "min_time_s"),
    ],
)
def test_config_rejects_bad_sizes(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        CalibrationConfig(**kwargs)
    assert (info.value.source, info.value.field) == ("calibrate", field)


def test_quick_preset_keeps_explicit_widths() -> None:
    cfg = CalibrationConfig.preset(quick=True, d_model=64, threads=1)
    assert (cfg.d_model, cfg.d_expert, cfg.threads) == (64, 512, 1)
    assert len(cfg.rows) < len(CalibrationConfig().rows)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--d-model", "0"], "--d-model: must be an integer >= 1, got 0"),
        (["--d-expert", "-1"], "--d-expert: must be an integer >= 1, got -1"),
        (["--threads", "0"], "--threads: must be an integer >= 1, got 0"),
        # more memory than the machine has
        (["--d-model", "100000", "--d-expert", "100000"], "calibrate: slot_counts: "),
    ],
)
def test_cli_bad_sizes_exit_2_with_one_line(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "--quick", "--out", str(tmp_path / "c.yaml"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("poise: error: ") and needle in err, err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "c.yaml").exists()


def test_cli_unknown_model_exits_2_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "--quick", "--model", "huge", "--out", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--model" in err and "unknown model preset" in err
    assert len(err.splitlines()) == 1


def test_model_preset_gives_the_widths_and_no_host_skips_it() -> None:
    cfg = CalibrationConfig.preset(quick=False, model="tiny", threads=1)
    assert (cfg.d_model, cfg.d_expert, cfg.model, cfg.host) == (128, 256, "tiny", True)
    cfg = CalibrationConfig.preset(quick=True, model="tiny", d_model=64, host=False)
    assert (cfg.d_model, cfg.d_expert, cfg.host) == (64, 256, False)
    with pytest.raises(ConfigError) as info:
        CalibrationConfig(slot_counts=(2, 2))
    assert info.value.field == "slot_counts"


@pytest.mark.parametrize("out", ["blocker/c.yaml", "c.txt"])
def test_cli_bad_output_exits_2(out: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "blocker").write_text("a file where a folder should be")
    assert main(["calibrate", "--quick", "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out" in err
    assert len(err.splitlines()) == 1


def test_measurements_sit_beside_the_cluster_file() -> None:
    assert measurements_path("x/calibrated.yaml") == Path("x/calibrated.measurements.json")


# ------------------------------------------------------------------------------- end to end
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_quick_calibration_writes_a_loadable_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sub" / "calibrated.yaml"
    assert main(["calibrate", "--quick", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "all_to_all" in printed

    cluster = get_cluster(str(out))
    assert cluster.num_devices == 2
    assert cluster.name.startswith("calibrated-")
    assert cluster.gemm_flops("fp32") > 0 and cluster.gemm_half_rows >= 0
    # measured once (fp32 expert FFN): that rate for every dtype
    assert {cluster.gemm_flops(t) for t in DTYPES} == {cluster.gemm_flops("fp32")}
    assert cluster.memory_bytes > 0
    assert cluster.intra_node.bw_Bps > 1e6
    assert 0 <= cluster.intra_node.lat_s < 1.0

    data = json.loads(measurements_path(out).read_text())
    assert data["cluster"] == cluster.to_dict()
    assert {p["phase"] for p in data["gemm"]} == {"forward", "backward"}
    assert {p["collective"] for p in data["collectives"]} == {"all_to_all", "all_reduce"}
    assert set(data["link_fits"]) == {"all_to_all", "all_reduce"}
    fit = data["gemm_fits"]["forward+backward"]
    assert (fit["gemm_flops"], fit["half_rows"]) == (
        cluster.gemm_flops("fp32"),
        cluster.gemm_half_rows,
    )
    a2a = data["link_fits"]["all_to_all"]
    assert (a2a["bw_Bps"], a2a["lat_s"]) == (cluster.intra_node.bw_Bps, cluster.intra_node.lat_s)
    # the host costs (measured by default) are in the cluster file and the measurements
    assert not cluster.host.is_default
    assert cluster.host.dense_fwd_flops is not None and cluster.host.dense_fwd_flops > 0
    assert cluster.host.allreduce_bw_Bps is not None and cluster.host.allreduce_bw_Bps > 0
    assert set(data["host_fits"]) >= {"dense_fwd", "dispatch_fwd", "optimizer", "allreduce"}
    assert "host costs" in printed


# ------------------------------------------------- all-gather, reduce-scatter and CollectiveFit
def synthetic_points(
    lat_bw: dict[str, tuple[float, float]],
) -> tuple[CalibrationConfig, list[GemmPoint], list[CommPoint]]:
    """Exact `lat + bytes / bw` timings of each collective and exact GEMM timings."""
    config = CalibrationConfig(rows=(8, 64), message_bytes=(4096, 65536, 1 << 20))
    gemm = [
        GemmPoint(phase, n, gemms * 2.0 * 256 * 512 * n / 1e10, gemms * 2.0 * 256 * 512 * n)
        for n in config.rows
        for phase, gemms in (("forward", 2), ("backward", 4))
    ]
    comm = [
        CommPoint(c, size, lat + size / bw)
        for c, (lat, bw) in lat_bw.items()
        for size in config.message_bytes
    ]
    return config, gemm, comm


FITTED = {
    "all_to_all": (30e-6, 4e9),
    "all_reduce": (50e-6, 2e9),
    "all_gather": (40e-6, 3e9),
    "reduce_scatter": (45e-6, 2.5e9),
}


def test_group_collectives_are_fitted_beside_the_existing_outputs() -> None:
    config, gemm, comm = synthetic_points(FITTED)
    cal = fit_all(config, gemm, comm, {"hostname": "h"})
    assert set(cal.link_fits) == {"all_to_all", "all_reduce"}  # unchanged
    assert set(cal.group_fits) == {"all_gather", "reduce_scatter"}
    for c, (lat, bw) in FITTED.items():
        f = {**cal.link_fits, **cal.group_fits}[c]
        assert (f.lat_s, f.bw_Bps) == pytest.approx((lat, bw), rel=1e-9)
    data = cal.to_dict()
    assert {p["collective"] for p in data["collectives"]} == {"all_to_all", "all_reduce"}
    assert {p["collective"] for p in data["group_collectives"]} == set(GROUP_COLLECTIVES)
    assert set(data["group_fits"]) == set(GROUP_COLLECTIVES)
    # the cluster the file holds still comes from the all-to-all alone
    assert cal.cluster().intra_node.bw_Bps == pytest.approx(4e9)


def test_collective_fit_reproduces_the_measured_times() -> None:
    """Each collective's per-step alpha-beta on the 2 measured ranks gives back lat + bytes / bw
    for the bytes `poise calibrate` records, and the choice of Parm runs from it."""
    config, gemm, comm = synthetic_points(FITTED)
    fit = fit_all(config, gemm, comm, {"hostname": "h"}).collective_fit()
    assert fit.devices_per_node == 2 and fit.source == "calibrated-h"
    assert {c for c, _ in fit.params} == set(COLLECTIVES)
    for c, (lat, bw) in FITTED.items():
        for m in (4096.0, 1e6):
            recorded = m / 2 if c == "all_to_all" else m  # a2a: bytes sent to the other rank
            assert fit.time(c, 2, m) == pytest.approx(lat + recorded / bw, rel=1e-9)
    layer = ParmLayer(
        batch=4, seq_len=64, d_model=64, d_expert=128, experts=4, top_k=2,
        capacity_factor=1.0, mp=2, esp=2, ep=1,
    )  # fmt: skip
    assert choose_schedule(layer, fit) in ("s1", "s2")
    assert layer_time(layer, "s1", fit, GemmModel(1e10)) > 0


def test_collective_fit_is_written_and_read_back(tmp_path: Path) -> None:
    config, gemm, comm = synthetic_points(FITTED)
    cal = fit_all(config, gemm, comm, {"hostname": "h"})
    out = tmp_path / "c.yaml"
    write_outputs(cal, out)
    assert load_collective_fit(out) == cal.collective_fit()
    assert load_collective_fit(measurements_path(out)) == cal.collective_fit()
    old = json.loads(measurements_path(out).read_text())
    del old["collective_fit"]
    measurements_path(out).write_text(json.dumps(old))
    with pytest.raises(ConfigError) as info:
        load_collective_fit(out)
    assert info.value.field == "collective_fit"


def test_measurements_without_group_collectives_still_fit() -> None:
    """Timings of the two original collectives only (older runs) fit as before."""
    config, gemm, comm = synthetic_points({k: FITTED[k] for k in ("all_to_all", "all_reduce")})
    cal = fit_all(config, gemm, comm)
    assert cal.group_fits == {}
    assert {c for c, _ in cal.collective_fit().params} == {"all_to_all", "all_reduce"}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_all_gather_and_reduce_scatter_are_measured_on_gloo() -> None:
    config = CalibrationConfig(
        rows=(8, 16),
        message_bytes=(4096, 262144),
        comm_repeats=2,
        warmup=1,
        min_time_s=0.0,
    )
    points = measure_collectives(config)
    assert [p.collective for p in points] == [c for c in COLLECTIVES for _ in (0, 1)]
    for p in points:
        assert p.seconds > 0 and p.nbytes in config.message_bytes


# ------------------------------------------------------------------------------- host costs
def test_line_fit_recovers_its_own_model_and_bounds() -> None:
    x = np.array([256.0, 1024.0, 4096.0])
    fit = fit_line(x, 2e-3 + 5e-7 * x)
    assert (fit.intercept_s, fit.slope_s) == pytest.approx((2e-3, 5e-7), rel=1e-9)
    assert fit.note == ""
    through_origin = fit_line(x, 1e-6 * x - 1e-4)  # a negative intercept
    assert through_origin.intercept_s == 0.0 and through_origin.slope_s > 0
    assert "intercept" in through_origin.note
    flat = fit_line(x, np.array([3e-3, 2e-3, 1e-3]))  # falling with size: noise
    assert flat.slope_s == 0.0 and 1e-3 < flat.intercept_s < 3e-3
    with pytest.raises(CalibrationError, match="2 distinct"):
        fit_line([8, 8], [1.0, 2.0])


A2A = LinkFit(lat_s=1e-4, bw_Bps=2e9)
HOST_TRUE = {
    "dense_fwd": (4e10, 30.0),
    "dense_bwd": (3e10, 10.0),
    "dispatch_fwd": (2e-3, 4e-7),
    "dispatch_bwd": (1e-3, 3e-7),
    "optimizer": (2e-4, 2e-9),
    "clip": (5e-5, 7e-10),
    "experts": (8e10, 16.0),
    "allreduce": (1.9e-3, 1.3e9),
}


def synthetic_host_points() -> list[HostPoint]:
    """Exact timings of every host model in `HOST_TRUE` (the dispatcher's with its two token
    all-to-alls each way on `A2A` added, as measured)."""
    pts = []
    F = 182_528.0  # FLOPs per token and block
    for n in (128, 512, 2048):
        for kind, mult in (("dense_fwd", 1.0), ("dense_bwd", 2.0)):
            R, h = HOST_TRUE[kind]
            pts.append(HostPoint(kind, n, mult * F * (n + h) / R, flops=mult * F * n))
    for rows in (256, 1024, 4096):
        nbytes = rows / 2 * 128 * 4
        for kind in ("dispatch_fwd", "dispatch_bwd"):
            a, b = HOST_TRUE[kind]
            links = 2 * (A2A.lat_s + nbytes / A2A.bw_Bps)
            pts.append(HostPoint(kind, rows, a + b * 2 * rows + links, nbytes=nbytes))
    for P in (700_000, 1_100_000, 1_900_000):
        for kind in ("optimizer", "clip"):
            a, b = HOST_TRUE[kind]
            pts.append(HostPoint(kind, P, a + b * P))
    R, h = HOST_TRUE["experts"]
    for n in (8, 128, 2048):
        flops = 6.0 * 128 * 256 * n
        pts.append(HostPoint("experts_fwd", n, flops * (n + h) / (R * n), flops=flops))
        pts.append(HostPoint("experts_bwd", n, 2 * flops * (n + h) / (R * n), flops=2 * flops))
    lat, bw = HOST_TRUE["allreduce"]
    pts += [HostPoint("allreduce", m, lat + m / bw) for m in (150_000, 1_200_000, 4_800_000)]
    return pts


def test_host_fit_recovers_every_model() -> None:
    fit = fit_host(synthetic_host_points(), A2A, LinkFit(lat_s=3e-4, bw_Bps=1.9e9))
    for kind in ("dense_fwd", "dense_bwd"):
        g = getattr(fit, kind)
        assert (g.gemm_flops, g.half_rows) == pytest.approx(HOST_TRUE[kind], rel=1e-9)
    for kind in ("dispatch_fwd", "dispatch_bwd", "optimizer", "clip"):
        line = getattr(fit, kind)
        assert (line.intercept_s, line.slope_s) == pytest.approx(HOST_TRUE[kind], rel=1e-9)
    assert fit.experts is not None
    assert (fit.experts.gemm_flops, fit.experts.half_rows) == pytest.approx(
        HOST_TRUE["experts"], rel=1e-9
    )
    # the all-reduce after compute replaces the back-to-back one
    assert (fit.allreduce.lat_s, fit.allreduce.bw_Bps) == pytest.approx(
        HOST_TRUE["allreduce"], rel=1e-9
    )
    costs = fit.costs()
    assert costs.dense_fwd_flops == pytest.approx(4e10)
    assert costs.dispatch_bwd_s_per_row == pytest.approx(3e-7)
    assert costs.optimizer_s == pytest.approx(2e-4)
    assert costs.allreduce_bw_Bps == pytest.approx(1.3e9)
    # without all-reduce points: the back-to-back fit
    fallback = [p for p in synthetic_host_points() if p.kind != "allreduce"]
    assert fit_host(fallback, A2A, LinkFit(3e-4, 1.9e9)).allreduce == LinkFit(3e-4, 1.9e9)


def test_allreduce_after_compute_without_a_resolved_bandwidth() -> None:
    """Skew after compute can drown the bytes term: the back-to-back bandwidth is kept."""
    pts = [HostPoint("allreduce", m, t) for m, t in ((1e5, 2.1e-3), (1e6, 2.0e-3), (4e6, 1.9e-3))]
    fit = allreduce_after_compute(pts, LinkFit(3e-4, 1.9e9))
    assert fit.bw_Bps == 1.9e9 and 1.9e-3 < fit.lat_s < 2.1e-3
    assert "back-to-back" in fit.note


def test_dispatcher_time_below_its_links_keeps_a_floor() -> None:
    point = HostPoint("dispatch_fwd", 1024, 1e-4, nbytes=1e6)  # links alone take ~1 ms
    assert dispatcher_host_seconds(point, A2A) == pytest.approx(HOST_FLOOR * 1e-4)


def test_calibration_with_host_costs_writes_and_reads_them(tmp_path: Path) -> None:
    config, gemm, comm = synthetic_points(FITTED)
    plain = fit_all(config, gemm, comm, {"hostname": "h"})
    assert plain.host_fit is None and plain.cluster().host.is_default
    cal = fit_all(config, gemm, comm, {"hostname": "h"}, host_points=synthetic_host_points())
    cluster = cal.cluster()
    assert cluster.host.dense_bwd_flops == pytest.approx(3e10)
    # no model named: the GEMM curve stays the expert FFN's (as before)
    assert cluster.gemm_flops("bf16") == cal.gemm_fits["forward+backward"].gemm_flops
    out = tmp_path / "c.yaml"
    write_outputs(cal, out)
    assert get_cluster(str(out)) == cluster
    data = json.loads(measurements_path(out).read_text())
    assert {p["kind"] for p in data["host_costs"]} >= {"dense_fwd", "dispatch_bwd", "clip"}
    assert data["host_fits"]["optimizer"]["slope_s"] == pytest.approx(2e-9)
    # a named model: its own experts give the GEMM curve
    named = fit_all(replace(config, model="tiny"), gemm, comm, host_points=synthetic_host_points())
    assert named.cluster().gemm_flops("fp32") == pytest.approx(8e10)
    assert named.gemm is named.gemm_fits["model_experts"]


def test_rank_parameter_shapes_are_the_models() -> None:
    from poise.models.gpt import GPTMoE, model_config

    for overrides in ({}, {"moe_every": 2, "activation": "gelu", "d_model": 64, "d_ff": 96}):
        cfg = model_config("tiny", overrides)
        model = GPTMoE(cfg)  # compute only: every expert, one slot each
        shapes = [tuple(p.shape) for _, p in model.named_parameters()]
        assert rank_param_shapes(cfg, cfg.num_experts) == shapes
        dense = model.num_parameters()["dense"]
        assert rank_params(cfg, 0) == dense and dense_grad_bytes(cfg) == 4 * dense


def test_balanced_experts_give_every_expert_the_same_rows() -> None:
    ids = balanced_experts(tokens=96, top_k=2, experts=8, seed=3)
    assert tuple(ids.shape) == (96, 2)
    assert torch.bincount(ids.flatten(), minlength=8).tolist() == [24] * 8


def test_host_measurements_in_one_process_are_real_timings() -> None:
    """The non-MoE block, the optimizer and clipping, and the model's experts, timed for real
    in this process at tiny sizes."""
    config = CalibrationConfig(
        d_model=32, d_expert=64, rows=(8, 32), dense_tokens=(64, 128), slot_counts=(1, 2),
        gemm_repeats=2, warmup=1, min_time_s=0.0, threads=1,
    )  # fmt: skip
    timer = local_timer(2, 1, 0.0)
    dense = dense_points(config, timer)
    assert {p.kind for p in dense} == {*KINDS_LOCAL}
    assert all(p.seconds > 0 for p in dense)
    cfg = gpt_config(config)
    by = {(p.kind, p.size): p for p in dense}
    # 128 tokens: one sequence of the context; F from the formula, backward twice forward
    flops = gpt_non_moe_flops_per_token(32, 128, cfg.num_experts, cfg.vocab_size, 4)
    assert by[("dense_fwd", 128)].flops == pytest.approx(128 * flops)
    assert by[("dense_bwd", 128)].flops == pytest.approx(2 * 128 * flops)
    assert by[("dense_fwd", 128)].seconds == pytest.approx(
        by[("block_fwd", 128)].seconds + by[("head_fwd", 128)].seconds / 4
    )
    step = step_points(config, timer)
    assert [(p.kind, p.size) for p in step] == [
        (k, rank_params(cfg, s)) for s in (1, 2) for k in ("optimizer", "clip")
    ]
    experts = expert_points(config, timer)
    assert [p.size for p in experts] == [8, 8, 32, 32]
    assert experts[0].flops == pytest.approx(6 * 32 * 64 * 8)  # SwiGLU: 3 matrices
    assert all(p.seconds > 0 for p in step + experts)


def _dispatch_and_allreduce(rank: int, world: int, config: CalibrationConfig) -> list:
    from poise.calibrate.host import _dist_timer, allreduce_points, dispatch_points

    timer = _dist_timer(2, 1, 0.0)
    return dispatch_points(config, timer) + allreduce_points(config, timer)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_dispatcher_and_allreduce_are_timed_on_gloo_ranks() -> None:
    from poise.runtime.launch import run_ranks

    config = CalibrationConfig(
        d_model=32, d_expert=64, dispatch_tokens=(16, 64), dense_tokens=(64, 128)
    )
    points = run_ranks(_dispatch_and_allreduce, 2, config)[0]
    dispatch = [p for p in points if p.kind.startswith("dispatch")]
    # top-2 of 8 experts, static layout on 2 ranks: half of each rank's rows leave it
    assert [(p.kind, p.size, p.nbytes) for p in dispatch] == [
        ("dispatch_fwd", 32, 16 * 32 * 4.0),
        ("dispatch_bwd", 32, 16 * 32 * 4.0),
        ("dispatch_fwd", 128, 64 * 32 * 4.0),
        ("dispatch_bwd", 128, 64 * 32 * 4.0),
    ]
    allreduce = [p for p in points if p.kind == "allreduce"]
    grads = dense_grad_bytes(gpt_config(config))  # an eighth, once and four times these
    assert [p.size for p in allreduce] == [grads // 8 // 4 * 4, grads, 4 * grads]
    assert all(p.seconds > 0 for p in points)


@pytest.mark.parametrize("width", [60, 40])
def test_tables_fold_on_a_narrow_terminal(width: int) -> None:
    """On a narrow terminal every table's numbers wrap onto further lines, none is cut with '…'
    (as `poise simulate`'s table)."""
    import io

    from rich.console import Console

    from poise.commands.calibrate import comm_table, fit_table, gemm_table, host_table

    config, gemm, comm = synthetic_points(FITTED)
    cal = fit_all(config, gemm, comm, {"hostname": "h"}, host_points=synthetic_host_points())
    for table in (gemm_table(cal), comm_table(cal), fit_table(cal), host_table(cal)):
        buf = io.StringIO()
        Console(file=buf, width=width).print(table)
        assert "…" not in buf.getvalue(), buf.getvalue()


def test_expert_timing_interleaves_row_counts_against_a_slow_stretch() -> None:
    """A stretch of slow calls (another process on the machine) must not bias the fitted
    slope: timed in interleaved sweeps, each row count gets a few slow samples and its median
    stays exact; timed one row count after another, the stretch would take most samples of
    one row count (hand-made clock: a call of n rows takes 1e-5 n + 1e-3 s, 3x during calls
    20-39 of 68)."""
    from poise.calibrate.experts import interleaved_medians

    now = [0.0]
    calls: list[int] = []

    def run(n: int) -> None:
        slow = 3.0 if 20 <= len(calls) < 40 else 1.0
        now[0] += slow * (1e-5 * n + 1e-3)
        calls.append(n)

    rows = [1024, 2048, 3072, 4096]
    medians = interleaved_medians(run, rows, repeats=15, clock=lambda: now[0])
    assert len(calls) == 4 * 17  # 2 untimed sweeps, then 15
    assert calls[:8] == [1024, 2048, 3072, 4096, 4096, 3072, 2048, 1024]
    np.testing.assert_allclose(medians, [1e-5 * n + 1e-3 for n in rows], rtol=1e-9)
    slope = np.polyfit(rows, medians, 1)[0]
    assert slope == pytest.approx(1e-5, rel=1e-9)


def test_expert_timing_leaves_the_warmup_sweeps_out() -> None:
    from poise.calibrate.experts import interleaved_medians

    now = [0.0]
    calls: list[int] = []

    def run(n: int) -> None:
        now[0] += (10.0 if len(calls) < 4 else 1.0) * 1e-5 * n  # the first sweep: cold
        calls.append(n)

    medians = interleaved_medians(run, [100, 200], repeats=1, warmup=2, clock=lambda: now[0])
    assert len(calls) == 6
    np.testing.assert_allclose(medians, [1e-3, 2e-3], rtol=1e-9)
