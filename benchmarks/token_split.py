"""Host time of the per-step token split, the runtime's one MoE layer at a time.

    .venv/bin/python benchmarks/token_split.py          # ~10 s

With a plan that replicates experts, every rank's dispatcher splits each replicated expert's
tokens among its holders by the step's counts (`Assignment.split`, `poise.core.token_split`)
in every forward of every MoE layer, after the counts' all-gather and before the tokens'
all-to-all: host work on the step's critical path. Per shape (experts E over devices D, a plan
with R replicated experts in the layer; the counts of one step, seeded), the median time of
`Assignment.split` of one layer, and, for a ratio within the run, the water-fill of one expert's
holders both ways: `fill_row` (Python floats, what the runtime's one layer takes) against
`water_fill` (NumPy over rows, what the cost model's many layers take), on the same rows.

One JSON line: per shape `split_us` (one layer), `fill_row_us`, `water_fill_us` and their ratio
`numpy_over_python`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from poise.core.placement import Assignment, Placement
from poise.core.token_split import fill_row, water_fill

SHAPES = ((16, 2, 1), (32, 2, 2), (32, 4, 2), (64, 8, 2), (256, 8, 4))  # E, D, replicas a device


def plan_with_replicas(experts: int, devices: int, per_device: int, seed: int = 0):
    """One layer: experts homed round-robin, `per_device * devices / 2` of them replicated once
    on another device; `Assignment.to_home` splitting by counts; one step's counts `[1, D, E]`."""
    rng = np.random.default_rng(seed)
    homes = np.array([[e % devices for e in range(experts)]])
    slots = experts // devices + per_device
    placement = Placement.from_homes(homes, devices, slots)
    copies = placement.copies.copy()
    for e in range(per_device * devices // 2):
        copies[0, (homes[0, e] + 1 + rng.integers(devices - 1)) % devices, e] = 1
    placement = Placement(placement.home, copies, slots)
    assignment = Assignment.to_home(placement).with_split(True)
    counts = rng.integers(0, 200, (1, devices, experts))
    return placement, assignment, counts


def median_us(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """The median over `repeats` of the mean microseconds of `inner` calls of `fn`."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t0) / inner * 1e6)
    return float(np.median(runs))


def measure(experts: int, devices: int, per_device: int, repeats: int, inner: int) -> dict:
    """One shape's figures (module docstring)."""
    placement, assignment, counts = plan_with_replicas(experts, devices, per_device)
    replicated = int(((placement.copies[0] > 0).sum(axis=0) > 1).sum())
    split_us = median_us(partial(assignment.split, placement, counts), repeats, inner)
    base = np.random.default_rng(1).integers(0, 5_000, devices).astype(np.float64)
    total = float(counts[0].sum() / experts)
    python = median_us(lambda: fill_row(base.tolist(), total, True), repeats, 50)
    numpy_ = median_us(lambda: water_fill(base[None], np.array([total]), True), repeats, 50)
    return {
        "experts": experts,
        "devices": devices,
        "replicated": replicated,
        "split_us": round(split_us, 1),
        "fill_row_us": round(python, 2),
        "water_fill_us": round(numpy_, 2),
        "numpy_over_python": round(numpy_ / python, 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=20)
    args = p.parse_args(argv)
    shapes = [measure(e, d, r, args.repeats, args.inner) for e, d, r in SHAPES]
    print(json.dumps({"bench": "token_split", "shapes": shapes}))


if __name__ == "__main__":
    main()
