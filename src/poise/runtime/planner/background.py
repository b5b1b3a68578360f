"""Planning off the critical path: the Balancer's planning job runs in a background worker.

    planner = BackgroundPlanner()                           # process=True: a worker process
    planner.submit(partial(run_job, job), requested_at=s, adopt_at=s + lag)  # at step s
    ...                                                     # training goes on
    done = planner.take()                                   # at step s + lag; waits if need be
    done.value, done.plan_s, done.wait_s, done.cpu_s

A plan requested at step `s` is decided at the boundary of step `s + lag`, whether its job
finished early or late; the Balancer sets `lag` from the last job's wall time (`adoption_lag`).
The job's inputs are snapshots taken at step `s` and the policy is deterministic, so any rank
that plans gets the same plan.

The job runs in a worker process (`poise.runtime.planner.worker`, started once; the job pickled
to it) at the lowest CPU priority (`nice` 19, or Linux's SCHED_IDLE with `priority="idle"`): a
thread of the training process would hold the interpreter lock whenever the planner's Python
runs, and training needs that lock between every two tensor operations. `process=False` plans
on one thread of this process at nice 19 instead, for jobs that do not pickle.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poise.core.errors import PoiseError
from poise.runtime.planner.worker import PRIORITIES, read_frame, write_frame


def adoption_lag(plan_s: float, period_s: float, least: int) -> int:
    """Steps from a plan's request to its adoption so that a job of `plan_s` wall seconds is
    ready: `ceil(plan_s / period_s)` with `period_s` the step's seconds, at least `least`
    (`least` where the period is not known). No upper bound: a job longer than the re-plan
    interval stretches it (the Balancer requests no plan while one is in flight), so that no
    boundary waits for a planner that was known to be slow."""
    if not period_s > 0 or not plan_s > 0:
        return least
    return int(max(least, np.ceil(plan_s / period_s)))


@dataclass(frozen=True)
class Planned:
    """A finished job: its `value`, its wall seconds `plan_s` (less any the worker was paused),
    the seconds the boundary that took it waited `wait_s`, the steps it was requested at and
    adopted at, and the CPU seconds it used `cpu_s`."""

    value: Any
    plan_s: float
    wait_s: float
    requested_at: int
    adopt_at: int
    cpu_s: float = 0.0


@dataclass
class _Job:
    future: Future[tuple[Any, float, float]]
    requested_at: int
    adopt_at: int
    paused_s: float = 0.0  # wall seconds the worker was stopped while this job ran


class BackgroundPlanner:
    """One planning job at a time, in a worker process (`process=True`, which imports the
    `preload` modules when it starts and runs at `priority`, `worker.PRIORITIES`) or on
    one thread."""

    def __init__(
        self, process: bool = True, preload: tuple[str, ...] = (), priority: str = "nice"
    ) -> None:
        if priority not in PRIORITIES:
            raise PoiseError(
                f"the planner's priority must be one of {PRIORITIES}, got {priority!r}",
                field="planner",
            )
        self.process = process
        self.preload = tuple(preload)  # modules the worker imports at start-up
        self.priority = priority
        self._pool: ThreadPoolExecutor | None = None
        self._worker: WorkerProcess | None = None
        self._job: _Job | None = None
        self._paused_at: float | None = None

    def start(self) -> None:
        """Start the thread (and the worker process) now rather than at the first job, so that
        the worker's start-up runs while training does."""
        if self._pool is None:
            init = None if self.process else lowest_priority
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="poise-planner", initializer=init
            )
        if self.process and self._worker is None:
            self._worker = WorkerProcess(self.preload, self.priority)

    def submit(self, job: Callable[[], Any], requested_at: int, adopt_at: int) -> None:
        """Start `job()` in the background; its result is taken at step `adopt_at`."""
        if self._job is not None:
            raise PoiseError(
                f"a plan requested at step {self._job.requested_at} is still in flight",
                field="planner",
            )
        if adopt_at < requested_at:
            raise PoiseError(f"adopt_at {adopt_at} < requested_at {requested_at}", field="planner")
        self.start()
        assert self._pool is not None
        if self._worker is not None:
            try:
                payload = pickle.dumps(job)
            except Exception as exc:
                raise PoiseError(
                    f"a planning job must pickle to run in the planner process: {exc}",
                    field="planner",
                ) from exc
            future = self._pool.submit(self._worker.call, payload)
        else:
            future = self._pool.submit(_timed, job)
        self._job = _Job(future, requested_at, adopt_at)

    def take(self) -> Planned:
        """The job's result, waiting for it if needed (a job's exception re-raises)."""
        if self._job is None:
            raise PoiseError("no plan in flight", field="planner")
        self.resume()  # a stopped worker would never answer
        job, self._job = self._job, None
        t0 = time.perf_counter()
        value, plan_s, cpu_s = job.future.result()
        wait_s = time.perf_counter() - t0
        plan_s = max(plan_s - job.paused_s, 0.0)
        return Planned(value, plan_s, wait_s, job.requested_at, job.adopt_at, cpu_s)

    def pause(self) -> None:
        """Stop the worker process where it stands (SIGSTOP) until `resume`: while this run
        hands its host to another (`poise.train.turns`), its planner must not run on that run's
        time. The job's `plan_s` then leaves the stopped seconds out. On a planning thread
        (`process=False`) nothing stops."""
        if self._worker is not None and self._paused_at is None:
            self._worker.signal(signal.SIGSTOP)
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Let a paused worker go on (SIGCONT)."""
        if self._paused_at is None:
            return
        if self._job is not None:
            self._job.paused_s += time.perf_counter() - self._paused_at
        self._paused_at = None
        if self._worker is not None:
            self._worker.signal(signal.SIGCONT)

    def close(self) -> None:
        """Drop the job in flight (waiting for it) and stop the thread and the worker."""
        self.resume()
        if self._job is not None:
            self._job.future.cancel()
            self._job = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None


# modules that library calls in the jobs import lazily, imported by each worker at start-up, so
# that no job pays for them mid-training (NumPy 2's `np.unique` imports `numpy.ma` at its first
# call)
LAZY_IMPORTS = ("numpy.ma",)


class WorkerProcess:
    """`python -m poise.runtime.planner.worker` with pipes to it (its protocol: that module), at
    `priority` (`worker.lowest_priority`)."""

    def __init__(self, preload: tuple[str, ...] = (), priority: str = "nice") -> None:
        package_root = str(Path(__file__).resolve().parents[3])  # the folder holding `poise`
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = "1"  # one core's worth at most, at the lowest priority
        argv = [sys.executable, "-m", "poise.runtime.planner.worker", f"--priority={priority}"]
        argv += dict.fromkeys([*LAZY_IMPORTS, *preload])  # the modules, each once
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        # a planner dropped without `close()` still ends its worker (end of its input)
        self._finalizer = weakref.finalize(self, _end_input, self.proc)

    def call(self, payload: bytes) -> tuple[Any, float, float]:
        """Send one pickled job, wait for its reply: `(value, wall_s, cpu_s)`; the job's
        exception re-raises here; a worker that died is a `PoiseError`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(OSError):  # a dead worker: the read below reports it
            write_frame(self.proc.stdin, payload)
        reply = read_frame(self.proc.stdout)
        if reply is None:
            code = self.proc.wait(timeout=10)
            raise PoiseError(
                f"the planner process exited with status {code} during a job (its standard "
                "error, above, says why)",
                field="planner",
            )
        kind, *rest = pickle.loads(reply)
        if kind == "error":
            exc, text = rest
            raise exc from PoiseError(f"in the planner process:\n{text}", field="planner")
        value, wall_s, cpu_s = rest
        return value, wall_s, cpu_s

    def signal(self, sig: int) -> None:
        """Send `sig` to the worker (nothing where it has exited)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def close(self) -> None:
        """Close its input (it exits at the end of it), then wait for it, or kill it."""
        self._finalizer.detach()
        _end_input(self.proc)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _end_input(proc: subprocess.Popen) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def lowest_priority() -> bool:
    """Give the calling thread the lowest CPU priority (nice 19); whether it took effect (Linux
    sets a thread's own priority by its native id; elsewhere this may be refused)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        return False
    return True


def _timed(job: Callable[[], Any]) -> tuple[Any, float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    value = job()
    return value, time.perf_counter() - t0, time.thread_time() - c0
