import os

import pytest

from poise.runtime.launch import RankFailedError, _take_environment, run_ranks

pytestmark = pytest.mark.dist


def _sum_ranks(rank: int, world_size: int, scale: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t.item()) + world_size * 1000


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(_sum_ranks, 2, 3) == [2003, 2003]


def test_a_failing_rank_fails_the_run_with_its_message() -> None:
    with pytest.raises(RankFailedError, match="rank 1: ValueError: rank one refuses"):
        run_ranks(_fail_on_rank_one, 2, collective_timeout_s=10)


def _environment(rank: int, world_size: int, names: tuple[str, ...]) -> list[str | None]:
    import os

    return [os.environ.get(name) for name in names]


def test_ranks_see_the_callers_environment_as_it_is_at_the_call(monkeypatch) -> None:
    """Ranks fork from a server started at the first call: a variable set after that
    (`LOCAL_WORLD_SIZE`, the `POISE_FAIL_*` fault settings) must still reach them as the
    caller has it, as it did when each rank was spawned from the caller."""
    run_ranks(_sum_ranks, 2, 1)  # the fork server is running from here on
    monkeypatch.setenv("POISE_LAUNCH_TEST_SET", "after the server started")
    got = run_ranks(_environment, 2, ("POISE_LAUNCH_TEST_SET", "HOME"))
    assert got == [["after the server started", os.environ.get("HOME")]] * 2


def test_a_rank_drops_what_the_caller_has_not(monkeypatch) -> None:
    """What the server's environment has and the caller's has not (removed after the server
    started) is gone in the rank: `_take_environment` makes the environment the caller's."""
    monkeypatch.setenv("POISE_LAUNCH_TEST_GONE", "the server's")
    callers = {k: v for k, v in os.environ.items() if k != "POISE_LAUNCH_TEST_GONE"}
    callers["POISE_LAUNCH_TEST_NEW"] = "the caller's"
    monkeypatch.setenv("POISE_LAUNCH_TEST_NEW", "")  # restored (removed) after the test
    _take_environment(callers)
    assert "POISE_LAUNCH_TEST_GONE" not in os.environ
    assert os.environ["POISE_LAUNCH_TEST_NEW"] == "the caller's"
    assert dict(os.environ) == callers


def _speak(tag: str, code: int) -> int:
    import os
    import sys

    print(f"out {tag} {os.environ.get('POISE_LAUNCH_TEST_TAG')}", flush=True)
    print(f"err {tag}", file=sys.stderr, flush=True)
    return code


def _raise(tag: str) -> int:
    raise ValueError(f"forked {tag} refuses")


def test_a_forked_process_writes_to_the_callers_streams_as_they_are_now(capfd) -> None:
    """`start_forked`: the fork server's standard output and error are those of when it
    started (an earlier test's captured output, here); a forked process writes to the
    caller's as they are at the call, sees the environment it is given and exits with the int
    its target returns, or 1 with the traceback on the caller's standard error."""
    from poise.runtime.launch import start_forked

    with capfd.disabled():  # the server, if it starts now, gets other streams than these
        run_ranks(_sum_ranks, 2, 1)  # the fork server is running from here on
    capfd.readouterr()
    env = {**os.environ, "POISE_LAUNCH_TEST_TAG": "given"}
    proc = start_forked(_speak, "a", 3, environ=env)
    proc.join(60)
    assert proc.exitcode == 3
    failed = start_forked(_raise, "b")
    failed.join(60)
    assert failed.exitcode == 1
    out, err = capfd.readouterr()
    assert out.splitlines() == ["out a given"]
    assert "err a" in err.splitlines()
    assert "ValueError: forked b refuses" in err


_LAUNCHER = """
import os, sys, time
from poise.runtime.launch import run_ranks, start_forked
from tests.test_launch import _sleep_ranks

if __name__ == "__main__":
    if sys.argv[1] == "forked":
        with open(f"{sys.argv[2]}/0.tmp", "w") as f:
            f.write(str(start_forked(time.sleep, 600).pid))
        os.rename(f"{sys.argv[2]}/0.tmp", f"{sys.argv[2]}/0.pid")
    elif sys.argv[1] == "figures":
        from poise.report.figure_workers import FigureWorkers

        figures = FigureWorkers(2)
        figures.draw("breakdown_plot", f"{sys.argv[2]}/drawn.png", {"a": {"x": 1.0}}, title="t")
        while not os.path.exists(f"{sys.argv[2]}/drawn.png"):  # a worker is up and drawing
            time.sleep(0.1)
        for i, pid in enumerate(figures.pids()):
            with open(f"{sys.argv[2]}/{i}.tmp", "w") as f:
                f.write(str(pid))
            os.rename(f"{sys.argv[2]}/{i}.tmp", f"{sys.argv[2]}/{i}.pid")
    else:
        run_ranks(_sleep_ranks, 2, sys.argv[2], timeout_s=600)
    time.sleep(600)
"""


def _sleep_ranks(rank: int, world_size: int, folder: str) -> None:
    import time
    from pathlib import Path

    Path(folder, f"{rank}.pid.tmp").write_text(str(os.getpid()))
    Path(folder, f"{rank}.pid.tmp").rename(Path(folder, f"{rank}.pid"))
    time.sleep(600)


@pytest.mark.parametrize("how", ["forked", "ranks", "figures"])
def test_forked_processes_end_when_their_launcher_is_killed(tmp_path, how: str) -> None:
    """A launcher killed outright (SIGKILL: no `finally`, no clean-up) leaves neither its
    forked processes (`start_forked`, `run_ranks`, the report's `FigureWorkers`) nor their
    fork server running: each ends itself within seconds (`launch.exit_with`)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from poise.runtime.launch import _alive, proc_stat

    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")])}
    folder = tmp_path / "pids"
    folder.mkdir()
    launcher = subprocess.Popen([sys.executable, str(script), how, str(folder)], env=env)
    try:
        want = 1 if how == "forked" else 2  # ranks and figure workers: 2
        deadline = time.monotonic() + 120
        while len(list(folder.glob("*.pid"))) < want and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in folder.glob("*.pid")]
        assert len(pids) == want, pids
        servers = {int(proc_stat(p)[1]) for p in pids}  # type: ignore[index]  # their parents
        assert all(_alive(p) for p in pids + list(servers))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids + list(servers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), pids
        assert not any(_alive(p) for p in servers), servers
    finally:
        if launcher.poll() is None:
            launcher.kill()
