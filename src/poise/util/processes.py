"""Independent jobs in worker processes, results as each finishes.

    for index, result in map_in_processes(fn, [(a, b), (c, d)], workers=2):
        ...  # result = fn(*jobs[index]), in the order the jobs finish

For work that is Python holding the GIL (threads would take turns): `fn` and the jobs'
arguments must pickle (a module-level function). The workers are spawned, so they inherit no
threads and no state of the caller (and a script that calls this must do its work under
`if __name__ == "__main__":`, as a spawned worker imports it); they stay for the next call
(starting one and its imports takes about a second of CPU) and end with this process. With
fewer than two workers (or one job) the jobs run here, one after the other, in order.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

R = TypeVar("R")

_POOLS: dict[int, ProcessPoolExecutor] = {}  # by number of workers, kept between calls
_POOLS_LOCK = threading.Lock()


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        return os.cpu_count() or 1


def _pool(workers: int) -> ProcessPoolExecutor:
    """The kept pool of `workers` spawned processes (started at its first use)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            context = multiprocessing.get_context("spawn")
            pool = _POOLS[workers] = ProcessPoolExecutor(workers, mp_context=context)
        return pool


def _drop(workers: int, pool: ProcessPoolExecutor) -> None:
    """Forget a broken pool (a worker died): the next call starts a new one."""
    with _POOLS_LOCK:
        if _POOLS.get(workers) is pool:
            del _POOLS[workers]
    pool.shutdown(wait=False, cancel_futures=True)


def map_in_processes(
    fn: Callable[..., R], jobs: Sequence[tuple[Any, ...]], workers: int
) -> Iterator[tuple[int, R]]:
    """`(i, fn(*jobs[i]))` for every job, as each finishes, from `min(workers, len(jobs))`
    worker processes (module docstring); in order, here, with fewer than two. A job's error
    is raised here, and the jobs not started are dropped."""
    workers = min(workers, len(jobs))
    if workers < 2:
        for i, args in enumerate(jobs):
            yield i, fn(*args)
        return
    pool = _pool(workers)
    futures = {pool.submit(fn, *args): i for i, args in enumerate(jobs)}
    try:
        for future in as_completed(futures):
            yield futures[future], future.result()
    except BrokenProcessPool as error:
        _drop(workers, pool)
        raise BrokenProcessPool(
            "a worker process ended abruptly; a script that starts worker processes must run "
            'its work under `if __name__ == "__main__":` (spawned workers import the script)'
        ) from error
    finally:  # a job's error, or a caller that stops early: drop what has not started
        for future in futures:
            future.cancel()


__all__ = ["available_cpus", "map_in_processes"]
