"""`poise demo`: the main job end to end (`--quick`, 2 gloo ranks), the report builder on run
folders written in `poise train`'s format, and a bad output folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from poise.cli import main
from poise.report.html import (
    LOSS_AGREEMENT_TOL,
    DemoData,
    MeasuredRun,
    SimSection,
    write_demo_report,
)
from poise.trace.trace import Trace

PNG = b"\x89PNG\r\n\x1a\n"
PHASES = ("data", "forward", "backward", "grad_sync", "balance", "clip", "optimizer")


def _images(html: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', html)


def _fake_run(root: Path, policy: str, losses: np.ndarray, seed: int) -> Path:
    """A run folder as `poise train` writes it: config.yaml, metrics.jsonl, summary.json and
    trace.npz, for 2 ranks, 4 MoE layers and 8 experts."""
    from poise.train.config import TrainConfig, save_config

    rng = np.random.default_rng(seed)
    out = root / f"train-{policy}"
    out.mkdir(parents=True)
    steps = len(losses)
    save_config(TrainConfig(policy=policy, steps=steps, out=str(out)), out / "config.yaml")
    counts = rng.multinomial(2048, np.full(8, 1 / 8), size=(steps, 4, 2)).astype(np.int64)
    Trace(counts, np.arange(steps), top_k=2, tokens_per_device=1024, name=policy).save(
        out / "trace.npz"
    )
    lines = []
    for s in range(steps):
        device = counts[s].sum(axis=2).astype(float)  # [L, W]
        step_s = 0.3 + 0.05 * rng.random()
        lines.append(
            json.dumps(
                {
                    "step": s + 1,
                    "loss": float(losses[s]),
                    "tokens": 2048,
                    "step_s": step_s,
                    "tokens_per_s": 2048 / step_s,
                    "max_over_mean": list(device.max(axis=1) / device.mean(axis=1)),
                    "device_tokens": device.tolist(),
                    "plan_changes": s // 3 if policy == "auto" else 0,
                    "trans_bytes": 1000 if policy == "auto" else 0,
                    "agg_bytes": 1000 if policy == "auto" else 0,
                    "migrate_bytes": 0,
                    "phases_s": {k: step_s / len(PHASES) for k in PHASES},
                    "moe_s": {"dispatch": 0.01, "experts": 0.02, "combine": 0.01},
                }
            )
        )
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"tokens_per_s": 6000.0, "plan_changes": 2, "val": [[steps, 3.5]], "world_size": 2}
    (out / "summary.json").write_text(json.dumps(summary))
    return out


def _sim_section(trace_path: Path) -> SimSection:
    from poise.core.presets import get_cluster
    from poise.core.spec import MODELS
    from poise.sim.simulator import simulate

    trace = Trace.load(trace_path)
    spec = MODELS["smartmoe-gpt"].with_(experts=8, top_k=2, moe_layers=4)
    result = simulate(trace, get_cluster("dgx-h100:1"), spec, ["static", "auto"], "sync", 2,
                      steps=3, background_planning=True)  # fmt: skip
    return SimSection("dgx-h100:1", "dgx-h100:1 (simulated)", result, 0.1, "a note")


def test_report_builder_on_run_folders(tmp_path) -> None:
    losses = np.linspace(5.5, 3.0, 8)
    runs = {
        "static": MeasuredRun.load(_fake_run(tmp_path, "static", losses, 0)),
        "auto": MeasuredRun.load(_fake_run(tmp_path, "auto", losses + 3e-7, 1)),
    }
    assert runs["auto"].device_tokens.shape == (8, 4, 2)
    sim = _sim_section(runs["static"].trace_path)
    data = DemoData(runs=runs, sims=[sim], settings={"model": "tiny <b>"}, wall_s={"x": 1.0})
    page = write_demo_report(data, tmp_path / "report")
    assert page == tmp_path / "report" / "report.html"
    html = page.read_text()
    images = _images(html)
    assert {"demo-loss.png", "demo-speed.png", "demo-phases.png", "demo-load.png"} <= set(images)
    assert "demo-sim-dgx-h100-1.png" in images
    for name in images:
        png = (page.parent / name).read_bytes()
        assert png[:8] == PNG and len(png) > 5_000
    assert "agree to float summation order" in html and "3.00e-07" in html
    assert "Maximum loss difference: 3.000e-07 over 8 steps" in html
    assert "tiny &lt;b&gt;" in html  # escaped
    assert "dgx-h100:1 (simulated)" in html and "a note" in html
    assert not list(page.parent.glob(".*.tmp"))  # atomic write left no temporary file


def test_report_says_when_losses_disagree(tmp_path) -> None:
    losses = np.linspace(5.5, 3.0, 6)
    runs = {
        "static": MeasuredRun.load(_fake_run(tmp_path, "static", losses, 0)),
        "auto": MeasuredRun.load(_fake_run(tmp_path, "auto", losses + 10 * LOSS_AGREEMENT_TOL, 1)),
    }
    html = write_demo_report(DemoData(runs=runs), tmp_path / "r").read_text()
    assert "agree to float summation order" not in html
    assert "more than float summation order explains" in html


def test_report_tells_amplified_rounding_from_a_real_difference(tmp_path) -> None:
    """Equal to rounding over the first 30 steps, then drifting apart: the page says where the
    difference first exceeds the tolerance and how large it becomes."""
    losses = np.linspace(5.5, 2.0, 40)
    drift = np.where(np.arange(40) < 33, 2e-7, 3e-3)
    runs = {
        "static": MeasuredRun.load(_fake_run(tmp_path, "static", losses, 0)),
        "auto": MeasuredRun.load(_fake_run(tmp_path, "auto", losses + drift, 1)),
    }
    html = write_demo_report(DemoData(runs=runs), tmp_path / "r").read_text()
    assert "agree to float summation order" in html
    assert "first exceed 1e-05 at step 34" in html and "3.00e-03" in html
    assert "Final validation loss: 3.5000 (static) and 3.5000 (auto)" in html


def test_measured_run_missing_folder_is_one_error(tmp_path) -> None:
    from poise.core.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read the training run"):
        MeasuredRun.load(tmp_path / "nothing")


def test_demo_output_folder_not_writable(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["demo", "--quick", "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poise: error:")
    assert "--out" in err[0] and "not writable" in err[0] and str(blocker) in err[0]


@pytest.mark.dist
def test_demo_quick_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = out / "report.html"
    assert f"report: {report}" in printed.replace("\n", "")
    html = report.read_text()
    images = _images(html)
    for name in ("demo-loss.png", "demo-speed.png", "demo-phases.png", "demo-load.png",
                 "demo-sim-dgx-h100-8.png", "demo-sim-cross-dc-1000.png"):  # fmt: skip
        assert name in images
        assert (out / name).read_bytes()[:8] == PNG
    assert "agree to float summation order" in html
    assert "Maximum loss difference" in html
    for policy in ("static", "shadow", "permute", "vexpert", "eplb", "prophet", "hybrid", "auto"):
        assert f"<td>{policy}</td>" in html
    for run in ("train-static", "train-auto"):
        assert (out / run / "trace.npz").is_file() and (out / run / "metrics.jsonl").is_file()
