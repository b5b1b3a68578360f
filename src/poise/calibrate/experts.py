"""Seconds per routed token of one expert's forward and backward on this machine.

    c = expert_seconds_per_token(d_model=128, d_expert=1024, slots=8)["c_s"]

`poise.nn.Experts` (the model's activation, SwiGLU by default) at one intra-op thread, rows
spread evenly over `slots`, timed forward + backward at 1,024 to 4,096 rows; `c_s` is the slope
of the least-squares line through the medians, so a fixed per-call overhead (the intercept) is
left out. The ideal of a measured run (`poise.report.ideal`) multiplies it by the token-expert
pairs the slowest rank computed above the mean.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from poise.core.errors import ConfigError

ROWS = (1024, 2048, 3072, 4096)


def expert_seconds_per_token(
    d_model: int,
    d_expert: int,
    slots: int,
    *,
    activation: str = "swiglu",
    repeats: int = 15,
    rows: tuple[int, ...] = ROWS,
) -> dict[str, Any]:
    """Fit `seconds = c_s * rows + intercept_s` for forward + backward of `slots` experts.

    Returns `{"c_s", "intercept_s", "rows", "times_s"}` (`times_s`: the median of `repeats`
    timings per row count, `interleaved_medians`). Restores the caller's thread count."""
    import torch

    if slots < 1 or repeats < 1 or len(rows) < 2:
        raise ConfigError(
            f"need slots >= 1, repeats >= 1 and 2 or more row counts, got {slots}, {repeats}, "
            f"{list(rows)}",
            field="expert_seconds_per_token",
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = expert_workload(d_model, d_expert, slots, activation=activation, rows=rows)
        times = interleaved_medians(run, rows, repeats)
    finally:
        torch.set_num_threads(threads)
    slope, intercept = np.polyfit(list(rows), times, 1)
    return {
        "c_s": float(slope),
        "intercept_s": float(intercept),
        "rows": list(rows),
        "times_s": times,
    }


def expert_workload(
    d_model: int,
    d_expert: int,
    slots: int,
    *,
    activation: str = "swiglu",
    rows: Sequence[int] = ROWS,
) -> Callable[[int], None]:
    """`run(n)`: one forward + backward of `slots` `poise.nn.Experts` over `n` rows (`n` one of
    `rows`) spread evenly over the slots, inputs `[n, d_model]` made once here (seed 0). The
    caller sets the thread count it times at."""
    import torch

    from poise.nn.experts import Experts

    gen = torch.Generator().manual_seed(0)
    experts = Experts(slots, d_model, d_expert, activation)
    inputs = {}
    for n in rows:
        counts = [n // slots] * slots
        counts[0] += n - sum(counts)
        x = torch.randn(n, d_model, generator=gen, requires_grad=True)
        inputs[n] = (x, torch.randn(n, d_model, generator=gen), counts)

    def run(n: int) -> None:
        x, gy, counts = inputs[n]
        experts(x, counts).backward(gy)
        experts.zero_grad(set_to_none=True)
        x.grad = None

    return run


def interleaved_medians(
    run: Callable[[int], None],
    rows: Sequence[int],
    repeats: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """The median seconds of `run(n)` per `n` in `rows`, over `repeats` sweeps through every
    row count (the order reversed on every other sweep) after `warmup` untimed sweeps.

    Interleaved, a stretch of the machine running slower (another process, a rank still
    tearing down) slows a few samples of every row count alike instead of all the samples of
    one, so it moves neither the medians nor the slope. Timed one row count after another, as
    before, the first fit after training runs measured 35 us a row where the next four
    measured 23-25 (skewed's experts, 2-core machine)."""
    samples: dict[int, list[float]] = {n: [] for n in rows}
    for sweep in range(warmup + repeats):
        for n in rows if sweep % 2 == 0 else list(reversed(rows)):
            t0 = clock()
            run(n)
            if sweep >= warmup:
                samples[n].append(clock() - t0)
    return [statistics.median(samples[n]) for n in rows]


__all__ = ["ROWS", "expert_seconds_per_token", "expert_workload", "interleaved_medians"]
