"""Counting routed assignments on the device without a host synchronisation.

`torch.bincount` on a CUDA tensor reads the input's minimum and maximum on the host to size its
output: two synchronisations per call, measured with `torch.cuda.set_sync_debug_mode`
(`benchmarks/cuda_syncs.py`). Here the size is known (`n`), so a scatter-add into a zeroed
`[n]` counts the same values and the GPU runs ahead.
"""

from __future__ import annotations

import torch


def count_values(values: torch.Tensor, n: int) -> torch.Tensor:
    """`[n]` int64: how often each of 0 .. n-1 occurs in `values` (integers, any shape, every
    value in [0, n)); `torch.bincount(values.reshape(-1), minlength=n)` without its host
    synchronisation."""
    flat = values.reshape(-1).long()
    counts = torch.zeros(n, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.long))


__all__ = ["count_values"]
