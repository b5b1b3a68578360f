"""`benchmarks/gpu_suite.py`: without CUDA its GPU form says so in one line and exits 0; its CPU
smoke form runs every check (tiny sizes) and each gives lines with the device stamped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def run_suite(*args: str) -> tuple[int, list[dict]]:
    done = subprocess.run(
        [sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=900
    )
    lines = [json.loads(t) for t in done.stdout.splitlines() if t.startswith("{")]
    return done.returncode, lines


def test_without_cuda_the_gpu_suite_is_one_line_and_exit_0() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, lines = run_suite()
    assert rc == 0
    assert len(lines) == 1 and lines[0]["device"] == "cuda" and "no CUDA" in lines[0]["skipped"]


def test_cpu_smoke_runs_every_check(tmp_path: Path) -> None:
    rc, lines = run_suite("--device", "cpu", "--work", str(tmp_path))
    by_check: dict[str, list[dict]] = {}
    for line in lines[:-1]:
        by_check.setdefault(line["check"], []).append(line)
    assert set(by_check) == {"layer-2048", "host-waits", "train", "calibrate"}
    assert all(line["ok"] for line in lines[:-1]), [x for x in lines if not x.get("ok", True)]
    assert rc == 0 and lines[-1]["failed"] == 0
    assert all(line["device"] == "cpu" and line["gpu"] == "none" for line in lines)
    impls = {line["impl"] for line in by_check["layer-2048"] if "fwd_bwd_ms" in line}
    assert {"poise", "dense", "poise-compiled", "dense-compiled"} <= impls
    assert "CUDA" in by_check["host-waits"][0]["skipped"]
    (train,) = by_check["train"]
    assert train["steps"] == [1, 2] and len(train["losses"]) == 2
    (cal,) = by_check["calibrate"]
    assert cal["gemm_fits"]["forward+backward"]["gemm_flops"] > 0
