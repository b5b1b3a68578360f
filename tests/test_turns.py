"""Runs taking their steps in turns (`poise.train.turns`): strict alternation, start and end
gates, a failed run releasing the others, the planner stopped while its run waits, and two real
2-rank `train` runs (static and auto) alternating step by step with the Balancer's period
leaving out the other run's turns."""

from __future__ import annotations

import functools
import itertools
import json
import multiprocessing as mp
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from poise.core.errors import ConfigError
from poise.train.turns import StepTurns, TurnsError

from .helpers import tiny_train_config

STEPS = 5
STEP_S = 0.03


def _take_turns(path: str, slot: int, delay: float, out: mp.Queue) -> None:
    """One run of `STEPS` steps of `STEP_S` seconds each; reports when it arrived, each step's
    (begin, end) and when `finish` let it go."""
    time.sleep(delay)
    turns = StepTurns.open(path, slot, 2, rank=0, timeout_s=30)
    arrived = time.time()
    turns.arrive()
    spans = []
    for k in range(STEPS):
        turns.wait(k)
        t0 = time.time()
        time.sleep(STEP_S)
        spans.append((t0, time.time()))
        turns.hand_over(k)
    turns.finish(STEPS)
    out.put((slot, arrived, spans, time.time()))
    turns.close()


def test_runs_alternate_step_by_step(tmp_path):
    """Step k of run 0 then of run 1 for even k, of run 1 then of run 0 for odd k, never two
    at once; no step before the late run has arrived; no run let go before the other's last
    step."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = str(tmp_path / "turns")
    procs = [
        ctx.Process(target=_take_turns, args=(path, 0, 0.0, q)),
        ctx.Process(target=_take_turns, args=(path, 1, 0.5, q)),  # arrives late
    ]
    for p in procs:
        p.start()
    got = {
        slot: (arrived, spans, let_go)
        for slot, arrived, spans, let_go in (q.get(timeout=60) for _ in procs)
    }
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    order = sorted(
        (b, e, slot, k) for slot, (_, spans, _) in got.items() for k, (b, e) in enumerate(spans)
    )
    expected = [(s, k) for k in range(STEPS) for s in ((0, 1) if k % 2 == 0 else (1, 0))]
    assert [(slot, k) for _, _, slot, k in order] == expected  # A B, B A, A B, ...
    for (_, end, *_), (begin, *_) in itertools.pairwise(order):
        assert end <= begin  # never two steps at once
    assert got[0][1][0][0] >= got[1][0]  # run 0's first step waited for run 1 to arrive
    assert got[0][2] >= got[1][1][-1][1]  # run 0 let go only after run 1's last step


def test_a_failed_run_releases_the_others(tmp_path):
    path = tmp_path / "turns"
    waiting = StepTurns.open(path, 0, 2, rank=0, timeout_s=30)
    failed = StepTurns.open(path, 1, 2, rank=0, timeout_s=30)
    failed.abandon()
    t0 = time.perf_counter()
    with pytest.raises(TurnsError, match="run 1 of 2 failed") as err:
        waiting.arrive()
    assert time.perf_counter() - t0 < 5  # at once, not after the timeout
    assert str(path) in str(err.value)


def test_a_run_that_never_passes_the_turn_times_out_naming_the_file(tmp_path):
    path = tmp_path / "turns"
    late = StepTurns.open(path, 1, 2, rank=0, timeout_s=0.2)
    with pytest.raises(TurnsError, match="turn at step 0") as err:
        late.wait(0)
    assert str(path) in str(err.value) and err.value.field == "turns"


@pytest.mark.parametrize(
    ("fields", "bad"),
    [({"turns_slot": 2, "turns_of": 2}, "turns_slot"), ({"turns_of": 1}, "turns_of")],
)
def test_turn_fields_are_checked(tmp_path, fields, bad):
    with pytest.raises(ConfigError) as err:
        tiny_train_config(str(tmp_path), "x", turns=str(tmp_path / "t"), **fields)
    assert err.value.field == bad


def _proc_state(pid: int) -> tuple[str, int]:
    """`(state, utime ticks)` of a process from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_paused_planner_stops_and_its_plan_time_leaves_the_pause_out():
    from poise.runtime.planner.background import BackgroundPlanner

    planner = BackgroundPlanner(process=True)
    job = functools.partial(sum, range(80_000_000))  # about a second of one core
    try:
        planner.submit(functools.partial(sum, range(10)), requested_at=0, adopt_at=0)
        assert planner.take().value == 45  # the worker is up: the next job starts at once
        t_submit = time.perf_counter()
        planner.submit(job, requested_at=0, adopt_at=1)
        time.sleep(0.2)  # the job is running
        planner.pause()
        assert not planner._job.future.done()
        pid = planner._worker.proc.pid
        time.sleep(0.1)
        state, before = _proc_state(pid)
        time.sleep(0.5)
        _, after = _proc_state(pid)
        assert state == "T" and after == before  # stopped: no CPU time while paused
        planner.resume()
        assert _proc_state(pid)[0] != "T"
        done = planner.take()
        elapsed = time.perf_counter() - t_submit
        assert done.value == 80_000_000 * (80_000_000 - 1) // 2
        # the job's wall seconds less the 0.6 s it was stopped
        assert done.plan_s < elapsed - 0.5
    finally:
        planner.close()


def _run_in_turns(rank: int, world: int, cfg_json: str) -> dict:
    from poise.train import TrainConfig, train

    result = train(TrainConfig(**json.loads(cfg_json)), quiet=True)
    return {"losses": result.losses}


def test_two_training_runs_take_their_steps_in_turns(tmp_path):
    """Static and auto on 2 gloo ranks each, in turns: each step of one run begins after the
    other's step before it has ended; auto's planner ran (decisions taken); the Balancer's
    measured period is its own step, not its step plus the other run's."""
    from poise.runtime.launch import run_ranks

    turns = tmp_path / "turns"
    skewed = dict(model_args={"num_experts": 16, "top_k": 1, "d_expert": 64}, batch=16)
    cfgs = [
        tiny_train_config(str(tmp_path), p, steps=8, policy=p, turns=str(turns), turns_slot=i,
                          **skewed)
        for i, p in enumerate(("static", "auto"))
    ]  # fmt: skip
    errors: list[BaseException] = []

    def go(cfg):
        try:
            run_ranks(_run_in_turns, 2, json.dumps(cfg.to_dict()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(c,)) for c in cfgs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    rows = {
        p: [json.loads(x) for x in (tmp_path / p / "metrics.jsonl").read_text().splitlines()]
        for p in ("static", "auto")
    }
    spans = sorted(
        (r["turn"]["began"], r["turn"]["began"] + r["step_s"], p, r["step"])
        for p, rs in rows.items()
        for r in rs
    )
    order = [("static", "auto"), ("auto", "static")]
    assert [(p, k) for *_, p, k in spans] == [
        (p, k) for k in range(1, 9) for p in order[(k - 1) % 2]
    ]
    for (_, end, *_), (begin, *_) in itertools.pairwise(spans):
        assert end <= begin
    auto = rows["auto"]
    assert any(r["decision"] for r in auto)  # its planner ran (paused between its turns)
    later = auto[2:]  # the period is measured from the second step on
    period = np.median([r["rank_s"]["period_s"][0] for r in later])
    step = np.median([r["step_s"] for r in later])
    waited = np.median([r["turn"]["waited_s"] for r in later])
    assert waited > 0.5 * step  # the other run's step came in between
    assert period < step + 0.5 * waited


def test_in_turns_runs_every_config_at_once_with_its_slot(tmp_path: Path) -> None:
    """`poise.commands.train.in_turns`: every run gets its slot in one fresh turn file, the runs
    are under way together (each waits at a barrier the others must reach), the results come
    back in order, the file is gone after, and a run's failure is raised once all have ended."""
    from poise.commands.train import in_turns

    turns = tmp_path / "sub" / "t.turns"
    cfgs = [
        tiny_train_config(str(tmp_path), f"r{i}", policy=p)
        for i, p in enumerate(("static", "auto"))
    ]
    together = threading.Barrier(2, timeout=10)
    seen: list[tuple[str, str | None, int, int, bool]] = []

    def run(cfg):
        seen.append((cfg.policy, cfg.turns, cfg.turns_slot, cfg.turns_of, turns.exists()))
        together.wait()  # a run started after the other ended would break the barrier
        return cfg.policy

    turns.parent.mkdir()
    turns.write_bytes(b"stale")
    assert in_turns(cfgs, turns, run) == ["static", "auto"]
    assert sorted(seen) == [("auto", str(turns), 1, 2, False), ("static", str(turns), 0, 2, False)]
    assert not turns.exists()

    ended: list[str] = []

    def fail_first(cfg):
        if cfg.turns_slot == 0:
            raise SystemExit(3)
        time.sleep(0.2)
        ended.append(cfg.policy)
        return 0

    with pytest.raises(SystemExit) as exc:
        in_turns(cfgs, turns, fail_first)
    assert exc.value.code == 3 and ended == ["auto"]  # raised after the other run ended
