"""The simulator: stale plans cost more, scaling keeps proportions, planning time is charged,
the online predictor matches the batch one, bad input fails with one clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from poise.errors import ConfigError
from poise.predict import OnlineForecast, Predictor
from poise.sim.scaling import ScaledTrace, source_rows
from poise.sim.simulator import simulate
from poise.topology import get_cluster
from poise.trace_generate import generate

from .helpers import toy_cluster, toy_spec


def drift_trace(steps: int = 24, devices: int = 8, experts: int = 8, seed: int = 3):
    return generate(
        "drift",
        steps=steps,
        layers=2,
        devices=devices,
        experts=experts,
        top_k=2,
        tokens_per_device=512,
        seed=seed,
        s=1.5,
        rate=0.15,
    )


def test_stale_plan_costs_more_than_fresh_on_drift() -> None:
    trace = drift_trace()
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)

    def mean_step(every: int) -> float:
        result = simulate(
            trace, cluster, spec, ["eplb"], "sync", every, "last", count_planning=False
        )
        return result.runs["eplb"].step_s[1:].mean()

    fresh, stale = mean_step(1), mean_step(100)
    assert fresh < stale


def test_each_step_priced_on_actual_loads_with_breakdown() -> None:
    trace = drift_trace(steps=6)
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    result = simulate(trace, cluster, spec, ["static", "auto"], "sync", 2, "ema")
    static, auto = result.runs["static"], result.runs["auto"]
    assert static.layer_s.shape == (6, 2) and static.phases["dispatch_s"].shape == (6, 2)
    # Planning is charged only at re-planning steps (0, 2, 4), and the step time includes it.
    assert np.all(auto.plan_s[[1, 3, 5]] == 0) and np.all(auto.plan_s[[0, 2, 4]] > 0)
    assert np.allclose(auto.step_s, auto.layer_s.sum(axis=1) + auto.plan_s)
    assert result.scaling.startswith("trace replayed as recorded")


def test_prophet_schedule_hides_planning_under_all_to_all() -> None:
    trace = drift_trace(steps=4)
    # A slow network: each step's all-to-all takes far longer than planning.
    cluster = toy_cluster(4, 2, bw=1e6, inter_bw=1e6, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    hidden = simulate(trace, cluster, spec, ["prophet"], "prophet", 2, "ema")
    assert np.all(hidden.runs["prophet"].plan_s == 0)
    assert np.all(hidden.runs["prophet"].plan_wall_s[[0, 2]] > 0)


def test_background_planning_applies_each_plan_one_step_later() -> None:
    """A planner thread beside training: step 0 runs the static layout, the plan made at step s
    prices from step s + 1, and planning is charged only beyond the step it runs beside."""
    trace = drift_trace(steps=6)
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    args = (trace, cluster, spec, ["static", "eplb"], "sync", 2, "ema")
    inline = simulate(*args, count_planning=False)
    background = simulate(*args, count_planning=False, background_planning=True)
    bg, il = background.runs["eplb"], inline.runs["eplb"]
    np.testing.assert_allclose(bg.layer_s[0], background.runs["static"].layer_s[0])
    # Plans are made from the same forecasts; the one made at step 2 is in force at 3 and 4
    # in the background replay (paying its migration at 3), at 2 and 3 inline.
    recurring_bg = bg.layer_s - bg.phases["migrate_s"]
    np.testing.assert_allclose(recurring_bg[3], il.layer_s[3])
    np.testing.assert_allclose(bg.phases["migrate_s"][3], il.phases["migrate_s"][2])
    assert not np.allclose(bg.layer_s[2], il.layer_s[2])
    assert np.all(bg.plan_s == 0)  # not charged, as asked
    step = bg.layer_s.sum(axis=1)
    expected = np.where(bg.plan_wall_s > 0, np.maximum(0.0, bg.plan_wall_s - step), 0.0)
    np.testing.assert_allclose(bg.plan_charge_s, expected)
    # A planner slower than the step it runs beside is charged the difference.
    slow = toy_cluster(4, 2, bw=5e12, inter_bw=2e12, lat=1e-9, flops=1e18)
    fast_steps = simulate(
        trace, slow, spec, ["auto"], "sync", 2, "ema", background_planning=True
    ).runs["auto"]
    replans = fast_steps.plan_wall_s > 0
    assert np.all(fast_steps.plan_s[replans] > 0)
    np.testing.assert_allclose(
        fast_steps.step_s, fast_steps.layer_s.sum(axis=1) + fast_steps.plan_s
    )


def test_scaling_keeps_expert_proportions_and_row_variation() -> None:
    trace = drift_trace(steps=3, devices=16, experts=8)
    scaled = ScaledTrace.create(trace.counts, 128, seed=1)
    assert scaled.devices == 128 and scaled.scaled
    rows = scaled.rows
    assert np.array_equal(np.bincount(rows, minlength=16), np.full(16, 8))  # 8 devices per rank
    for s in range(3):
        step = scaled.step(s)
        assert step.shape == (2, 128, 8)
        np.testing.assert_allclose(step.sum(axis=1), 8 * trace.counts[s].sum(axis=1))
        # Every modelled device replays a recorded row exactly.
        assert np.array_equal(step[:, 5], trace.counts[s][:, rows[5]])
    # Not dividing: proportions kept approximately, every row used 6 or 7 times.
    uses = np.bincount(source_rows(16, 100, seed=2), minlength=16)
    assert uses.min() == 6 and uses.max() == 7 and uses.sum() == 100
    assert "scaled from 16 to 128" in scaled.describe()


def test_scaled_simulation_on_many_devices() -> None:
    trace = drift_trace(steps=4, devices=16, experts=16)
    cluster = get_cluster("dgx-h100:32")  # 256 devices
    spec = toy_spec(experts=16, layers=2, d_model=256, d_expert=512, tokens=512)
    result = simulate(trace, cluster, spec, ["static", "shadow"], "sync", 2, "ema")
    assert result.runs["static"].device_load.shape == (4, 256)
    assert np.all(np.isfinite(result.runs["shadow"].step_s))
    assert "16 to 256" in result.scaling


def test_online_forecast_matches_batch_predictor() -> None:
    x = np.random.default_rng(0).random((7, 2, 3, 4))
    kinds = (Predictor("last"), Predictor("window", window=3), Predictor("ema", alpha=0.3))
    for predictor in kinds:
        batch = predictor.predict_all(x)
        online = OnlineForecast(predictor)
        for t in range(7):
            online.update(x[t])
            np.testing.assert_allclose(online.forecast(), batch[t], rtol=1e-12)
    with pytest.raises(ConfigError, match="no step observed"):
        OnlineForecast(Predictor()).forecast()


def test_trace_and_model_disagree_on_experts() -> None:
    trace = drift_trace(steps=2)
    with pytest.raises(ConfigError, match="8 experts but model") as info:
        simulate(trace, toy_cluster(4, 2), toy_spec(experts=4, layers=2), ["static"])
    assert info.value.field == "experts"
    with pytest.raises(ConfigError, match="unknown policy"):
        simulate(trace, toy_cluster(4, 2), toy_spec(experts=8, layers=2), ["nope"])


def _poise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "poise.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_simulate_writes_table_csv_json_and_plots(tmp_path) -> None:
    trace = tmp_path / "drift.npz"
    drift_trace(steps=6, devices=16, experts=16).save(trace)
    out = tmp_path / "out"
    proc = _poise(
        "simulate",
        str(trace),
        "--cluster",
        "dgx-h100:4",
        "--policies",
        "static,eplb,auto",
        "--replan-every",
        "3",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "eplb" in proc.stdout and "vs static" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 32 and "16 to 32" in summary["scaling"]
    assert {row["policy"] for row in summary["policies"]} == {"static", "eplb", "auto"}
    steps_csv = (out / "steps.csv").read_text().splitlines()
    assert len(steps_csv) == 1 + 6 * 3
    assert len((out / "layers.csv").read_text().splitlines()) == 1 + 6 * 3 * 2
    for png in ("step_time.png", "breakdown.png", "device_load.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cluster", "no-such-preset"], "no-such-preset"),
        (["--model", "gpt-s"], "experts"),
        (["--schedule", "warp"], "schedule"),
        (["--policies", "static,warp"], "policy"),
    ],
)
def test_cli_simulate_bad_input_is_one_line(tmp_path, args: list[str], needle: str) -> None:
    trace = tmp_path / "drift.npz"
    drift_trace(steps=2, devices=16, experts=8).save(trace)
    proc = _poise("simulate", str(trace), "--out", str(tmp_path / "o"), *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
