"""AdamW over stacked expert tensors: the per-tensor loop against PyTorch's fused kernel, 1 thread.

    .venv/bin/python benchmarks/adamw_kernels.py          # ~20 s

`ep_step`'s expert tensors on one rank (4 layers x 3 matrices `[18, 128, 1024]`: 16 home and 2
spare slots, 28 M parameters), one intra-op thread, fp32. Per variant and kernel, 6 AdamW steps
on fresh random gradients (the first untimed); the median step. The variants differ in how many
leading slots of each tensor get zero gradients every step, and so keep zero moments: none; 13
of 18 (under skewed routing most of a rank's experts receive no token, as `ep_step`'s static
model on the SmartMoE-AE loads, where 13 of 18 slots of a layer had none); all 18.

Kernels: `loop`, `HomeRowsAdamW(fused=False)` (PyTorch's per-tensor AdamW, what
`torch.optim.AdamW` runs on the CPU by default); `fused`, `HomeRowsAdamW` as `poise train`
builds it (the fused kernel). The line also times `sqrt` over 9.4 M zeros against as many
positive floats: the per-tensor loop takes `sqrt` of the second moments, and the slow path
there on zeros is what makes idle experts cost optimizer time.

One JSON line: per variant the median ms of each kernel and their ratio, the sqrt timings,
the load average before and after.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from poise.runtime.home_optimizer import HomeRowsAdamW

SHAPES = [(18, 128, 1024), (18, 128, 1024), (18, 1024, 128)] * 4
STEPS = 6


def step_ms(zero_slots: int, fused: bool) -> float:
    """Median ms of an AdamW step over `SHAPES` with `zero_slots` leading slots of zero
    gradient in every tensor."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in SHAPES]
    opt = HomeRowsAdamW(params, lr=1e-4, fused=fused)
    times = []
    for _ in range(STEPS):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            g[:zero_slots] = 0.0
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def sqrt_ms(values: torch.Tensor) -> float:
    torch.sqrt(values)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.sqrt(values)
    return (time.perf_counter() - t0) / 5 * 1e3


def main() -> None:
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    variants = {}
    for zero_slots in (0, 13, 18):
        loop = step_ms(zero_slots, fused=False)
        fused = step_ms(zero_slots, fused=True)
        variants[f"zero_slots_{zero_slots}"] = {
            "loop_ms": round(loop, 1),
            "fused_ms": round(fused, 1),
            "loop_over_fused": round(loop / fused, 2),
        }
    n = 18 * 128 * 1024 * 4
    line = {
        "bench": "adamw_kernels",
        "params": sum(a * b * c for a, b, c in SHAPES),
        "threads": 1,
        **variants,
        "sqrt_zeros_ms": round(sqrt_ms(torch.zeros(n)), 1),
        "sqrt_positive_ms": round(sqrt_ms(torch.rand(n) + 0.1), 1),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
