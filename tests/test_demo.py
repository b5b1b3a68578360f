"""`poise demo`: the main job end to end (`--quick`, 2 gloo ranks), the report builder on run
folders written in `poise train`'s format, and a bad output folder."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from poise.cli import main
from poise.report.figure_workers import FigureWorkers
from poise.report.html import DemoData, SimSection, write_demo_report
from poise.report.runs import LOSS_AGREEMENT_TOL, MeasuredRun
from poise.report.tables import BREAKDOWN_GROUPS, breakdown_by_phase, breakdown_table
from poise.trace.trace import Trace

from .helpers import toy_cluster, toy_spec

PNG = b"\x89PNG\r\n\x1a\n"
PHASES = ("data", "forward", "backward", "grad_sync", "balance", "clip", "optimizer")


def _images(html: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', html)


def _fake_run(
    root: Path, policy: str, losses: np.ndarray, seed: int, switches: tuple[int, ...] = ()
) -> Path:
    """A run folder as `poise train` writes it: config.yaml, metrics.jsonl, summary.json and
    trace.npz, for 2 ranks, 4 MoE layers and 8 experts; another plan took effect after each step
    in `switches`."""
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
                    "switched": s + 1 in switches,
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


@pytest.mark.parametrize("workers", [0, 1])
def test_report_builder_on_run_folders(tmp_path, workers: int) -> None:
    """The page and every figure it names, drawn here or by a worker (the page is written
    once the figures are)."""
    losses = np.linspace(5.5, 3.0, 8)
    runs = {
        "static": MeasuredRun.load(_fake_run(tmp_path, "static", losses, 0)),
        "auto": MeasuredRun.load(_fake_run(tmp_path, "auto", losses + 3e-7, 1)),
    }
    assert runs["auto"].device_tokens.shape == (8, 4, 2)
    sim = _sim_section(runs["static"].trace_path)
    data = DemoData(runs=runs, sims=[sim], settings={"model": "tiny <b>"}, wall_s={"x": 1.0})
    page = write_demo_report(data, tmp_path / "report", FigureWorkers(workers))
    assert page == tmp_path / "report" / "report.html"
    html = page.read_text()
    images = _images(html)
    assert {"demo-loss.png", "demo-speed.png", "demo-phases.png", "demo-load.png"} <= set(images)
    assert "demo-sim-dgx-h100-1.png" in images
    for name in images:
        png = (page.parent / name).read_bytes()
        assert png[:8] == PNG and len(png) > 5_000
    assert "agree to float rounding over all 8 steps" in html and "3.00e-07" in html
    assert "Maximum loss difference: 3.000e-07 over 8 steps" in html
    assert "tiny &lt;b&gt;" in html  # escaped
    assert "dgx-h100:1 (simulated)" in html and "a note" in html
    assert "step time by phase" in html and "dense all-reduce (ms)" in html
    assert not list(page.parent.glob(".*.tmp"))  # atomic write left no temporary file


def _ms(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_demo_simulations_charge_the_dense_allreduce(tmp_path, monkeypatch) -> None:
    """The demo's simulated clusters price whole steps as `poise
    simulate` does: every step of every policy pays the all-reduce of the gradients of the
    model's dense parameters (`ModelSpec.dense_params`) on the cluster's links, the note says
    so, and the breakdown table shows it beside the other phases, adding up to the step time
    (the demo's schedule is `sync`). A 2-step trace keeps this fast."""
    import poise.commands.demo_sims as demo_sims
    from poise.commands.demo import QUICK, simulate_clusters
    from poise.cost.step_overheads import allreduce_seconds

    run = _fake_run(tmp_path, "static", np.linspace(5.5, 3.0, 2), 0)
    trace = Trace.load(run / "trace.npz")
    monkeypatch.setattr(demo_sims, "find_shared_data", lambda explicit: None)  # no shared data
    sims, _ = simulate_clusters(trace, QUICK, None, Console(file=io.StringIO()), quick=True)
    assert sims and sims[0].key == "own"
    for sec in sims:
        res, spec = sec.result, sec.result.spec
        assert spec.dense_params > 0
        grad = allreduce_seconds(res.cluster, spec.dense_params * spec.dtype_bytes)
        assert grad > 0
        for name, r in res.runs.items():
            np.testing.assert_allclose(r.outside_s["grad_allreduce_s"], grad, rtol=1e-12)
            outside = sum(r.outside_s.values())
            np.testing.assert_allclose(
                r.step_s, r.layer_s.sum(axis=1) + outside + r.plan_s, rtol=1e-12, err_msg=name
            )
        assert f"{spec.dense_params:,} replicated (dense) parameters" in sec.note
        assert spec.experts >= res.cluster.num_devices
        columns, rows = breakdown_table(res)
        assert len(rows) == len(res.runs) and "overlapped (ms)" not in columns
        col = columns.index("dense all-reduce (ms)")
        for row in rows:
            assert _ms(row[col]) == pytest.approx(grad * 1e3, abs=0.005)
            # rounded to 0.01 ms per cell
            assert sum(_ms(c) for c in row[2:]) == pytest.approx(_ms(row[1]), abs=0.01 * len(row))
        # The console's form: a row per phase, a column per policy asked for.
        columns, rows = breakdown_by_phase(res, ["static", "auto", "static", "nope"])
        assert columns == ["ms per step", "static", "auto"]
        by_phase = {row[0]: row[1:] for row in rows}
        assert _ms(by_phase["dense all-reduce"][0]) == pytest.approx(grad * 1e3, abs=0.005)
        assert by_phase["step"][0] == next(
            r[1] for r in breakdown_table(res)[1] if r[0] == "static"
        )


def test_breakdown_groups_cover_every_phase_and_show_overlap() -> None:
    """Every phase a `PolicyRun` totals is in exactly one breakdown group; under an overlapping
    schedule the table shows the hidden work as a negative column."""
    from poise.sim.simulator import simulate

    counts = np.random.default_rng(1).integers(0, 400, size=(2, 2, 4, 4)).astype(np.float64)
    spec = toy_spec(experts=4, layers=2, d_model=64, d_expert=256, tokens=800, non_moe=1e5)
    cluster = toy_cluster(2, 2, bw=1e9, inter_bw=1e8, lat=1e-6, flops=1e11)
    res = simulate(counts, cluster, spec, ["static"], "pipelined(4)", count_planning=False)
    grouped = [k for _, keys in BREAKDOWN_GROUPS for k in keys]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == set(res.runs["static"].phase_totals())
    columns, rows = breakdown_table(res)
    assert columns[-1] == "overlapped (ms)" and _ms(rows[0][-1]) < 0
    assert sum(_ms(c) for c in rows[0][2:]) == pytest.approx(_ms(rows[0][1]), abs=0.01 * 12)


def _agreement_page(tmp_path, static: np.ndarray, auto: np.ndarray, switches=()) -> str:
    runs = {
        "static": MeasuredRun.load(_fake_run(tmp_path, "static", static, 0)),
        "auto": MeasuredRun.load(_fake_run(tmp_path, "auto", auto, 1, switches)),
    }
    return write_demo_report(DemoData(runs=runs), tmp_path / "r").read_text()


def _agreement_class(html: str) -> str | None:
    """The CSS class of the page's loss-agreement paragraph (None when it has none)."""
    m = re.search(r'<p(?: class="(\w+)")?>(?:The static and auto|A plan changed)', html)
    assert m is not None
    return m.group(1)


def test_report_says_when_losses_disagree(tmp_path) -> None:
    losses = np.linspace(5.5, 3.0, 6)
    html = _agreement_page(tmp_path, losses, losses + 10 * LOSS_AGREEMENT_TOL, switches=(3,))
    assert "agree to float rounding" not in html
    assert "something other than a plan changed the training" in html
    assert "over the 3 steps up to the first plan change (after step 3)" in html
    assert _agreement_class(html) == "bad"


def test_report_judges_agreement_until_the_first_plan_change(tmp_path) -> None:
    """The demo's case: exact until step 27, a router flip at 28 amplified by training, the first
    switch after step 11. Judged on steps 1-11 (the same computation), described after."""
    losses = np.linspace(5.5, 2.0, 40)
    diff = np.zeros(40)
    diff[[17, 19]] = 2.4e-7  # rounding after the switch
    diff[27:] = 7.6e-6 * 3.0 ** np.arange(13)  # steps 28-40: 7.6e-6 growing
    html = _agreement_page(tmp_path, losses, losses + diff, switches=(11, 21))
    assert "agree to float rounding over the 11 steps up to the first plan change" in html
    assert "largest difference is 0.00e+00" in html
    assert "leave rounding at step 29, 18 steps later (2.28e-05)" in html
    assert f"grows to {diff.max():.2e} (step 40; {diff[-1]:.2e} at the last step)" in html
    assert _agreement_class(html) == "ok"


@pytest.mark.parametrize("bad_step", [1, 5, 11])
def test_a_difference_before_or_at_the_first_switch_is_flagged(tmp_path, bad_step) -> None:
    """Steps up to and including the switch step are the same computation in both runs (the plan
    changes after that step's loss): a difference there is a fault, however late the switch."""
    losses = np.linspace(5.5, 2.0, 40)
    diff = np.zeros(40)
    diff[bad_step - 1] = 5 * LOSS_AGREEMENT_TOL
    html = _agreement_page(tmp_path, losses, losses + diff, switches=(11,))
    assert "something other than a plan changed the training" in html
    assert _agreement_class(html) == "bad"


def test_a_difference_right_after_the_switch_is_described_not_judged(tmp_path) -> None:
    losses = np.linspace(5.5, 2.0, 40)
    diff = np.where(np.arange(1, 41) >= 12, 1e-3, 0.0)
    html = _agreement_page(tmp_path, losses, losses + diff, switches=(11,))
    assert "leave rounding at step 12, 1 step later" in html
    assert _agreement_class(html) == "ok"


def test_runs_that_never_switch_are_judged_on_every_step(tmp_path) -> None:
    """With no plan change the two runs are one computation throughout: a difference at step 35
    (long after any fixed early window) is flagged."""
    losses = np.linspace(5.5, 2.0, 40)
    diff = np.where(np.arange(1, 41) == 35, 1e-4, 0.0)
    html = _agreement_page(tmp_path, losses, losses + diff)
    assert "over all 40 steps (neither run changed its plan)" in html
    assert _agreement_class(html) == "bad"
    html = _agreement_page(tmp_path / "same", losses, losses + 2e-7)
    assert "agree to float rounding over all 40 steps" in html
    assert _agreement_class(html) == "ok"


def test_a_plan_change_before_any_common_step_cannot_be_judged(tmp_path) -> None:
    losses = np.linspace(5.5, 2.0, 10)
    static = MeasuredRun.load(_fake_run(tmp_path, "static", losses, 0))
    auto = MeasuredRun.load(_fake_run(tmp_path, "auto", losses + 1e-3, 1, switches=(1, 4)))
    assert auto.switches == [1, 4]
    from dataclasses import replace

    late_static = replace(static, steps=static.steps[2:], losses=static.losses[2:])
    html_runs = {"static": late_static, "auto": auto}
    html = write_demo_report(DemoData(runs=html_runs), tmp_path / "r").read_text()
    assert "agreement cannot be judged from the curves" in html
    assert _agreement_class(html) is None


def test_measured_run_reads_switches_from_older_logs(tmp_path) -> None:
    """Runs logged before `switched` existed mark plan changes with `plan_changed`."""
    folder = _fake_run(tmp_path, "auto", np.linspace(5.5, 3.0, 6), 1)
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        del r["switched"]
        r["plan_changed"] = r["step"] in (2, 5)
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    assert MeasuredRun.load(folder).switches == [2, 5]


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
                 "demo-sim-own.png"):  # fmt: skip
        assert name in images
        assert (out / name).read_bytes()[:8] == PNG
    doc = json.loads((out / "demo.json").read_text())
    assert {"static_tok_s", "auto_tok_s", "speedup", "ideal_speedup"} <= set(doc["measured"])
    assert all(s["experts"] >= s["devices"] for s in doc["simulated"])
    assert "agree to float rounding" in html
    assert "Maximum loss difference" in html
    for policy in ("static", "shadow", "permute", "vexpert", "eplb", "prophet", "hybrid", "auto"):
        assert f"<td>{policy}</td>" in html
    for run in ("train-static", "train-auto"):
        assert (out / run / "trace.npz").is_file() and (out / run / "metrics.jsonl").is_file()


def _no_shared_data(monkeypatch: pytest.MonkeyPatch) -> None:
    import poise.commands.demo_sims as demo_sims

    monkeypatch.setattr(demo_sims, "find_shared_data", lambda explicit: None)


@pytest.mark.parametrize("found", [True, False])
def test_demo_sim_cases_have_experts_at_least_devices(
    tmp_path, monkeypatch: pytest.MonkeyPatch, found: bool
) -> None:
    """Every simulated cluster of the demo has at least as many experts as devices; with the
    shared data the real routing is there (SmartMoE-AE, OLMoE, 256 experts top-8 on 64 and 256
    H100 in the full demo); without it only the run's own trace is, and `missing` says what."""
    from poise.commands.demo_sims import (
        SPLIT,
        find_shared_data,
        sim_cases,
        split_experts,
        split_parents,
    )
    from poise.core.presets import get_cluster

    if found and find_shared_data(None) is None:
        pytest.skip("shared routing data not found")
    if not found:
        _no_shared_data(monkeypatch)
    own = Trace.load(_fake_run(tmp_path, "static", np.linspace(5.5, 3.0, 4), 0) / "trace.npz")
    cases = sim_cases(own, None, quick=False, sim_steps=30)
    for case in cases.cases:
        devices = get_cluster(case.cluster).num_devices
        assert case.spec.experts >= devices, case.key
        assert case.trace.experts == case.spec.experts and case.trace.top_k == case.spec.top_k
    keys = [c.key for c in cases.cases]
    if found:
        assert keys == ["own", "smartmoe", "olmoe", "dsv3-64", "dsv3-256"]
        assert not cases.missing
        dsv3 = cases.cases[-1]
        assert (dsv3.spec.experts, dsv3.spec.top_k) == (256, 8)
        olmoe = cases.cases[2].trace
        # Splitting conserves every count: each coarse expert's is the sum of its parts'.
        fine = split_experts(olmoe, SPLIT)
        np.testing.assert_array_equal(fine.counts, dsv3.trace.counts[: fine.steps])
        parents = split_parents(olmoe.layers, olmoe.experts, SPLIT)
        for layer in range(olmoe.layers):
            summed = np.zeros_like(olmoe.counts[:, layer])
            np.add.at(summed.T, parents[layer], fine.counts[:, layer].T)
            np.testing.assert_array_equal(summed, olmoe.counts[:, layer])
    else:
        assert keys == ["own"] and len(cases.missing) == 2


def test_split_experts_numbers_the_parts_apart() -> None:
    """A hot expert's parts are not numbered side by side: in a layer, no block of `parts`
    consecutive fine experts (what static EP puts on one device) holds one expert's parts
    alone, each layer is numbered its own way, and every part's count is its parent's share
    (a hand-made trace: expert 0 takes every token)."""
    from poise.commands.demo_sims import split_experts, split_parents

    parents = split_parents(layers=3, experts=64, parts=4)
    assert parents.shape == (3, 256)
    for layer in parents:
        assert np.array_equal(np.bincount(layer, minlength=64), np.full(64, 4))
        blocks = layer.reshape(64, 4)
        assert not np.any((blocks == blocks[:, :1]).all(axis=1))
    assert not np.array_equal(parents[0], parents[1])
    counts = np.zeros((2, 3, 1, 64), dtype=np.int64)
    counts[:, :, :, 0] = 1000
    fine = split_experts(Trace(counts, np.arange(2), 1, 1000, name="hot"), 4)
    for layer in range(3):
        hot = np.flatnonzero(fine.counts[0, layer, 0])
        assert set(hot) <= set(np.flatnonzero(parents[layer] == 0))
        assert fine.counts[0, layer, 0].sum() == 1000


def test_demo_quick_writes_demo_json(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The quick path with its training runs faked (run folders in `poise train`'s format) and
    no shared data: `OUT/demo.json` holds the measured line (static, auto, speedup, ideal) and
    the simulated tables, written atomically, and the report says the real routing was not
    found."""
    import poise.calibrate.experts as experts
    import poise.commands.demo as demo

    _no_shared_data(monkeypatch)
    seeds = {"static": 0, "auto": 1}

    clocks = []
    batches: list[int] = []

    def fake_train(cfgs, console, turns, clock):
        clocks.append(clock)
        batches.extend(cfg.batch for cfg in cfgs)
        for cfg in cfgs:
            out = Path(cfg.out)
            losses = np.linspace(5.5, 3.0, cfg.steps)
            _fake_run(out.parent, cfg.policy, losses, seeds[cfg.policy])
        return 0.1, {"c_s": 2e-5}  # the expert clock's reading in the runs' turns

    monkeypatch.setattr(demo, "train_in_turns", fake_train)
    monkeypatch.setattr(experts, "expert_seconds_per_token", lambda *a, **k: {"c_s": 99.0})
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 8)  # ranks of 4 threads each
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    doc = json.loads((out / "demo.json").read_text())
    m = doc["measured"]
    assert m["expert_us_per_token"] == pytest.approx(20.0)  # the clock's, nothing timed alone
    (clock,) = clocks  # the clock runs over the training's steps, at its ranks' threads
    assert clock.keywords["steps"] == 30 and clock.keywords["d_expert"] == 1024
    assert clock.keywords["threads"] == 4
    # the quick runs' smaller batch (the full demo's is 16), the same on both sides
    assert batches == [demo.QUICK.batch] * 2 and demo.QUICK.batch < demo.FULL.batch == 16
    for key in ("static_tok_s", "auto_tok_s", "speedup", "ideal_speedup", "gain_fraction"):
        assert key in m
    assert m["speedup"] == pytest.approx(m["auto_tok_s"] / m["static_tok_s"], rel=1e-3)
    assert m["ideal_speedup"] >= 1.0  # the fake runs send equal loads from both ranks
    assert [s["key"] for s in doc["simulated"]] == ["own"]
    for sim in doc["simulated"]:
        assert sim["experts"] >= sim["devices"]
        assert {p["policy"] for p in sim["policies"]} >= {"static", "auto"}
    assert len(doc["real_data_missing"]) == 2
    assert not list(out.glob(".*.tmp"))
    html = (out / "report.html").read_text()
    assert "Real routing not found" in html and "share of the gain" in html
    assert "summary: " in capsys.readouterr().out


def test_measured_summary_counts_by_hand_and_says_the_runs_took_turns(tmp_path) -> None:
    """Static's and auto's tokens/s are the tokens over the measured steps' seconds (counted
    here by hand), the speedup their ratio, the ideal the static run's; the text says the runs
    took their steps in turns where both configs name a turn file, and not otherwise."""
    from poise.commands.demo_report import measured_summary
    from poise.report.ideal import ideal_of

    losses = np.linspace(5.0, 4.0, 20)
    folders = {
        p: _fake_run(tmp_path / p, p, losses, seed) for p, seed in (("static", 1), ("auto", 2))
    }
    rows = [json.loads(x) for x in (folders["static"] / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # the fake runs are balanced (ideal 1.0): skew static's devices
        r["device_tokens"] = [[1500.0, 548.0]] * 4
    (folders["static"] / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    runs = {p: MeasuredRun.load(f) for p, f in folders.items()}

    def by_hand(run: MeasuredRun) -> float:
        rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
        kept = [r for r in rows if r["step"] > 5]  # skip 5
        return sum(r["tokens"] for r in kept) / sum(r["step_s"] for r in kept)

    c_s = 20e-6
    runs["auto"].last_evidence = {"clock_s": 0.02, "clock_se_s": 0.005, "probes": 4}
    one = measured_summary(runs, 5, c_s)
    assert one.static_tok_s == pytest.approx(by_hand(runs["static"]), rel=1e-9)
    assert one.auto_tok_s == pytest.approx(by_hand(runs["auto"]), rel=1e-9)
    assert one.speedup == pytest.approx(by_hand(runs["auto"]) / by_hand(runs["static"]), rel=1e-9)
    ideal = ideal_of(runs["static"], c_s, 5)["ideal_speedup"]
    assert ideal > 1.05  # 4 x 476 rows x 20 us a step
    assert one.ideal_speedup == pytest.approx(ideal, rel=1e-12)
    assert "in turns" not in one.text
    for run in runs.values():
        run.config["turns"] = str(tmp_path / "train.turns")
    assert "in turns" in measured_summary(runs, 5, c_s).text
    assert "4 probe steps" in one.text and "saved 20.0 ms" in one.text  # auto's own clock
    # where the ideal's gain went (`poise.report.gain_accounting`): in the JSON, the report's
    # table; the console's summary at most 3 lines, without the internal targets
    account = one.gain_accounting
    assert account is not None and one.as_json()["gain_accounting"] == account
    assert account["achieved"] + sum(account["lost"].values()) == pytest.approx(1, abs=5e-3)
    assert 1 <= len(one.lines) <= 3 and one.lines[0].startswith(f"auto {one.speedup:.2f}x static")
    assert not any("met" in line or ">=" in line for line in one.lines)
    assert all(len(p) < 700 for p in one.text.split("\n\n"))  # short paragraphs


def test_where_the_gain_went_as_table_rows() -> None:
    """`accounting_rows`: what auto kept, then each cause with its share and its steps."""
    from poise.report.gain_accounting import accounting_rows

    lost = {
        "static_layout": 0.1, "probe_steps": 0.08, "switch_steps": 0.04,
        "residual_imbalance": 0.13, "transfers": 0.07, "other": 0.24,
    }  # fmt: skip
    steps = {"static_layout": 9, "probe_steps": 6, "switch_steps": 3, "under_plans": 70}
    account = {"ideal_gain_ms": 92.3, "achieved": 0.34, "lost": lost, "steps": steps}
    rows = accounting_rows(account)
    assert rows[0] == ("kept by auto", "34%", "")
    assert rows[1] == ("lost on the static layout", "10%", "9")
    assert rows[2] == ("lost on probe steps (the homes without the replicas)", "8%", "6")
    assert [r[1] for r in rows[3:]] == ["4%", "13%", "7%", "24%"]
    assert rows[-1][2] == "70"


def test_a_run_keeps_its_last_evidence_with_probe_steps(tmp_path) -> None:
    """`MeasuredRun.last_evidence`: the last logged evidence with a paired clock's reading;
    later evidence without probes, and steps without evidence, do not replace it."""
    folder = _fake_run(tmp_path, "auto", np.linspace(5.0, 4.0, 6), 1)
    assert MeasuredRun.load(folder).last_evidence == {}
    verdicts = [
        {},
        {"clock_s": 0.01, "clock_se_s": 0.002, "probes": 4},
        {},
        {"clock_s": 0.02, "clock_se_s": 0.003, "probes": 5},
        {"clock_s": None, "clock_se_s": 0.0, "probes": 0},
        {},
    ]
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r, v in zip(rows, verdicts, strict=True):
        r["evidence"] = v
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert MeasuredRun.load(folder).last_evidence == verdicts[3]


def test_a_run_lists_its_decisions_in_order(tmp_path) -> None:
    """`MeasuredRun.decisions`: the steps with a logged decision, in order, with the replica
    slots in force after it (summed over layers) and the homes it moved."""
    folder = _fake_run(tmp_path, "auto", np.linspace(5.0, 4.0, 6), 1)
    assert MeasuredRun.load(folder).decisions == []
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    rows[1] |= {"decision": "adopt", "reason": "adopt: saves", "replicas": [0, 3, 0, 2],
                "moved_homes": 0}  # fmt: skip
    rows[4] |= {"decision": "revert", "replicas": [0, 0, 0, 0], "moved_homes": 7}
    rows[5] |= {"decision": None, "replicas": [1, 1, 1, 1]}
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert MeasuredRun.load(folder).decisions == [
        {"step": 2, "decision": "adopt", "reason": "adopt: saves", "replicas": 5, "moved_homes": 0},
        {"step": 5, "decision": "revert", "reason": "", "replicas": 0, "moved_homes": 7},
    ]


def test_a_run_reads_each_steps_layout_as_the_balancer_records_it(tmp_path) -> None:
    """`MeasuredRun.layouts`: each step's `layout` as `StepStats.as_record` writes it; "" for
    a run written before it was logged."""
    from poise.runtime.stats import StepStats

    folder = _fake_run(tmp_path, "auto", np.linspace(5.0, 4.0, 3), 1)
    assert MeasuredRun.load(folder).layouts == ["", "", ""]
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r, name in zip(rows, ["static", "replicas", "probe"], strict=True):
        r |= {"layout": StepStats(step=0, policy="auto", layout=name).as_record()["layout"]}
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert MeasuredRun.load(folder).layouts == ["static", "replicas", "probe"]


def test_the_measured_summary_says_the_auto_run_s_paired_clock() -> None:
    """`paired_clock_sentence`: nothing without probes; the saving (or cost), its standard error
    and whether it is beyond `clock_z` standard errors (Student's t: 6 probes, 5 degrees of
    freedom, 2.571), in ms."""
    from poise.commands.demo_report import paired_clock_sentence

    assert paired_clock_sentence({}) == ""
    assert paired_clock_sentence({"clock_s": None, "clock_se_s": 0.0, "probes": 0}) == ""
    text = paired_clock_sentence({"clock_s": 0.0213, "clock_se_s": 0.007, "probes": 6})
    assert "6 probe steps" in text and "saved 21.3 ms" in text and "7.0 ms" in text
    assert "beyond 2.571 standard errors" in text  # 21.3 / 7.0 = 3.04
    text = paired_clock_sentence({"clock_s": 0.0213, "clock_se_s": 0.007, "probes": 4})
    assert "within 3.182 standard errors, so not conclusive" in text  # 3 degrees of freedom
    text = paired_clock_sentence({"clock_s": -0.009, "clock_se_s": 0.005, "probes": 8})
    assert "cost 9.0 ms" in text and "not conclusive" in text and "predicted" not in text
    text = paired_clock_sentence(
        {"clock_s": 0.0213, "clock_se_s": 0.007, "probes": 6, "modelled_clock_s": 0.0456}
    )
    assert "predicted +45.6 ms a step" in text


def test_sim_note_says_when_autos_plans_came_later() -> None:
    """A replay beside training where `auto`'s planning (every policy's plan priced) takes
    longer than eplb's: its plans take effect later, and the table's note says so with the
    delays the replay recorded; inline, where every plan is in force at once, it says
    nothing of delays."""
    from poise.commands.demo_report import sim_note
    from poise.sim.simulator import simulate
    from poise.trace.generate import generate

    from .helpers import toy_cluster, toy_spec

    trace = generate(
        "drift", steps=8, layers=2, devices=8, experts=8, top_k=2, tokens_per_device=512,
        seed=3, s=1.5, rate=0.15,
    )  # fmt: skip
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    # steps of nanoseconds: no plan is ready in 8 steps; the re-plans after the first skipped
    fast = toy_cluster(4, 2, bw=5e12, inter_bw=2e12, lat=1e-9, flops=1e18)
    args = (trace, fast, spec, ["static", "eplb", "auto"], "sync", 2, "ema")
    result = simulate(*args, background_planning=True)
    auto, eplb = result.runs["auto"], result.runs["eplb"]
    assert auto.skipped_replans == [2, 4, 6] and auto.plan_delays == eplb.plan_delays == []
    # as if auto's one plan had come a step later than eplb's
    auto.plan_delays[:], eplb.plan_delays[:] = [3], [2]
    for name, ms in (("static", 10.0), ("eplb", 5.0), ("auto", 8.0)):  # eplb the fastest
        result.runs[name].step_s = np.full(8, ms * 1e-3)
    note = sim_note(result)
    assert "The fastest here is eplb (5.00 ms, 2.00x): auto is 1.60x its step." in note
    assert "auto's plans took effect 3.0 steps after their request on average, eplb's 2.0" in note
    assert "3 of its 4 re-plans came while the last plan was still being made" in note
    inline = simulate(*args)
    assert inline.runs["auto"].plan_delays == [0, 0, 0, 0]
    assert "took effect" not in sim_note(inline)


def test_sim_note_says_when_the_forecast_ranked_the_winner_lower() -> None:
    """Where `auto`'s last re-plan priced the fastest rival's plan above its own choice on the
    forecast, and the rival then ran faster from the step that plan took effect, the note gives
    both prices and both realised steps; where the rival did not run faster, it says nothing."""
    from poise.commands.demo_report import forecast_miss_note, sim_note
    from poise.sim.simulator import simulate
    from poise.trace.generate import generate

    from .helpers import toy_cluster, toy_spec

    trace = generate(
        "drift", steps=8, layers=2, devices=8, experts=8, top_k=2, tokens_per_device=512,
        seed=3, s=1.5, rate=0.15,
    )  # fmt: skip
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    result = simulate(trace, cluster, spec, ["static", "eplb", "auto"], "sync", 4, "ema")
    auto, eplb = result.runs["auto"], result.runs["eplb"]
    auto.last_plan.notes["candidate_step_s"] = {"keep": 0.002, "eplb": 0.003, "static": 0.004}
    for name, ms in (("static", 10.0), ("eplb", 5.0), ("auto", 8.0)):
        result.runs[name].step_s = np.full(8, ms * 1e-3)
    note = sim_note(result)
    assert "priced its choice at 2.00 ms a step on the forecast and eplb's plan at 3.00 ms" in note
    assert "from step 4, where it took effect, the steps ran at 8.00 ms and 5.00 ms" in note
    eplb.step_s = np.full(8, 9e-3)  # the rival no faster where auto's plan ran: no such note
    assert forecast_miss_note(auto, eplb, "eplb") == ""
    auto.last_plan.notes["candidate_step_s"]["eplb"] = 0.002  # priced alike: no such note
    eplb.step_s = np.full(8, 5e-3)
    assert forecast_miss_note(auto, eplb, "eplb") == ""
