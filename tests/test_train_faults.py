"""Faults: a rank killed (SIGKILL) at a fixed step and rank (parametrised, so a failure
repeats), at the start of a step or in the middle of Agg, Trans, a migration or a checkpoint
write, restarts with `poise train --max-restarts` from the last complete checkpoint and ends with
the same parameters and the same loss curve as an uninterrupted run; ranks that disagree on the
config fail with one clear error instead of hanging.

Every run is `poise train tiny --nproc 2` (real processes on gloo), 12 steps of the `tiny`
model with context 32, re-planning every 2 steps with `auto`, a checkpoint every 3 steps, priced
on a test cluster of slow GEMMs next to fast links (`helpers.slow_gemm_cluster`), where `auto`'s
plans replicate, so that Agg and Trans run for a fault to hit (on this machine's calibration, the
`cpu-2` preset, they do not)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from poise.cli import main
from poise.runtime.launch import run_ranks
from poise.train.faults import Fault, FaultInjector

from .helpers import slow_gemm_cluster_file

pytestmark = pytest.mark.dist

STEPS = 12
TOL = 1e-5
# Steps a fault may be drawn from, per phase: Agg and Trans need replicas (planned at step 2),
# a migration needs a re-plan after the fault step, a checkpoint write one at or after it.
STEP_RANGE = {
    "step": (2, STEPS),
    "forward": (2, STEPS),
    "backward": (2, STEPS),
    "agg": (3, STEPS - 2),
    "trans": (3, STEPS - 2),
    "migrate": (1, 2),
    "checkpoint": (2, STEPS - 3),
}


def _argv(root: Path, name: str, *extra: str) -> list[str]:
    sets = {
        "context": 32,
        "batch": 8,
        "checkpoint_every": 3,
        "keep_checkpoints": 10,
        "eval_every": 0,
        "aux_loss": 0.0,
        "spare_slots": 2,
        "warmup": 3,
        "lr": 1e-3,
        "tensorboard": False,
        "progress": False,
        "cache_dir": str(root / "cache"),
        "balance_guard": False,  # every plan auto makes is adopted: faults hit real transfers
        "self_calibrate": False,
        # each plan decided at its request's step: which steps switch, and so whether a fault
        # finds replicas to hit, must not depend on how fast planning ran on a loaded machine
        "plan_lag": 0,
        "cluster": slow_gemm_cluster_file(root),  # plans with replicas (module docstring)
    }
    argv = ["train", "tiny", "--nproc", "2", "--steps", str(STEPS), "--policy", "auto"]
    argv += ["--replan-every", "2", "--out", str(root / name), "--quiet"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv + list(extra)


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


def _final_tensors(run: Path) -> dict:
    from poise.train.checkpoint import read_file

    ckpt = read_file(run / "checkpoints" / f"step-{STEPS:08d}")
    flat = {f"dense.{k}": v for k, v in ckpt["model"]["dense"].items()}
    for layer, ws in ckpt["model"]["experts"].items():
        flat.update({f"{layer}.{k}": v for k, v in ws.items()})
    for name, moments in ckpt["optimizer"]["experts"].items():
        flat.update(
            {f"opt.{name}.{k}": v for k, v in moments.items() if k in ("exp_avg", "exp_avg_sq")}
        )
    return flat


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    assert main(_argv(root, "reference")) == 0
    return root


# Fixed cases (a failure repeats): every phase, both ranks, the ends of each step range. The
# default run has one case per kind of kill point (the loop, inside a collective, a migration,
# a checkpoint write); the other cases are marked slow (`-m slow` runs them).
KILL_CASES = [
    pytest.param("forward", STEP_RANGE["forward"][0], 1, id="forward-first-rank1"),
    pytest.param("agg", STEP_RANGE["agg"][1], 0, id="agg-last-rank0"),
    pytest.param("trans", STEP_RANGE["trans"][0], 1, id="trans-first-rank1"),
    pytest.param("migrate", STEP_RANGE["migrate"][1], 0, id="migrate-last-rank0"),
    pytest.param("checkpoint", STEP_RANGE["checkpoint"][0], 0, id="checkpoint-first-rank0"),
    pytest.param("step", STEP_RANGE["step"][1], 0, id="step-last-rank0", marks=pytest.mark.slow),
    pytest.param(
        "backward", STEP_RANGE["backward"][0] + 1, 1, id="backward-rank1", marks=pytest.mark.slow
    ),
    pytest.param(
        "checkpoint",
        STEP_RANGE["checkpoint"][1],
        1,
        id="checkpoint-last-rank1",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "migrate", STEP_RANGE["migrate"][0], 1, id="migrate-first-rank1", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("phase", "step", "rank"), KILL_CASES)
def test_killed_rank_restarts_to_the_same_model(
    reference: Path, phase: str, step: int, rank: int, capsys
) -> None:
    low, high = STEP_RANGE[phase]
    assert low <= step <= high
    name = f"killed-{phase}-{step}-{rank}"
    fault = ["--fail-at-step", str(step), "--fail-rank", str(rank), "--fail-phase", phase]
    code = main(_argv(reference, name, "--max-restarts", "1", *fault))
    err = capsys.readouterr().err
    where = f"{phase} at step {step} on rank {rank}"
    assert code == 0, where
    assert "restart 1/1" in err, f"the fault ({where}) never fired: {err}"
    run = reference / name
    np.testing.assert_allclose(_losses(run), _losses(reference / "reference"), atol=TOL)
    final, want = _final_tensors(run), _final_tensors(reference / "reference")
    assert final.keys() == want.keys()
    for key in want:
        assert float((final[key] - want[key]).abs().max()) <= TOL, (where, key)


def test_the_reference_decides_each_plan_at_its_request_step(reference: Path) -> None:
    """`plan_lag: 0` reaches the Balancer: plans are requested every 2 steps and each is
    decided at once (with the default lag of 1 or more, at odd steps), so the steps that switch
    are the same on any machine."""
    lines = (reference / "reference" / "metrics.jsonl").read_text().splitlines()
    decided = [r["step"] for r in map(json.loads, lines) if r["replanned"]]
    assert decided == list(range(2, STEPS, 2))


def test_without_restarts_the_failure_is_reported(reference: Path, capsys) -> None:
    code = main(_argv(reference, "no-restart", "--fail-at-step", "2", "--fail-rank", "1"))
    assert code == 128 + 9  # SIGKILL, as a shell reports it
    assert "restart" not in capsys.readouterr().err


def _disagree(rank: int, world: int, root: str) -> str:
    from poise.core.errors import ConfigError
    from poise.train import TrainConfig, train

    cfg = TrainConfig(
        model="tiny",
        context=32,
        batch=4,
        steps=1,
        eval_every=0,
        checkpoint_every=0,
        tensorboard=False,
        progress=False,
        cache_dir=f"{root}/cache",
        out=f"{root}/disagree",
        lr=1e-3 if rank == 0 else 2e-3,
    )
    try:
        train(cfg, quiet=True)
    except ConfigError as exc:
        return exc.one_line()
    return "no error"


def test_ranks_that_disagree_on_the_config_fail_clearly(tmp_path: Path) -> None:
    got = run_ranks(_disagree, 2, str(tmp_path), timeout_s=120)
    assert "differs from rank(s) [1]" in got[0]
    assert "differs from rank(s) [0]" in got[1]


def test_fault_settings_are_checked() -> None:
    from poise.core.errors import ConfigError

    with pytest.raises(ConfigError, match="POISE_FAIL_PHASE"):
        Fault(3, 0, "lunch")
    with pytest.raises(ConfigError, match="POISE_FAIL_AT_STEP"):
        Fault.from_env({"POISE_FAIL_AT_STEP": "x"})
    assert Fault.from_env({}) is None
    assert Fault.from_env(Fault(4, 1, "agg").env()) == Fault(4, 1, "agg")


def test_injector_fires_once_on_its_rank_in_the_first_attempt(monkeypatch) -> None:
    fired: list[int] = []
    monkeypatch.delenv("POISE_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    inj = FaultInjector(Fault(3, 1, "backward"), rank=1, kill=lambda: fired.append(inj.step))
    for step in range(1, 6):
        inj.at(step, "step")
        inj.at(step, "backward")
    assert fired[0] == 3  # the real kill never returns; this stand-in does, so it fires again
    other = FaultInjector(Fault(3, 1, "backward"), rank=0, kill=lambda: fired.append(-1))
    other.at(3, "backward")
    monkeypatch.setenv("POISE_RESTART_COUNT", "1")
    again = FaultInjector(Fault(3, 1, "backward"), rank=1, kill=lambda: fired.append(-2))
    again.at(3, "backward")
    assert -1 not in fired and -2 not in fired


def test_ctrl_c_ends_every_rank_with_one_line_each(tmp_path) -> None:
    """A Ctrl-C at the terminal (SIGINT to the whole process group) ends `poise train --nproc
    2` with status 130 within seconds: the launcher, its ranks (forked from the fork server) and
    the leader's planner worker are all gone, and standard error holds one `interrupted` line
    per process that answered, no traceback (the worker leaves the interruption to its rank)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    argv = _argv(tmp_path, "run")
    argv[argv.index("--steps") + 1] = "100000"  # runs until interrupted
    argv.remove("--quiet")

    def default_sigint() -> None:  # a background job may have inherited SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "poise.cli", *argv],
        start_new_session=True,
        preexec_fn=default_sigint,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "training never stepped"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "interrupted" in err
    time.sleep(0.5)
    group = subprocess.run(
        ["ps", "-o", "pid=,stat=", "-g", str(proc.pid)], capture_output=True, text=True
    ).stdout
    alive = [row for row in group.splitlines() if row.split() and row.split()[1][0] != "Z"]
    assert not alive, group  # (a zombie is an ended process its parent has not reaped)
