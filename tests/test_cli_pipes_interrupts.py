"""Pipes and interrupts: a reader of the console output that closes early (`poise simulate ... |
head -1`) loses none of the files and sees status 0 and no traceback; a Ctrl-C during `poise
demo` leaves the previous output folder as it was (the demo builds in a fresh folder and
publishes it whole) and no turns file behind; a turns file whose other run never starts ends in
one line within its start-up timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poise.cli import main
from poise.trace.generate import generate
from poise.train import turns as turns_mod
from poise.train.turns import StepTurns, TurnsError

from .helpers import tiny_train_config


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("pipes")
    t = generate("zipf", steps=4, layers=1, devices=4, experts=8, tokens_per_device=64)
    t.meta["model"] = "tiny"
    t.save(d / "t.npz")
    return str(d / "t.npz")


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("when", ["closed at once", "after one line"])
@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_a_reader_that_closes_early_loses_no_file(
    trace: str, tmp_path: Path, command: str, when: str
) -> None:
    if command == "simulate":
        argv = ["simulate", trace, "--policies", "static,eplb", "--out", str(tmp_path / "sim")]
        results = tmp_path / "sim" / "summary.json"
    else:
        argv = ["plan", trace, "--policy", "eplb", "--out", str(tmp_path / "plan.json")]
        results = tmp_path / "plan.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "poise", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**_env(), "COLUMNS": "100"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    if when == "after one line":
        proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert results.is_file() and results.stat().st_size > 0


def test_ctrl_c_during_the_demo_leaves_the_previous_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import poise.commands.demo as demo

    out = tmp_path / "demo"
    (out / "train-static").mkdir(parents=True)
    old = {
        "demo.json": '{"old": true}\n',
        "report.html": "<html>old</html>\n",
        "train-static/metrics.jsonl": '{"step": 1, "loss": 5.0}\n',
    }
    for name, text in old.items():
        (out / name).write_text(text)
    built: list[Path] = []

    def interrupted(cfgs, console, turns, clock):  # the runs start writing, then Ctrl-C
        built.append(turns.parent)
        turns.write_bytes(b"\0" * 16)
        for cfg in cfgs:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            (Path(cfg.out) / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "train_in_turns", interrupted)
    assert main(["demo", "--quick", "--steps", "4", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    (build,) = built
    assert build != out and build.parent == out.parent and not build.exists()
    got = {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()}
    assert got == old  # nothing overwritten, nothing added (no turns file)
    assert not list(tmp_path.glob(".demo.tmp-*"))


def test_a_lone_turns_file_ends_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(turns_mod, "NOTE_AFTER_S", 0.1)
    path = tmp_path / "pair.turns"
    turns = StepTurns.open(path, 0, 2, rank=0, timeout_s=600, start_timeout_s=0.6)
    started = time.perf_counter()
    with pytest.raises(TurnsError) as err:
        turns.arrive()
    assert time.perf_counter() - started < 5
    text = str(err.value)
    assert "\n" not in text and str(path) in text and "1 of 2 runs" in text
    note = capsys.readouterr().err.splitlines()
    assert len(note) == 1 and "waits for 1 other run(s)" in note[0] and str(path) in note[0]


def test_train_with_a_lone_turns_file_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`poise train` in one process with `turns` set and no partner: one line, exit 2."""
    from poise.train.config import save_config

    monkeypatch.setattr(turns_mod, "START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(turns_mod, "NOTE_AFTER_S", 100.0)
    cfg = tiny_train_config(str(tmp_path), "run", steps=2, turns=str(tmp_path / "lone.turns"))
    save_config(cfg, tmp_path / "c.yaml")
    code = main(["train", str(tmp_path / "c.yaml"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("poise: error: ") and "lone.turns" in err[0], err
