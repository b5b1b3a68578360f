"""`poise.util.heap.retain_freed_memory`: with it, freed planning temporaries are reused instead of
page-faulted in again. Each measurement runs in a fresh interpreter (the setting is
process-wide and the allocator's state matters)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from poise.util.heap import retain_freed_memory

PROBE = """
import resource, sys
import numpy as np
from poise.util.heap import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def burst():  # like a planner call: several 1 MiB temporaries alive at once, then freed
    arrays = [np.ones(131072) for _ in range(8)]
    return sum(float(a[0]) for a in arrays)
burst()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    burst()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not retain_freed_memory(), reason="needs glibc's mallopt")
def test_retaining_freed_memory_removes_the_page_faults() -> None:
    default = _faults("default")
    retained = _faults("retain")
    # 20 bursts of 8 MiB: thousands of faults with glibc's defaults, next to none retained.
    assert default > 2000
    assert retained < default / 20


def test_retain_is_idempotent() -> None:
    first = retain_freed_memory()
    assert retain_freed_memory() == first
