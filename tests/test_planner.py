"""The background planner (`poise.runtime.planner`): jobs handed over at their adoption step,
in a worker process or on a thread at the lowest CPU priority; and the adoption lag."""

from __future__ import annotations

import pytest

from poise.runtime.planner.background import adoption_lag


def test_the_adoption_lag_is_the_planners_time_in_steps() -> None:
    assert adoption_lag(0.25, 0.1, 1) == 3  # ready during the third step
    assert adoption_lag(0.05, 0.1, 1) == 1 and adoption_lag(0.3, 0.1, 1) == 3
    assert adoption_lag(5.0, 0.1, 1) == 50  # longer than a re-plan period: it stretches
    assert adoption_lag(0.25, 0.0, 2) == 2  # no period measured yet: the least


def test_background_planner_hands_results_over_at_the_adoption_step() -> None:
    import threading

    from poise.core.errors import PoiseError
    from poise.runtime.planner.background import BackgroundPlanner

    planner = BackgroundPlanner(process=False)  # a thread: the job is a closure
    release = threading.Event()
    planner.submit(lambda: release.wait(5) and "plan", requested_at=4, adopt_at=5)
    with pytest.raises(PoiseError, match="in flight"):
        planner.submit(lambda: None, 5, 6)
    threading.Timer(0.05, release.set).start()
    done = planner.take()  # waits for the thread
    # take() waited for the release, 0.05 s after the timer started (the job's own clock may
    # start late on a loaded machine, so only its sign is certain)
    assert done.value == "plan" and done.wait_s > 0.02 and done.plan_s > 0
    assert (done.requested_at, done.adopt_at) == (4, 5)
    planner.close()


def test_the_planner_thread_runs_at_the_lowest_priority() -> None:
    """Its niceness is 19 (Linux: per thread), the training thread's is unchanged."""
    import os
    import sys
    import threading

    from poise.runtime.planner.background import BackgroundPlanner

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread priority is Linux's")
    planner = BackgroundPlanner(process=False)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    planner.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), 0, 0)
    assert planner.take().value == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    planner.close()


def test_the_planner_process_runs_jobs_elsewhere_at_the_lowest_priority() -> None:
    """The default planner runs each pickled job in its worker process, at nice 19; a job's
    exception re-raises at `take`, a job that does not pickle and a worker that dies are one
    clear `PoiseError` each."""
    import os
    import sys
    from functools import partial

    from poise.core.errors import PoiseError
    from poise.runtime.planner.background import BackgroundPlanner

    planner = BackgroundPlanner(preload=("poise.runtime.control.job",))
    try:
        planner.submit(partial(os.getpid), requested_at=0, adopt_at=1)
        done = planner.take()
        assert done.value != os.getpid() and done.plan_s >= 0 and done.cpu_s >= 0
        loaded = (
            "[m in __import__('sys').modules for m in ('poise.runtime.control.job', 'numpy.ma')]"
        )
        planner.submit(partial(eval, loaded), 0, 0)  # imported before the first job
        assert planner.take().value == [True, True]  # numpy.ma: `LAZY_IMPORTS`
        if sys.platform.startswith("linux"):
            planner.submit(partial(os.getpriority, os.PRIO_PROCESS, 0), 1, 1)
            assert planner.take().value == 19
        planner.submit(partial(int, "not a number"), 2, 2)
        with pytest.raises(ValueError, match="not a number"):
            planner.take()
        with pytest.raises(PoiseError, match="must pickle"):
            planner.submit(lambda: None, 3, 3)
        planner.submit(partial(os._exit, 3), 4, 4)
        with pytest.raises(PoiseError, match="exited with status 3"):
            planner.take()
    finally:
        planner.close()
    import gc

    from poise.runtime.planner.background import WorkerProcess

    dropped = WorkerProcess()
    proc = dropped.proc
    del dropped  # never closed: its finalizer ends the worker's input, and it exits
    gc.collect()
    assert proc.wait(timeout=10) == 0
    # a Ctrl-C reaches the worker with its rank (one process group): the rank answers it, the
    # worker goes on serving until its input ends
    import pickle
    import signal

    worker = WorkerProcess(("poise.runtime.control.job",))
    worker.call(pickle.dumps(partial(os.getpid)))  # started: its handlers are set
    worker.proc.send_signal(signal.SIGINT)
    assert worker.call(pickle.dumps(partial(abs, -7)))[0] == 7
    assert worker.proc.stdin is not None
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=10) == 0


def test_the_planner_process_takes_the_priority_it_is_given() -> None:
    """`priority="idle"` runs the worker at SCHED_IDLE where Linux has it, the default at
    nice 19 with the normal policy; an unknown priority is one clear error."""
    import os
    import sys
    from functools import partial

    from poise.core.errors import PoiseError
    from poise.runtime.planner.background import BackgroundPlanner

    with pytest.raises(PoiseError, match="priority must be one of"):
        BackgroundPlanner(priority="realtime")
    if not sys.platform.startswith("linux"):
        pytest.skip("scheduling policies are Linux's")
    inherited = os.getpriority(os.PRIO_PROCESS, 0)  # SCHED_IDLE leaves the nice value alone
    for priority, policy, nice in (
        ("idle", os.SCHED_IDLE, inherited),
        ("nice", os.SCHED_OTHER, 19),
    ):
        planner = BackgroundPlanner(priority=priority)
        try:
            planner.submit(partial(os.sched_getscheduler, 0), 0, 0)
            assert planner.take().value == policy
            planner.submit(partial(os.getpriority, os.PRIO_PROCESS, 0), 0, 0)
            assert planner.take().value == nice
        finally:
            planner.close()
