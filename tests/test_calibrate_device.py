"""`poise calibrate --device cuda`'s pieces: the floor and curve fit from a device's expert calls,
the cluster they go into, and the whole measurement run on the CPU (the same code, host clock)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poise.calibrate.device_experts import (
    calibrate_device,
    device_cluster,
    fit_device,
)
from poise.cli import main
from poise.core.cluster import Cluster
from poise.core.presets import get_cluster
from poise.core.spec import get_model


def synthetic_calls(rows: np.ndarray, F: float, h: float, floor: float, slots: int, f: float):
    """Seconds of a device's call of `slots` experts: max(floor, slots * 3 f (n + h) / F)."""
    return np.maximum(floor, slots * 3.0 * f * (rows + h) / F)


def test_fit_recovers_rate_half_rows_and_floor_of_a_floored_curve() -> None:
    rows = np.array([16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192], dtype=np.float64)
    F, h, floor, slots, f = 500e12, 400.0, 0.9e-3, 8, 2 * 2 * 1024 * 4096
    seconds = synthetic_calls(rows, F, h, floor, slots, f)
    fitted = fit_device(rows.astype(int), seconds, slots, f)
    assert fitted["floor_s"] == pytest.approx(floor)
    # Only calls of at least two floors enter the curve, and those follow it exactly.
    assert fitted["fit_rows"] == [
        int(n) for n, s in zip(rows, seconds, strict=True) if s >= 2 * floor
    ]
    assert fitted["gemm_flops"] == pytest.approx(F, rel=1e-9)
    assert fitted["half_rows"] == pytest.approx(h, rel=1e-9)


def test_fit_on_floored_calls_would_inflate_the_half_rows() -> None:
    """The reference the rule above is checked against: fitting every call, floor included,
    reads the floor as a small-GEMM loss (h several times too large)."""
    from poise.calibrate.fit import fit_gemm_curve

    rows = np.array([16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192], dtype=np.float64)
    F, h, floor, slots, f = 500e12, 400.0, 0.9e-3, 8, 2 * 2 * 1024 * 4096
    seconds = synthetic_calls(rows, F, h, floor, slots, f)
    naive = fit_gemm_curve(rows, seconds / slots, 3.0 * f * rows)
    assert naive.half_rows > 2 * h


def test_device_cluster_replaces_only_the_measured_figures() -> None:
    base = get_cluster("dgx-h100")
    got = device_cluster(base, "bf16", 400e12, 300.0, 1.2e-3, "calibrated-x", 80e9)
    assert isinstance(got, Cluster)
    assert got.gemm_flops("bf16") == pytest.approx(400e12)
    assert got.gemm_flops("fp32") == pytest.approx(base.gemm_flops("fp32"))
    assert got.gemm_half_rows == 300.0 and got.expert_call_floor_s == 1.2e-3
    assert got.memory_bytes == 80e9 and got.name == "calibrated-x"
    assert got.intra_node == base.intra_node and got.inter_node == base.inter_node
    assert got.num_devices == base.num_devices


def test_calibrate_device_on_the_cpu_measures_and_fits() -> None:
    base = get_cluster("cpu-2")
    cluster, measured = calibrate_device(
        base,
        "tiny",
        torch.device("cpu"),
        dtype_name="fp32",
        slots=2,
        rows=(8, 32, 128, 512),
        repeats=1,
        inner=1,
    )
    spec = get_model("tiny")
    assert measured["seconds"] and all(s > 0 for s in measured["seconds"])
    assert measured["floor_s"] == pytest.approx(min(measured["seconds"]))
    assert cluster.expert_call_floor_s == pytest.approx(measured["floor_s"])
    assert cluster.gemm_flops("fp32") == pytest.approx(measured["gemm_flops"])
    assert measured["d_model"] == spec.d_model and measured["gpu"] == "cpu"


def test_cuda_calibration_without_a_gpu_is_one_clear_error(tmp_path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc = main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "g.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "no CUDA device" in err
    assert not (tmp_path / "g.yaml").exists()
