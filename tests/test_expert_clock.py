"""The expert clock in turns (`poise.commands.expert_clock`): it times its sweeps only in its own
turns, as often as asked, and its slope recovers a known per-row cost."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

import poise.commands.expert_clock as clock_mod
from poise.commands.expert_clock import expert_seconds_in_turns
from poise.commands.train import in_turns
from poise.core.errors import ConfigError
from poise.train.turns import StepTurns, TurnsError

ROW_S = 20e-6  # the fake workload's seconds per row


def _sleeping_workload(spans: list[tuple[float, float]], threads: list[int] | None = None):
    """A workload of known cost: run(n) sleeps 0.5 ms + n x ROW_S and records its span (and the
    thread count it ran at in `threads`)."""

    def workload(d_model, d_expert, slots, *, activation="swiglu", rows=()):
        def run(n: int) -> None:
            if threads is not None:
                threads.append(torch.get_num_threads())
            t0 = time.perf_counter()
            time.sleep(5e-4 + n * ROW_S)
            spans.append((t0, time.perf_counter()))

        return run

    return workload


def _stepping_run(turns: Path, steps: int, spans: list[tuple[float, float]], step_s: float):
    """A run of one rank that takes `steps` steps of `step_s` in its turns (no process group)."""

    def run(cfg) -> str:
        turn = StepTurns.open(turns, cfg.turns_slot, cfg.turns_of, 0, None, timeout_s=60)
        try:
            turn.arrive()
            for step in range(steps):
                turn.wait(step)
                t0 = time.perf_counter()
                time.sleep(step_s)
                spans.append((t0, time.perf_counter()))
                turn.hand_over(step)
            turn.finish(steps)
        finally:
            turn.close()
        return cfg.policy

    return run


def test_the_clock_times_only_in_its_own_turns(monkeypatch, tmp_path) -> None:
    from poise.train.config import TrainConfig

    timed: list[tuple[float, float]] = []
    stepped: list[tuple[float, float]] = []
    ran_at: list[int] = []
    monkeypatch.setattr(clock_mod, "expert_workload", _sleeping_workload(timed, ran_at))
    steps, skip, every = 23, 3, 4
    turns = tmp_path / "runs.turns"
    cfgs = [TrainConfig(policy=p, steps=steps, out=str(tmp_path / p)) for p in ("static", "auto")]

    def clock(turn_file, slot, slots):
        return expert_seconds_in_turns(
            turn_file, slot, slots, steps=steps, d_model=8, d_expert=8, experts_per_rank=2,
            skip=skip, every=every, rows=(200, 800), threads=3,
        )  # fmt: skip

    threads = torch.get_num_threads()
    run = _stepping_run(turns, steps, stepped, 0.01)
    *names, result = in_turns(cfgs, turns, run, [partial(clock, turns)])
    assert names == ["static", "auto"]
    sweeps = len(range(skip, steps, every))  # steps 3, 7, 11, 15, 19
    assert result["sweeps"] == sweeps == 5 and len(result["c_sweeps_s"]) == sweeps
    assert len(timed) == 2 * sweeps + 2 * clock_mod.WARMUP_SWEEPS
    assert len(stepped) == 2 * steps
    first_step = min(t0 for t0, _ in stepped)
    for t0, t1 in timed[2 * clock_mod.WARMUP_SWEEPS :]:  # no timed sweep overlaps a run's step
        assert t0 >= first_step
        assert all(t1 <= s0 or t0 >= s1 for s0, s1 in stepped)
    # the slope recovers the per-row cost; the fixed 0.5 ms goes to the intercept
    assert result["c_s"] == pytest.approx(ROW_S, rel=0.15)
    assert result["intercept_s"] == pytest.approx(5e-4, abs=4e-4)
    assert set(ran_at) == {3} and torch.get_num_threads() == threads  # the rank's, restored


def test_a_failing_clock_stops_the_runs(monkeypatch, tmp_path) -> None:
    """A clock that fails marks the turn file abandoned: the runs raise instead of waiting."""
    from poise.train.config import TrainConfig

    def broken(*a, **k):
        def run(n: int) -> None:
            if broken.calls >= 3:
                raise RuntimeError("the experts broke")
            broken.calls += 1

        return run

    broken.calls = 0
    monkeypatch.setattr(clock_mod, "expert_workload", broken)
    turns = tmp_path / "runs.turns"
    cfgs = [TrainConfig(policy="static", steps=10, out=str(tmp_path / "s"))]

    def clock(turn_file, slot, slots):
        return expert_seconds_in_turns(
            turn_file, slot, slots, steps=10, d_model=8, d_expert=8, experts_per_rank=2,
            timeout_s=20,
        )  # fmt: skip

    done = threading.Event()

    def run_and_note(cfg):
        try:
            return _stepping_run(turns, 10, [], 0.001)(cfg)
        finally:
            done.set()

    with pytest.raises((RuntimeError, TurnsError)):
        in_turns(cfgs, turns, run_and_note, [partial(clock, turns)])
    assert done.is_set()


def test_a_companion_failing_before_it_opens_the_file_stops_the_runs(tmp_path) -> None:
    """`in_turns` marks the file abandoned for a job that raised, even one that never opened
    it: the runs raise at once instead of waiting out their timeout."""
    from poise.train.config import TrainConfig

    turns = tmp_path / "runs.turns"
    cfgs = [TrainConfig(policy="static", steps=10, out=str(tmp_path / "s"))]

    def broken(slot: int, slots: int):
        raise RuntimeError("no clock today")

    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="no clock today"):
        in_turns(cfgs, turns, _stepping_run(turns, 10, [], 0.001), [broken])
    assert time.perf_counter() - t0 < 30


def test_the_clock_rejects_a_skip_past_the_steps(tmp_path) -> None:
    with pytest.raises(ConfigError, match="skip < steps"):
        expert_seconds_in_turns(
            tmp_path / "t", 0, 1, steps=5, d_model=8, d_expert=8, experts_per_rank=2, skip=5
        )
