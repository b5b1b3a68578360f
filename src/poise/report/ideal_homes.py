"""Homes that balance a fixed routing: the ideal a benchmark can run, not only compute.

    order = balanced_order(loads, devices)   # loads [L, E] -> order [L, E]
    ideal = np.take_along_axis(counts, order[None, :, None, :], axis=3)  # counts [S, L, D, E]

Static expert parallelism homes expert e on device `e * D // E` (contiguous blocks of P = E / D,
`plan.policies.base.static_homes`). `balanced_order` finds, per layer, which experts' loads
the block of each device should hold so that the devices' loads are even, as far as whole
experts allow and a local search finds: longest-processing-time greedy with P experts per
device (`plan.policies.lpt.lpt_assign`, heaviest first), then swaps of one expert between the
heaviest device and another while a swap lowers the heavier of the two (it never ends heavier
than the greedy).

Routing a trace through the re-dealt counts keeps every expert's load (the same GEMM shapes,
the same tokens per step) and only moves whole loads between the devices' blocks: static EP
then runs the trace's own work balanced, with nothing to transfer. That is the ideal of a
balancer, which cannot change how many rows each expert gets. Uniform routing (every expert
the mean load) is not: it changes the GEMMs, not only the balance (`benchmarks/expert_shapes.py`:
on a Zipf trace's loads balanced, the slowest rank's experts take 12% longer than on as many
rows in equal GEMMs; on the SmartMoE-AE sample's, 6% less).
"""

from __future__ import annotations

import numpy as np

from poise.plan.policies.lpt import lpt_assign

MAX_SWAPS = 1000  # per layer; each swap lowers the heaviest device's load or ends the search


def balanced_order(loads: np.ndarray, devices: int) -> np.ndarray:
    """`loads[L, E]` (tokens per expert) -> `order[L, E]`: device d's block of static homes,
    columns `d * P ... d * P + P - 1` (P = E / devices), takes the loads of experts
    `order[l, d * P : (d + 1) * P]` (module docstring). Raises ValueError when `devices` does
    not divide E."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {loads.shape}")
    layers, experts = loads.shape
    if devices < 1 or experts % devices:
        raise ValueError(f"{devices} devices must divide {experts} experts")
    per = experts // devices
    heaviest_first = np.argsort(-loads, axis=1, kind="stable")
    weight = np.take_along_axis(loads, heaviest_first, axis=1)
    pack, _ = lpt_assign(weight, devices, per)
    order = np.empty((layers, experts), dtype=np.int64)
    for layer in range(layers):
        blocks = [list(heaviest_first[layer][pack[layer] == d]) for d in range(devices)]
        _swap_down(blocks, loads[layer])
        order[layer] = np.concatenate(blocks)
    return order


def _swap_down(blocks: list[list[int]], load: np.ndarray) -> None:
    """Swap experts between the heaviest block and another while that lowers the heavier of
    the two (in place); at most `MAX_SWAPS` swaps."""
    for _ in range(MAX_SWAPS):
        sums = np.array([load[b].sum() for b in blocks])
        heavy = int(sums.argmax())
        best: tuple[float, int, int, int] | None = None  # (new max of the pair, other, i, j)
        for other in range(len(blocks)):
            if other == heavy:
                continue
            gap = sums[heavy] - sums[other]
            for i, a in enumerate(blocks[heavy]):
                for j, b in enumerate(blocks[other]):
                    moved = load[a] - load[b]
                    if 0 < moved < gap:
                        pair_max = max(sums[heavy] - moved, sums[other] + moved)
                        if best is None or pair_max < best[0]:
                            best = (pair_max, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        blocks[heavy][i], blocks[other][j] = blocks[other][j], blocks[heavy][i]


def device_loads(loads: np.ndarray, order: np.ndarray, devices: int) -> np.ndarray:
    """`[L, D]`: each device's load when its block of static homes takes the loads `order`
    names (`order` = `np.arange(E)` per layer: static EP)."""
    loads = np.asarray(loads, dtype=np.float64)
    ordered = np.take_along_axis(loads, np.asarray(order), axis=1)
    return ordered.reshape(loads.shape[0], devices, -1).sum(axis=2)


__all__ = ["balanced_order", "device_loads"]
