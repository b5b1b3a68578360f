"""Seconds per routed token of one expert, timed in its own turns beside training runs.

The ideal of a measured run (`poise.report.ideal`) prices the slowest rank's excess rows at `c`,
the seconds of one routed token's expert forward and backward. Timed alone before and after the
runs (`poise.calibrate.experts.expert_seconds_per_token`), `c` for the same experts on a shared
2-core host read 15-32 us within one day: the machine's other work moves it as much as it moves
the runs, but not at the same moments, and the ideal moved by about 30% with it.

Timed in turns, the clock is one more participant in the runs' counter file
(`poise.train.turns`; `in_turns(..., companions=[...])`): at every `every`-th step from `skip`
on, while the runs wait, it times one sweep (forward + backward at each row count, the order
reversed every other sweep, at the intra-op threads of one of the runs' ranks); at the other
steps it hands the turn on at once. Its samples thus meet the machine the runs' steps meet,
within seconds of them.

    clock = partial(expert_seconds_in_turns, turns, steps=100, d_model=128, d_expert=1024,
                    experts_per_rank=8, skip=12)
    *runs, timed = in_turns(cfgs, turns, train, companions=[clock])
    c = timed["c_s"]

`c_s` is the slope of the least-squares line through the medians per row count (a per-call
overhead, the intercept, is left out, as `expert_seconds_per_token` does); `c_sweeps_s` gives
each sweep's own slope, so the spread of `c` within the run can be read.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from poise.calibrate.experts import expert_workload
from poise.core.errors import ConfigError
from poise.train.turns import StepTurns

CLOCK_ROWS = (1024, 4096)  # rows per sweep: the two ends of `poise.calibrate.experts.ROWS`
WARMUP_SWEEPS = 2  # untimed, before the runs start


def expert_seconds_in_turns(
    turns: Path,
    slot: int,
    slots: int,
    *,
    steps: int,
    d_model: int,
    d_expert: int,
    experts_per_rank: int,
    activation: str = "swiglu",
    skip: int = 0,
    every: int = 5,
    rows: tuple[int, ...] = CLOCK_ROWS,
    threads: int = 1,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Time `c` in slot `slot` of `slots` of the counter file `turns` over the runs' `steps`
    steps (module docstring), at `threads` intra-op threads (those of one of the runs' ranks).
    Returns `{"c_s", "intercept_s", "rows", "times_s", "sweeps", "c_sweeps_s"}`. Restores the
    caller's thread count."""
    import torch

    if len(rows) < 2 or every < 1 or threads < 1 or not 0 <= skip < steps:
        raise ConfigError(
            f"need 2 or more row counts, every >= 1, threads >= 1 and 0 <= skip < steps, got "
            f"{list(rows)}, {every}, {threads}, {skip} and {steps}",
            field="expert_seconds_in_turns",
        )
    callers_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    samples: dict[int, list[float]] = {n: [] for n in rows}
    turn = StepTurns.open(turns, slot, slots, rank=0, group=None, timeout_s=timeout_s)
    try:
        run = expert_workload(d_model, d_expert, experts_per_rank, activation=activation, rows=rows)
        for _ in range(WARMUP_SWEEPS):
            for n in rows:
                run(n)
        turn.arrive()
        for step in range(steps):
            turn.wait(step)
            if step >= skip and (step - skip) % every == 0:
                sweep = len(samples[rows[0]])
                for n in rows if sweep % 2 == 0 else tuple(reversed(rows)):
                    t0 = time.perf_counter()
                    run(n)
                    samples[n].append(time.perf_counter() - t0)
            turn.hand_over(step)
        turn.finish(steps)
    except BaseException:
        turn.abandon()
        raise
    finally:
        turn.close()
        torch.set_num_threads(callers_threads)
    times = [statistics.median(samples[n]) for n in rows]
    slope, intercept = np.polyfit(list(rows), times, 1)
    per_sweep = np.array([samples[n] for n in rows])  # [rows, sweeps]
    sweep_slopes = np.polyfit(list(rows), per_sweep, 1)[0]
    return {
        "c_s": float(slope),
        "intercept_s": float(intercept),
        "rows": list(rows),
        "times_s": times,
        "sweeps": int(per_sweep.shape[1]),
        "c_sweeps_s": [float(x) for x in sweep_slopes],
    }


__all__ = ["CLOCK_ROWS", "expert_seconds_in_turns"]
