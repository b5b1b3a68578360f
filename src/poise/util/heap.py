"""Keep freed heap memory for reuse, so planning does not page-fault (glibc only).

A planner call allocates and frees dozens of `[L, D, E]` float64 temporaries (512 KiB each at
8 layers x 32 devices x 256 experts). With glibc's defaults, blocks that large are served by
`mmap` and returned to the kernel on `free`, or the top of the heap is trimmed once more than
twice the (dynamic) mmap threshold is free; either way the next call touches fresh pages and
pays a minor page fault per 4 KiB. On the planner benchmark (`benchmarks/planner.py`,
zipf-256x32) `auto` took about 6,700 faults per call, about a third of its time.

`retain_freed_memory()` sets glibc's `M_MMAP_THRESHOLD` to 32 MiB (the ceiling glibc's own
dynamic threshold reaches) and `M_TRIM_THRESHOLD` to 64 MiB: blocks below 32 MiB come from the
heap and up to 64 MiB of freed memory stays mapped for the next call. The cost is that much
resident memory kept after a peak. The setting is process-wide, so Poise applies it only in
its own processes: the `poise` command (`poise.cli.main`), the training ranks
(`poise.train.__main__`) and the benchmarks that time planning. A program that embeds the
planner may call it too; elsewhere than glibc (macOS, musl) it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 64 * 2**20

_applied = False


def retain_freed_memory() -> bool:
    """Tune glibc's allocator as the module docstring says; True if it took effect (also on
    later calls), False where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no glibc: musl has no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    _applied = ok
    return ok
