"""Independent jobs in worker processes, results as each finishes.

    for index, result in map_in_processes(fn, [(a, b), (c, d)], workers=2):
        ...  # result = fn(*jobs[index]), in the order the jobs finish

For work that is Python holding the GIL (threads would take turns): `fn` and the jobs'
arguments must pickle (a module-level function). The workers are spawned, so they inherit no
threads and no state of the caller, and end with the call; with fewer than two workers (or
one job) the jobs run here, one after the other, in order.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

R = TypeVar("R")


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        return os.cpu_count() or 1


def map_in_processes(
    fn: Callable[..., R], jobs: Sequence[tuple[Any, ...]], workers: int
) -> Iterator[tuple[int, R]]:
    """`(i, fn(*jobs[i]))` for every job, as each finishes, from `min(workers, len(jobs))`
    spawned worker processes (module docstring); in order, here, with fewer than two."""
    workers = min(workers, len(jobs))
    if workers < 2:
        for i, args in enumerate(jobs):
            yield i, fn(*args)
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(fn, *args): i for i, args in enumerate(jobs)}
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:  # a job's error, or a caller that stops early: the jobs not started are dropped
        pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["available_cpus", "map_in_processes"]
