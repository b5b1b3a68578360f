"""The planner's worker process: `python -m poise.runtime.planner.worker [--priority P] [MODULE
...]`, started by `background.BackgroundPlanner` (process mode), one per planning rank.

Protocol on its standard input and output (binary, nothing else is written there: the worker's
own prints go to standard error): each request is an 8-byte little-endian length and a pickled
callable taking no argument (`functools.partial(run_job, job)`); each reply is the same framing
around a pickled `("ok", value, wall_s, cpu_s)` or `("error", exception, traceback_text)`. The
worker runs with one BLAS thread at the lowest CPU priority (`lowest_priority`), imports the
MODULEs (the jobs' code) before its first request, so that no job pays for them, and exits at
the end of its input (its parent closed the pipe, or exited). It ignores SIGINT: a Ctrl-C at
the terminal reaches its whole process group, and the training rank that owns the worker
answers it (and ends the worker by ending its input), so the worker prints no
`KeyboardInterrupt` traceback of its own.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import sys
import time
import traceback
from typing import IO, Any

HEADER = 8  # bytes of a frame's length
PRIORITIES = ("nice", "idle")  # `lowest_priority`'s kinds, `nice` the default


def lowest_priority(kind: str = "nice") -> str:
    """Put this process at the lowest CPU priority and say which it got: `nice` (nice 19: a
    small share of a busy core), or `idle` (Linux's SCHED_IDLE: it runs only on a core no
    other task wants, and a rank that wakes takes the core from it at once; nice 19 where the
    OS has no SCHED_IDLE), or `none` (the OS refused both). Nice is the default: beside ranks
    that share the cores a job costs their steps about as much either way, and finishes sooner.
    """
    if kind not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {kind!r}")
    if kind == "idle" and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):  # refused: nice 19 below
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
    try:
        os.nice(19 - os.nice(0))
    except (AttributeError, OSError):
        return "none"
    return "nice"


def read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame's payload from `stream`, or None at the end of the stream."""
    header = stream.read(HEADER)
    if len(header) < HEADER:
        return None
    size = int.from_bytes(header, "little")
    payload = stream.read(size)
    return payload if len(payload) == size else None


def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(len(payload).to_bytes(HEADER, "little"))
    stream.write(payload)
    stream.flush()


def serve(requests: IO[bytes], replies: IO[bytes]) -> int:
    """Answer requests until the end of `requests` (module docstring)."""
    while (payload := read_frame(requests)) is not None:
        reply: tuple[Any, ...]
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            value = pickle.loads(payload)()
            reply = ("ok", value, time.perf_counter() - t0, time.process_time() - c0)
        except BaseException as exc:  # every failure goes back to the parent
            reply = ("error", exc, traceback.format_exc())
        try:
            data = pickle.dumps(reply)
        except Exception as exc:  # a value or exception that does not pickle
            data = pickle.dumps(("error", RuntimeError(repr(exc)), traceback.format_exc()))
        write_frame(replies, data)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Serve requests at the lowest priority (`--priority idle|nice`), importing the modules
    named in `argv` first (module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kind = "nice"
    if args and args[0].startswith("--priority="):
        kind = args.pop(0).split("=", 1)[1]
    replies = sys.stdout.buffer
    sys.stdout = sys.stderr  # prints must not corrupt the replies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owning rank answers a Ctrl-C
    lowest_priority(kind)
    for module in args:
        importlib.import_module(module)
    return serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    sys.exit(main())
