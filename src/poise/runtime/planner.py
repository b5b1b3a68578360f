"""Planning off the critical path: the Balancer's policy runs on one background thread.

    planner = BackgroundPlanner()
    planner.submit(job, requested_at=s, adopt_at=s + lag)   # at step s's boundary, every rank
    ...                                                     # training goes on
    if planner.due(step):                                   # at step s + lag, every rank
        done = planner.take()                               # waits if the thread is not done
        done.value, done.plan_s, done.wait_s

A plan requested at step `s` is adopted at the boundary of step `s + lag`, whether its thread
finished early or late: the rank that plans (the Balancer's leader, `poise.runtime.decision`)
waits for its planner at that boundary if it must. The job's inputs are snapshots taken at step
`s` (the gathered loads, identical on every rank) and the policy is deterministic, so any rank
that plans gets the same plan at the same step (`check_plans` verifies it). Planning code is
NumPy, which releases the GIL in its kernels; the thread competes with training only for CPU
time, and runs at the lowest scheduling priority (nice 19, where the OS allows it per thread, as
Linux does): on CPU ranks that share the cores it then takes mostly the time the training
threads spend waiting (at collectives, or at the adoption boundary itself, where a rank that
must wait for its planner leaves it the core).

`plan_s` is the job's wall time on its thread; `cpu_s` the CPU seconds the thread used (what
it took from the training ranks where they share the cores: CPU devices); `wait_s` how long the
boundary that took it waited (the part of planning that delayed a step outright).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from poise.core.errors import PoiseError


@dataclass(frozen=True)
class Planned:
    """A finished job: its `value`, the thread's seconds `plan_s`, the boundary's wait `wait_s`,
    the steps it was requested at and adopted at, the thread's CPU seconds `cpu_s`."""

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


class BackgroundPlanner:
    """One planning job at a time on one daemon thread (created on first use)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._job: _Job | None = None

    @property
    def busy(self) -> bool:
        """A job was submitted and not yet taken."""
        return self._job is not None

    def submit(self, job: Callable[[], Any], requested_at: int, adopt_at: int) -> None:
        """Start `job()` on the thread; its result is taken at step `adopt_at`."""
        if self._job is not None:
            raise PoiseError(
                f"a plan requested at step {self._job.requested_at} is still in flight",
                field="planner",
            )
        if adopt_at < requested_at:
            raise PoiseError(f"adopt_at {adopt_at} < requested_at {requested_at}", field="planner")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="poise-planner", initializer=lowest_priority
            )
        self._job = _Job(self._pool.submit(_timed, job), requested_at, adopt_at)

    def due(self, step: int) -> bool:
        """A job is in flight and step `step` is (at or past) its adoption step."""
        return self._job is not None and step >= self._job.adopt_at

    def take(self) -> Planned:
        """The job's result, waiting for the thread if needed (a job's exception re-raises)."""
        if self._job is None:
            raise PoiseError("no plan in flight", field="planner")
        job, self._job = self._job, None
        t0 = time.perf_counter()
        value, plan_s, cpu_s = job.future.result()
        wait_s = time.perf_counter() - t0
        return Planned(value, plan_s, wait_s, job.requested_at, job.adopt_at, cpu_s)

    def close(self) -> None:
        """Drop the job in flight (waiting for its thread) and stop the thread."""
        if self._job is not None:
            self._job.future.cancel()
            self._job = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


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


__all__ = ["BackgroundPlanner", "Planned", "lowest_priority"]
