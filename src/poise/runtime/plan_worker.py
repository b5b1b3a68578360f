"""The planner's worker process: `python -m poise.runtime.plan_worker [MODULE ...]`, started by
`poise.runtime.planner.BackgroundPlanner` (process mode), one per planning rank.

Protocol on its standard input and output (binary, nothing else is written there: the worker's
own prints go to standard error): each request is an 8-byte little-endian length and a pickled
callable taking no argument (`functools.partial(run_job, job)`); each reply is the same framing
around a pickled `("ok", value, wall_s, cpu_s)` or `("error", exception, traceback_text)`. The
worker runs at the lowest CPU priority (nice 19) with one BLAS thread, imports the MODULEs
before its first request (the jobs' code), and exits at the end of its input (its parent
closed the pipe, or exited). It ignores SIGINT: a Ctrl-C at the terminal reaches its whole
process group, and the training rank that owns the worker answers it (and ends the worker by
ending its input), where the worker used to print a `KeyboardInterrupt` traceback of its own.
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


def read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame's payload from `stream`, or None at the end of the stream."""
    header = stream.read(HEADER)
    if len(header) < HEADER:
        return None
    size = int.from_bytes(header, "little")
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return payload


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
    """Serve requests; the modules named in `argv` are imported first (the jobs' code, so that
    the first job does not pay for the imports)."""
    replies = sys.stdout.buffer
    sys.stdout = sys.stderr  # prints must not corrupt the replies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owning rank answers a Ctrl-C
    with contextlib.suppress(AttributeError, OSError):
        os.nice(19)
    for module in sys.argv[1:] if argv is None else argv:
        importlib.import_module(module)
    return serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    sys.exit(main())
