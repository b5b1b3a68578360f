"""Memory budgets: estimate what a command will allocate and refuse what cannot fit, up front.

A request of 10^6 steps x 1000 layers x 1000 devices x 1000 experts would otherwise die minutes
later in a `MemoryError` traceback. `check_fits` compares an estimate with the memory this
machine has available now and raises one `ConfigError` that states both.
"""

from __future__ import annotations

import os

from poise.core.errors import ConfigError

FRACTION = 0.8  # refuse estimates above this share of the available memory


def available_memory_bytes() -> float:
    """Memory available to a new allocation: /proc/meminfo's MemAvailable, else the free pages,
    else the physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    for name in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            pages, page = os.sysconf(name), os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            continue
        if pages > 0 and page > 0:
            return float(pages * page)
    return float(2**40)  # unknown: do not refuse on a guess


def human_bytes(n: float) -> str:
    """`1.5 GiB`, `7.3 TiB`: binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"


def check_fits(need_bytes: float, what: str, *, source: str, field: str, hint: str = "") -> None:
    """Raise `ConfigError` if `need_bytes` exceeds `FRACTION` of the available memory; the
    message states the estimate, what it is for, and the memory available."""
    have = available_memory_bytes()
    if need_bytes > FRACTION * have:
        tail = f"; {hint}" if hint else ""
        raise ConfigError(
            f"{what} needs about {human_bytes(need_bytes)} of memory, more than this machine "
            f"has available ({human_bytes(have)}){tail}",
            source=source,
            field=field,
        )
