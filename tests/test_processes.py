"""`map_in_processes`: every job's result with its index, from worker processes or here."""

from __future__ import annotations

import math

import pytest

from poise.util.processes import available_cpus, map_in_processes


@pytest.mark.parametrize("workers", [1, 2])
def test_every_job_comes_back_with_its_index(workers: int) -> None:
    jobs = [(2.0, float(k)) for k in range(5)]
    got = dict(map_in_processes(math.pow, jobs, workers))
    assert got == {k: 2.0**k for k in range(5)}


def test_alone_the_jobs_run_here_in_order() -> None:
    seen: list[int] = []

    def record(k: int) -> int:  # a local function: it could not pickle to a worker
        seen.append(k)
        return k

    assert [i for i, _ in map_in_processes(record, [(3,), (1,), (2,)], 1)] == [0, 1, 2]
    assert seen == [3, 1, 2]


def test_a_jobs_error_is_raised_here() -> None:
    with pytest.raises(ValueError):
        list(map_in_processes(math.sqrt, [(4.0,), (-1.0,)], 2))


def test_available_cpus_is_positive() -> None:
    assert available_cpus() >= 1


def test_the_workers_are_kept_for_the_next_call() -> None:
    import os

    from poise.util import processes

    first = {pid for _, pid in map_in_processes(os.getpid, [(), (), ()], 2)}
    pool = processes._POOLS[2]
    second = {pid for _, pid in map_in_processes(os.getpid, [(), (), ()], 2)}
    assert processes._POOLS[2] is pool
    assert os.getpid() not in first | second
