"""A first run says what it did and does not mislead: on each shipped data set, with the model a
trace recorded, with a trace shorter than the re-plan interval, on a narrow terminal, in
`--help`, and in the first seconds of `poise train`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from poise.cli import build_parser, main
from poise.trace.generate import generate
from poise.trace.stats import trace_stats
from poise.trace.trace import Trace


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _squeeze(text: str) -> str:
    """`text` without whitespace: rich wraps long lines (paths) at any width."""
    return "".join(text.split())


def _datasets(shared_data: Path) -> dict[str, Path]:
    return {
        "smartmoe": shared_data / "smartmoe-ae-sample",
        "olmoe": shared_data / "olmoe-expert-counts" / "expert_counts.json",
    }


@pytest.mark.parametrize("name", ["smartmoe", "olmoe"])
def test_first_simulate_on_each_shipped_data_set_says_what_it_did(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal: the table folds, nothing is cut
    data = _datasets(shared_data)[name]
    out = tmp_path / "sim"
    code, stdout, stderr = run_cli(
        ["simulate", str(data), "--policies", "static,auto", "--out", str(out)]
    )
    assert code == 0, stderr
    assert "simulating" in stderr and "policies" in stderr  # what it is about to do
    assert "fastest:" in stdout and "ms/step" in stdout  # the headline, whole, below the table
    assert "…" not in stdout  # no number cut short
    assert f"wrote{out}/summary.json" in _squeeze(stderr)  # rich may wrap the path
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["replan_every"] < steps  # the short trace is re-planned at least once
    if steps < 20:
        assert "re-planning every" in stderr  # and the output says why the interval changed
    speedups = [p["speedup_vs_static"] for p in summary["policies"] if p["policy"] == "auto"]
    assert speedups and speedups[0] != pytest.approx(1.0)  # re-planning changed something


@pytest.mark.parametrize("name", ["smartmoe", "olmoe"])
def test_first_stats_and_plan_on_each_shipped_data_set(
    shared_data: Path, tmp_path: Path, name: str
) -> None:
    data = _datasets(shared_data)[name]
    code, stdout, stderr = run_cli(["trace", "stats", str(data)])
    assert code == 0, stderr
    assert "steps x" in stdout and "drift" in stdout
    plan = tmp_path / "plan.json"
    code, stdout, stderr = run_cli(["plan", str(data), "--out", str(plan), "--policy", "eplb"])
    assert code == 0, stderr
    assert "predictedsteptime" in _squeeze(stdout) and f"writtento{plan}" in _squeeze(stdout)


@pytest.mark.parametrize("width", ["60", "40"])
def test_stats_table_folds_on_a_narrow_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: str
) -> None:
    path = tmp_path / "t.npz"
    generate("zipf", steps=4, layers=2, devices=64, experts=8, tokens_per_device=64).save(path)
    monkeypatch.setenv("COLUMNS", width)
    code, stdout, err = run_cli(["trace", "stats", str(path)])
    assert code == 0, err
    assert "…" not in stdout and "Gini" in _squeeze(stdout)  # folded, never cut


def test_stats_drift_uses_the_recorded_iterations() -> None:
    """Rows of iterations 1, 1001 and 5001 are not 1 iteration apart: no lag-1 drift; the
    consecutive rows are reported with their real gap."""
    base = generate("drift", steps=3, layers=1, devices=2, experts=8, tokens_per_device=64)
    sparse = Trace(base.counts, np.array([1, 1001, 5001]), base.top_k, 64, "sparse")
    stats = trace_stats(sparse)
    assert stats["drift"][1] is None and stats["drift"][10] is None
    assert stats["drift_consecutive"]["gap_min"] == 1000
    assert stats["drift_consecutive"]["gap_max"] == 4000
    dense = trace_stats(base)
    assert dense["drift"][1] is not None  # contiguous ids: lag 1 is the neighbouring rows


def test_trace_model_is_used_by_default_and_a_mismatch_warned(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    argv = ["trace", "generate", "zipf", str(path), "--steps", "4", "--layers", "1"]
    code, _, err = run_cli([*argv, "--devices", "2", "--experts", "8", "--model", "tiny"])
    assert code == 0, err
    assert Trace.load(path).meta["model"] == "tiny"
    plan = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", str(path), "--out", str(plan), "--policy", "static"])
    assert code == 0, err
    assert json.loads(plan.read_text())["model"] == "tiny"
    assert "warning" not in err
    code, _, err = run_cli(
        ["plan", str(path), "--out", str(plan), "--policy", "static", "--model", "zipf-256"]
    )
    assert "warning" in err and "'tiny'" in err  # recorded tiny, priced as another model


def test_trace_cluster_is_used_by_default_and_a_mismatch_warned(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    argv = ["trace", "generate", "zipf", str(path), "--steps", "4", "--layers", "1"]
    code, _, err = run_cli([*argv, "--experts", "8", "--cluster", "cpu-2"])
    assert code == 0, err
    trace = Trace.load(path)
    assert trace.meta["cluster"] == "cpu-2" and trace.devices == 2  # the cluster's devices
    code, _, err = run_cli([*argv, "--experts", "8", "--cluster", "cpu-2", "--devices", "4"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--devices" in err
    plan = tmp_path / "plan.json"
    base = ["plan", str(path), "--out", str(plan), "--policy", "static"]
    code, _, err = run_cli(base)
    assert code == 0, err
    assert json.loads(plan.read_text())["cluster"] == "cpu-2"  # recorded cluster by default
    assert "note" in err and "'cpu-2'" in err and "warning" not in err  # and it says so
    sim = ["simulate", str(path), "--policies", "static", "--out", str(tmp_path / "sim")]
    code, _, err = run_cli(sim)
    assert code == 0, err
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["cluster"] == "cpu-2"
    layouts = ["layouts", str(path), "--json", str(tmp_path / "l.json")]
    code, _, err = run_cli(layouts)
    assert code == 0, err
    assert json.loads((tmp_path / "l.json").read_text())["cluster"] == "cpu-2"
    code, _, err = run_cli([*base, "--cluster", "cpu-2:1"])  # the same cluster, spelt otherwise
    assert code == 0 and "warning" not in err, err
    for cmd in (base, sim, layouts):
        code, _, err = run_cli([*cmd, "--cluster", "v100-ib50"])
        assert code == 0, err
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == 1 and "'cpu-2'" in warnings[0], err  # one line, naming both
        assert "v100-ib50" in warnings[0]
    assert json.loads(plan.read_text())["cluster"] == "v100-ib50"


def test_a_recorded_cluster_that_is_no_preset_is_noted(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    trace = generate("zipf", steps=3, layers=1, devices=2, experts=8, tokens_per_device=64)
    trace.meta["cluster"] = "cpu-3"  # `poise train` on 3 ranks without a cluster config
    trace.save(path)
    plan = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", str(path), "--out", str(plan), "--policy", "static"])
    assert code == 0, err
    assert "'cpu-3'" in err and "not a Poise cluster preset" in err
    assert json.loads(plan.read_text())["cluster"] == "v100-ib50"


def test_a_large_conversion_is_announced_and_a_small_one_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import poise.commands.trace as trace_cmd

    src = tmp_path / "weights.json"
    src.write_text(json.dumps([[1] * 64] * 16))  # EPLB weights: 16 layers x 64 experts
    argv = ["trace", "convert", str(src), str(tmp_path / "w.npz"), "--devices", "4"]
    code, _, err = run_cli(argv)
    assert code == 0 and err == "", err  # small: nothing but the result on stdout
    monkeypatch.setattr(trace_cmd, "LONG_BYTES", 2**10)  # as if 1 KiB were large
    code, _, err = run_cli(argv)
    assert code == 0, err
    lines = err.splitlines()
    assert len(lines) == 2 and all("this takes a while" in line for line in lines), err
    assert "converting" in lines[0] and "KiB to read" in lines[0]  # reading, with its size
    assert "writing 4,096 counts" in lines[1]  # and the write, announced before it starts


def test_explicit_replan_interval_longer_than_the_trace_is_warned(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    generate("zipf", steps=3, layers=1, devices=4, experts=8, tokens_per_device=64).save(path)
    argv = ["simulate", str(path), "--policies", "static", "--replan-every", "10"]
    code, _, err = run_cli([*argv, "--out", str(tmp_path / "o")])
    assert code == 0, err
    assert "--replan-every10>=the3steps" in _squeeze(err)


def _parsers(parser: argparse.ArgumentParser, name: str = "poise"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_help_describes_every_command_and_option() -> None:
    for name, parser in _parsers(build_parser()):
        assert parser.description, f"{name} has no description"
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
            flags = argparse._StoreTrueAction | argparse._VersionAction
            if action.option_strings and not isinstance(
                action, flags | argparse.BooleanOptionalAction
            ):
                shown = parser._get_formatter()._get_help_string(action)
                assert "default" in shown.lower(), (name, action.option_strings)
        assert "usage" in text
    plan = dict(_parsers(build_parser()))["poise plan"].format_help()
    assert "hybrid" in " ".join(plan.split())


def test_train_says_what_starts_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import poise.train.loop as loop

    said: list[str] = []

    def fake_train(cfg, *, resume=None, quiet=False):  # the work itself is not under test
        said.append(sys.stderr.getvalue())  # what was on stderr before any work
        return None

    monkeypatch.setattr(loop, "train", fake_train)
    code, _, err = run_cli(["train", "tiny", "--out", str(tmp_path / "run"), "--steps", "3"])
    assert code == 0, err
    assert said and "poise train: model tiny" in said[0] and "3 steps" in said[0]


def test_written_config_says_tensorboard_only_when_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from poise.train import train

    from .helpers import tiny_train_config

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    cfg = tiny_train_config(str(tmp_path), "run", steps=1, tensorboard=True, batch=2)
    train(cfg, quiet=True)
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["tensorboard"] is False
    assert not (tmp_path / "run" / "tb").exists()
    trace = Trace.load(tmp_path / "run" / "trace.npz")  # and the trace names its model
    assert trace.meta["model"] == "tiny"
    # and the cluster it planned on: no `cluster` config, the modelled one of its 1 CPU rank
    assert trace.meta["cluster"] == "cpu-1"
    assert trace.meta["world_size"] == 1 and trace.meta["device_type"] == "cpu"
