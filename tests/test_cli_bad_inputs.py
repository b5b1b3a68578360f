"""Bad input to every command: exit status 2, one line on stderr naming the file or field, no
traceback, within seconds. One case per kind of failure and command (output paths, values,
sizes, content), then a hypothesis fuzz of command-line arguments, then a few cases end to end
in a subprocess (no traceback reaches the terminal)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.cli import main
from poise.sim.scenarios import SCENARIOS
from poise.trace.generate import generate
from poise.trace.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 10.0  # each bad input is refused within this (imports included, on a busy machine)
UNWRITABLE = "/proc/poise-no-such/out"  # no file can be created under /proc, even by root


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A valid small trace, an all-zero one, one of Python objects, a plain file, folders."""
    d = tmp_path_factory.mktemp("bad-inputs")
    trace = generate("zipf", steps=4, layers=1, devices=4, experts=8, tokens_per_device=64)
    trace.meta["model"] = "tiny"
    trace.save(d / "t.npz")
    zero = Trace(np.zeros((3, 1, 4, 8), dtype=np.int64), np.arange(3), 2, 64, "zero")
    zero.save(d / "zero.npz")
    np.savez(d / "obj.npz", counts=np.array([{"a": 1}], dtype=object))
    (d / "weights.json").write_text(json.dumps([[1] * 64] * 64))
    (d / "afile").write_text("not a folder\n")
    for folder in ("adir", "dir.npz", "dir.yaml", "empty"):
        (d / folder).mkdir()
    return {
        "T": str(d / "t.npz"),
        "ZERO": str(d / "zero.npz"),
        "OBJ": str(d / "obj.npz"),
        "W": str(d / "weights.json"),
        "FILE": str(d / "afile"),
        "DIR": str(d / "adir"),
        "DIRNPZ": str(d / "dir.npz"),
        "DIRYAML": str(d / "dir.yaml"),
        "EMPTY": str(d / "empty"),
        "OUT": str(d / "out"),
        "NO": UNWRITABLE,
    }


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run each case in a scratch folder: a default output (plan.json) never lands in the repo."""
    monkeypatch.chdir(tmp_path)


SCENARIO = next(iter(SCENARIOS))
HUGE_GENERATE = ["trace", "generate", "zipf", "OUT/o.npz", "--steps", "1000000", "--layers", "1000"]
# (argv with placeholders, text the error line must hold). Placeholders: see `files`.
CASES: dict[str, list[tuple[list[str], str]]] = {
    "output paths": [
        (["plan", "T", "--out", "DIR"], "--out"),
        (["plan", "T", "--out", "NO/p.json"], "--out"),
        (["plan", "T", "--out", "FILE/p.json"], "--out"),
        (["plan", "T", "--out", "OUT/p.json", "--eplb", "FILE"], "--eplb"),
        (["plan", "T", "--out", "OUT/p.json", "--eplb", "NO"], "--eplb"),
        (["trace", "convert", "W", "DIRNPZ"], "dst"),
        (["trace", "convert", "W", "NO/o.npz"], "dst"),
        (["trace", "generate", "zipf", "FILE/o.npz"], "out"),
        (["trace", "generate", "zipf", "DIRNPZ"], "out"),
        (["layouts", "T", "--json", "DIR"], "--json"),
        (["layouts", "T", "--json", "FILE/x.json"], "--json"),
        (["scenarios", "--only", SCENARIO, "--out", "FILE"], "--out"),
        (["scenarios", "--only", SCENARIO, "--out", "NO"], "--out"),
        (["train", "tiny", "--out", "FILE"], "--out"),
        (["train", "tiny", "--out", "NO"], "--out"),
        (["calibrate", "--quick", "--out", "DIRYAML"], "--out"),
        (["calibrate", "--quick", "--out", "NO/c.yaml"], "--out"),
        (["simulate", "T", "--out", "FILE"], "--out"),
        (["simulate", "T", "--out", "NO"], "--out"),
        (["demo", "--out", "FILE"], "--out"),
    ],
    "values": [
        (["plan", "T", "--out", "OUT/p.json", "--option", "vexpert.threshold=abc"], "threshold"),
        (["plan", "T", "--out", "OUT/p.json", "--option", "vexpert.treshold=1"], "max_moves"),
        (["plan", "T", "--out", "OUT/p.json", "--option", "nope.x=1"], "nope"),
        (["plan", "T", "--out", "OUT/p.json", "--option", "novalue"], "--option"),
        (["plan", "T", "--out", "OUT/p.json", "--option", "static.x=1"], "no options"),
        (["simulate", "T", "--out", "OUT", "--option", "auto.prune=maybe"], "auto.prune"),
        (["plan", "T", "--steps", "0"], "--steps"),
        (["plan", "T", "--steps", "-2"], "--steps"),
        (["plan", "T", "--slots", "x"], "--slots"),
        (["simulate", "T", "--seed", "-1"], "--seed"),
        (["simulate", "T", "--replan-every", "0"], "--replan-every"),
        (["simulate", "T", "--policies", "static,nope"], "nope"),
        (["simulate", "T", "--dense-params", "-5"], "--dense-params"),
        (["layouts", "T", "--pool", "0"], "--pool"),
        (["trace", "generate", "zipf", "OUT/o.npz", "--experts", "0"], "--experts"),
        (["trace", "generate", "zipf", "OUT/o.npz", "--top-k", "x"], "--top-k"),
        (["trace", "generate", "zipf", "OUT/o.npz", "--seed", "-1"], "--seed"),
        (["trace", "stats", "T", "--layout-devices", "0"], "--layout-devices"),
        (["train", "tiny", "--nproc", "0"], "--nproc"),
        (["calibrate", "--threads", "-1"], "--threads"),
        (["demo", "--steps", "1"], "--steps"),
        (["plan", "T", "--no-such-flag"], "--no-such-flag"),
    ],
    "sizes": [
        ([*HUGE_GENERATE, "--devices", "1000", "--experts", "1000"], "memory"),
        (["simulate", "T", "--out", "OUT", "--cluster", "dgx-h100:100000"], "devices"),
        (["simulate", "T", "--out", "OUT", "--slots", "1000000"], "--slots"),
        (["plan", "T", "--out", "OUT/p.json", "--cluster", "dgx-h100:100000"], "devices"),
        (["trace", "convert", "W", "OUT/o.npz", "--devices", "10000000000"], "memory"),
    ],
    "content": [
        (["trace", "stats", "ZERO"], "zero"),
        (["simulate", "ZERO", "--out", "OUT"], "zero"),
        (["plan", "ZERO", "--out", "OUT/p.json"], "zero"),
        (["layouts", "ZERO"], "zero"),
        (["trace", "stats", "OBJ"], "obj.npz"),
        (["scenarios", "--only", SCENARIO, "--data", "EMPTY", "--out", "OUT"], "--data"),
        (["demo", "--data", "EMPTY", "--out", "OUT"], "--data"),
    ],
}
PARAMS = [
    pytest.param(argv, needle, id=f"{kind}: {' '.join(argv)}"[:90])
    for kind, cases in CASES.items()
    for argv, needle in cases
]


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    out = []
    for arg in argv:
        head, sep, tail = arg.partition("/")
        out.append(files[head] + sep + tail if head in files else arg)
    return out


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("poise: error: "), err
    assert "Traceback" not in err
    assert "allow_pickle" not in err  # never advise loading a file unsafely
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(("argv", "needle"), PARAMS)
def test_bad_input_is_one_line(files: dict[str, str], argv: list[str], needle: str) -> None:
    started = time.perf_counter()
    code, _, err = run_cli(_fill(argv, files))
    assert_one_line_error(code, err, needle)
    assert time.perf_counter() - started < SECONDS, err


def test_unknown_option_key_lists_the_policys_keys(files: dict[str, str]) -> None:
    code, _, err = run_cli(_fill(["plan", "T", "--option", "eplb.grups=2"], files))
    assert_one_line_error(code, err, "eplb.grups", "groups, mode, routing")


def test_out_of_range_error_says_what_is_allowed(files: dict[str, str]) -> None:
    code, _, err = run_cli(_fill(["plan", "T", "--steps", "0"], files))
    assert_one_line_error(code, err, "must be an integer >= 1, got 0")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["tiny", "--steps", "0"], "must be an integer >= 1, got 0"),
        (["tiny", "--seed", "-1"], "--seed"),
        (["tiny", "--replan-every", "x"], "--replan-every"),
        (["tiny", "--no-such-flag"], "--no-such-flag"),
        ([], "CONFIG"),
    ],
)
def test_train_module_bad_input_is_one_line(argv: list[str], needle: str) -> None:
    """`python -m poise.train` (each rank's entry point) refuses bad flags as `poise` does."""
    from poise.train.__main__ import main as train_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = train_main(argv)
        except SystemExit as exc:
            code = exc.code
    assert_one_line_error(code, err.getvalue(), needle)


def test_size_error_states_the_estimate(files: dict[str, str]) -> None:
    argv = ["trace", "generate", "zipf", "OUT/o.npz", "--steps", "1000000", "--layers", "1000"]
    code, _, err = run_cli(_fill([*argv, "--devices", "1000", "--experts", "1000"], files))
    assert_one_line_error(code, err, "PiB", "available")
    assert not Path(files["OUT"], "o.npz").exists()


def test_output_checked_before_any_work(files: dict[str, str], monkeypatch) -> None:
    """plan, simulate and layouts refuse a bad output path before reading the trace."""
    import poise.trace.importers as importers

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was read before the output path was checked")

    monkeypatch.setattr(importers, "load_any", never)
    for argv in (
        ["plan", "T", "--out", "DIR"],
        ["simulate", "T", "--out", "FILE"],
        ["layouts", "T", "--json", "DIR"],
        ["trace", "convert", "T", "DIRNPZ"],
    ):
        code, _, err = run_cli(_fill(argv, files))
        assert_one_line_error(code, err)


# --------------------------------------------------------------------------- fuzz

VALUES = st.sampled_from(
    ["0", "-1", "1", "2", "abc", "", "1e309", "nan", "-0", str(2**70), "3.5", " 4"]
)
PATHS = st.sampled_from(["T", "ZERO", "OBJ", "W", "FILE", "DIR", "EMPTY", "NO/x", "missing"])
OUTS = st.sampled_from(["OUT/o.npz", "OUT/p.json", "FILE/x.npz", "DIRNPZ", "NO/x.npz", "x.txt"])
FLAGS = {
    "plan": ["--steps", "--slots", "--policy", "--cluster", "--option", "--schedule"],
    "trace stats": ["--layout-devices", "--top-k", "--tokens-per-device", "--devices"],
    "trace generate": ["--steps", "--layers", "--devices", "--experts", "--top-k", "--seed"],
    "trace convert": ["--devices", "--top-k", "--tokens-per-device", "--format"],
}
SPECIAL = {
    "--policy": st.sampled_from(["static", "auto", "nope", ""]),
    "--cluster": st.sampled_from(["cpu-2", "dgx-h100:0", "nowhere", "dgx-h100:100000"]),
    "--option": st.sampled_from(["vexpert.threshold=x", "a.b=1", "x", "permute.window=0"]),
    "--schedule": st.sampled_from(["sync", "pipelined(0)", "hybrid", "nope"]),
    "--format": st.sampled_from(["auto", "eplb", "npz", "nope"]),
}


@st.composite
def cli_args(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(sorted(FLAGS)))
    argv = command.split()
    if command == "trace generate":
        argv += [draw(st.sampled_from(["zipf", "uniform", "nope"])), draw(OUTS)]
    elif command == "trace convert":
        argv += [draw(PATHS), draw(OUTS)]
    else:
        argv.append(draw(PATHS))
    if command == "plan":
        argv += ["--out", draw(OUTS)]
    for flag in draw(st.lists(st.sampled_from(FLAGS[command]), max_size=3, unique=True)):
        argv += [flag, draw(SPECIAL.get(flag, VALUES))]
    return argv


@settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(argv=cli_args())
def test_cli_args_fuzz(files: dict[str, str], argv: list[str]) -> None:
    """Random flags and values: exit status 0, or 2 with one line naming what was wrong."""
    filled = _fill(argv, files)
    started = time.perf_counter()
    code, _, err = run_cli(filled)
    assert code in (0, 2), (filled, err)
    if code == 2:
        assert_one_line_error(code, err)
    assert time.perf_counter() - started < SECONDS, filled


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "T", "--steps", "0"],
        ["trace", "generate", "zipf", "OUT/big.npz", "--steps", "1000000", "--layers", "1000"],
        ["simulate", "ZERO", "--out", "OUT"],
    ],
    ids=["argparse", "size", "content"],
)
def test_no_traceback_end_to_end(files: dict[str, str], argv: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "poise.cli", *_fill(argv, files)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert_one_line_error(proc.returncode, proc.stderr)


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "generate", "zipf", "OUT/small.npz", "--steps", "50"],
        ["simulate", "T", "--out", "OUT", "--policies", "static"],
        ["trace", "convert", "W", "OUT/w.npz", "--devices", "64"],
    ],
    ids=["generate", "simulate", "convert"],
)
def test_memory_estimate_is_checked_against_what_is_available(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """On a machine with 1 KiB available, even modest requests are refused up front, with the
    estimate (a broken estimate would run them, or take forever on the huge ones)."""
    import poise.core.budget as budget

    monkeypatch.setattr(budget, "available_memory_bytes", lambda: float(2**10))
    code, _, err = run_cli(_fill(argv, files))
    assert_one_line_error(code, err, "needs about", "1.0 KiB")
