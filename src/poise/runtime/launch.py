"""Run a function on D local gloo ranks in fresh processes and collect what each returns
(`run_ranks`), or start one process (`start_forked`: `poise train --nproc`'s ranks).

Each rank joins a gloo group on 127.0.0.1 with a collective timeout (a disagreeing rank is an
error, not a hang); one that raises fails the run with its traceback.

Processes fork from a `forkserver` that imported torch, `torch.distributed` and `torch._dynamo`
once (`FORKSERVER_PRELOAD`; `torch.optim`'s first step imports `torch._dynamo`), so one starts
in a fraction of a second; otherwise it is a spawned one (no process group, no CUDA, the
caller's `sys.path`, working directory and environment at the call). A forked process ends
itself once its launcher is gone (`exit_with`): the server outlives a killed launcher, and so
would its ranks, waiting for peers that never come.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from poise.core.errors import PoiseError

FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "poise.runtime.launch")


class RankFailedError(PoiseError):
    """A rank raised, or the ranks did not finish in time."""


def destroy_process_group() -> None:
    """`torch.distributed.destroy_process_group()`, after collecting cyclic garbage: collective
    handles (`dist.Work`) in reference cycles (autograd contexts, hooks), freed only at
    interpreter shutdown after the group is gone, can abort the rank ("terminate called without
    an active exception", SIGABRT); collecting first frees them while the group is alive."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def join_local_gloo(rank: int, world_size: int, port: int, threads: int, timeout_s: float) -> None:
    """Join a `world_size`-rank gloo process group on 127.0.0.1:`port` as `rank`, with
    `threads` intra-op threads and a collective timeout of `timeout_s` seconds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    url = f"tcp://127.0.0.1:{port}"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo", init_method=url, rank=rank, world_size=world_size, timeout=timeout
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out_dir: str,
    threads: int,
    collective_timeout_s: float,
    args: tuple[Any, ...],
    environ: dict[str, str],
    launcher: int,
) -> None:
    exit_with(launcher)
    _take_environment(environ)
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        join_local_gloo(rank, world_size, port, threads, collective_timeout_s)
        try:
            payload = ("ok", fn(rank, world_size, *args))
        finally:
            destroy_process_group()
    except BaseException as exc:
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
    finally:
        result_path.write_bytes(pickle.dumps(payload))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` forked gloo ranks of `threads`
    intra-op threads each; the results in rank order (`fn`, `args`: picklable, module-level)."""
    import torch.multiprocessing as mp

    _preload_forkserver()
    with tempfile.TemporaryDirectory(prefix="poise-ranks-") as out_dir:
        rank_args = (fn, world_size, free_port(), out_dir, threads, collective_timeout_s, args)
        rank_args += (dict(os.environ), os.getpid())  # the caller's environment, the launcher
        procs = mp.start_processes(
            _rank_main, args=rank_args, nprocs=world_size, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not procs.join(timeout=0.1):
                if time.monotonic() > deadline:
                    raise RankFailedError(f"ranks did not finish within {timeout_s:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise RankFailedError(_first_error(out_dir, world_size) or str(exc)) from None
        finally:
            for proc in procs.processes:
                if proc.is_alive():
                    proc.kill()
        results = []
        for rank in range(world_size):
            status, value = pickle.loads((Path(out_dir) / f"rank{rank}.pkl").read_bytes())
            if status != "ok":
                raise RankFailedError(f"rank {rank}: {value}")
            results.append(value)
        return results


def start_forked(
    target: Callable[..., int],
    *args: Any,
    name: str | None = None,
    environ: dict[str, str] | None = None,
) -> BaseProcess:
    """Start picklable `target(*args)` in a process forked from the fork server, with
    `environ` (default: the caller's now) and the caller's current standard output and error
    (the server's own may be gone: a test's captured output). Its `exitcode`: the int `target`
    returns; 1 on an exception (traceback on standard error); -N on signal N."""
    _preload_forkserver()
    streams = (_PassedFd(1), _PassedFd(2))
    env = dict(os.environ if environ is None else environ)
    proc = multiprocessing.get_context("forkserver").Process(
        target=_forked_main, args=(target, args, env, streams, os.getpid()), name=name
    )
    proc.start()
    return proc


class _PassedFd:
    """A file descriptor of the caller, duplicated into the forked process as it starts."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # only while a process is being started: the fd travels to it through the fork server
        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    """The descriptor a `_PassedFd` arrived as in the forked process."""
    return int(dup.detach())


def _forked_main(
    target: Callable[..., int],
    args: tuple[Any, ...],
    environ: dict[str, str],
    streams: tuple[int, int],
    launcher: int,
) -> None:
    """In the forked process: take the caller's streams and environment, run, exit."""
    exit_with(launcher)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, own in zip(streams, (1, 2), strict=True):
        os.dup2(fd, own)
        os.close(fd)
    _take_environment(environ)
    sys.exit(target(*args))


def exit_with(launcher: int, every_s: float = 1.0) -> None:
    """In a forked process: end this process (SIGTERM) and its fork server once the process
    `launcher` is gone, checked every `every_s` seconds on a daemon thread."""
    server = os.getppid()  # the fork server, alive now

    def watch() -> None:
        while _alive(launcher):
            time.sleep(every_s)
        if server != launcher and os.getppid() == server:  # no launch can reach it now
            with contextlib.suppress(OSError):
                os.kill(server, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="poise-exit-with-launcher", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (its `/proc` state, else whether it
    can be signalled)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    return fields is None or fields[0] != "Z"  # no /proc: the signal's answer


def proc_stat(pid: int) -> list[str] | None:
    """The fields of `/proc/PID/stat` after the command's name (state, parent's pid, ...);
    None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def warm_fork_server() -> None:
    """Start the fork server (its imports take seconds) on a daemon thread, so that the
    caller's work until its first `start_forked` or `run_ranks` overlaps them."""
    from multiprocessing import forkserver

    _preload_forkserver()
    threading.Thread(
        target=forkserver.ensure_running, name="poise-fork-server", daemon=True
    ).start()


def _preload_forkserver() -> None:
    """Name the fork server's imports; it starts (importing them) at the first rank's start."""
    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))


def _take_environment(environ: dict[str, str]) -> None:
    """Make this process's environment the caller's `environ` (the fork server's is older)."""
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def _first_error(out_dir: str, world_size: int) -> str | None:
    for rank in range(world_size):
        path = Path(out_dir) / f"rank{rank}.pkl"
        if path.exists():
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                return f"rank {rank}: {value}"
    return None
