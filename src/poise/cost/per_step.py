"""A plan priced on every step of a window at once, to compare with what those steps measured.

The cost model prices one plan on one load pattern. The live runtime prices plans on each step it
ran (`counts[S, L, D, E]`) and compares the figures with what those steps measured. A layer's
phases depend on its own counts only, so the steps' layers are laid end to end as `S * L` layers
of the plan (or of each step's own plan, where steps ran different replicas) and priced in one
call; where the steps' plans route inside groups of different sizes (one pricer holds one group
size, `Assignment.from_layers`), the steps are priced one group size at a time
(`group_size_parts`) and put back in step order. The figures a live step can change:

    busy      = expert forward + backward, dispatch + combine with the dispatcher's host work
    transfers = Trans + Agg (before any overlap)

NumPy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any, TypeAlias

import numpy as np

from poise.core.placement import Assignment, Placement, Plan
from poise.cost.host import busiest_sharing, dispatch_rows
from poise.cost.model import CostModel
from poise.cost.phases import PhaseTimes

# what the steps ran: one plan for every step, or one per step (replicas retargeted each step)
Ran: TypeAlias = Plan | Sequence[Plan]


def plans_of(plan: Ran) -> Sequence[Plan]:
    """`plan` as a sequence of plans."""
    return [plan] if isinstance(plan, Plan) else plan


def steps_as_layers(cost: CostModel, plan: Ran, counts: np.ndarray) -> tuple[Any, np.ndarray]:
    """A pricer of `plan` on every step of `counts[S, L, D, E]`, the steps' layers laid end to
    end as `S * L` layers (of step s's plan where one is given per step), and those loads
    `[S * L, D, E]`."""
    S, L = counts.shape[:2]
    loads = counts.reshape(S * L, *counts.shape[2:]).astype(np.float64)
    if isinstance(plan, Plan):
        layers = np.tile(np.arange(L), S)
        placement = plan.placement.take_layers(layers)
        assignment = plan.assignment.take_layers(layers)
    else:
        if len(plan) != S:
            raise ValueError(f"{len(plan)} plans for {S} steps")
        placement = Placement(
            np.concatenate([p.placement.home for p in plan]),
            np.concatenate([p.placement.copies for p in plan]),
            plan[0].placement.slots_per_device,
        )
        assignment = Assignment.from_layers([(p.assignment, i) for p in plan for i in range(L)])
    return cost.pricer(placement, assignment), loads


def group_size_parts(plan: Ran) -> list[np.ndarray]:
    """The step indices of `plan` split so that each part's grouped plans share one group size
    (group-free plans join the first part): one part, all steps, for a single plan or plans of
    at most one group size."""
    plans = plans_of(plan)
    sizes = [p.assignment.group_size if p.assignment.grouped else 0 for p in plans]
    distinct = sorted({g for g in sizes if g})
    if len(distinct) <= 1:
        return [np.arange(len(plans))]
    first = distinct[0]
    return [
        np.array([s for s, g in enumerate(sizes) if g == size or (g == 0 and size == first)])
        for size in distinct
    ]


def _step_layer_rows(steps: np.ndarray, layers: int) -> np.ndarray:
    """`[len(steps) * layers]` rows of the `S * L` layout that hold `steps`' layers."""
    return (steps[:, None] * layers + np.arange(layers)[None, :]).reshape(-1)


def step_phases(
    cost: CostModel, plan: Ran, counts: np.ndarray
) -> tuple[PhaseTimes, np.ndarray, np.ndarray]:
    """`(phases [S * L], device_load [S * L, D], loads [S * L, D, E])` of `plan` on every step
    of `counts[S, L, D, E]`."""
    parts = group_size_parts(plan)
    if len(parts) == 1:
        pricer, loads = steps_as_layers(cost, plan, counts)
        phases, device_load = pricer.phases(loads)
        return phases, device_load, loads
    plans, L = plans_of(plan), counts.shape[1]
    priced = [step_phases(cost, [plans[s] for s in part], counts[part]) for part in parts]
    order = np.argsort(np.concatenate([_step_layer_rows(part, L) for part in parts]))
    phases = PhaseTimes(
        **{
            f.name: np.concatenate([getattr(ph, f.name) for ph, _, _ in priced])[order]
            for f in fields(PhaseTimes)
        }
    )
    device_load = np.concatenate([d for _, d, _ in priced])[order]
    loads = np.concatenate([x for _, _, x in priced])[order]
    return phases, device_load, loads


def busy_and_transfers_by_layer(ph: PhaseTimes) -> tuple[np.ndarray, np.ndarray]:
    """`(busy, transfers)` per priced layer (module docstring)."""
    busy = ph.expert_fwd_s + ph.expert_bwd_s + ph.dispatch_s + ph.combine_s
    busy = busy + ph.dispatch_host_fwd_s + ph.dispatch_host_bwd_s
    return busy, ph.trans_s + ph.agg_s


def busy_and_transfers(ph: PhaseTimes) -> tuple[float, float]:
    """`(busy, transfers)` seconds of one step's phases, summed over layers."""
    busy, transfers = busy_and_transfers_by_layer(ph)
    return float(busy.sum()), float(transfers.sum())


def live_parts(cost: CostModel, plan: Ran, counts: np.ndarray) -> np.ndarray:
    """`[S, 2]` model seconds per step of `plan` on `counts[S, L, D, E]`, summed over layers:
    `busy` and `transfers` (module docstring)."""
    if len(counts) == 0:
        return np.zeros((0, 2))
    busy, transfers = busy_and_transfers_by_layer(step_phases(cost, plan, counts)[0])
    return np.stack([busy, transfers], axis=1).reshape(len(counts), -1, 2).sum(axis=1)


def predicted_phases(cost: CostModel, plan: Ran, counts: np.ndarray) -> np.ndarray:
    """`[S, 4]` model figures per step of `plan` on `counts[S, L, D, E]`, summed over layers:
    expert forward seconds, dispatch + combine link seconds (forward), Trans + Agg seconds, and
    the rows that bound the dispatchers' host work (`cost.host.busiest_sharing` of
    `cost.host.dispatch_rows`, sent + received)."""
    if len(counts) == 0:
        return np.zeros((0, 4))
    phases, device_load, loads = step_phases(cost, plan, counts)
    rows = busiest_sharing(dispatch_rows(loads, device_load), cost.cluster.host.shared_cores)
    per_layer = np.stack(
        [
            phases.expert_fwd_s,
            phases.dispatch_s + phases.combine_s,
            phases.trans_s + phases.agg_s,
            rows,
        ],
        axis=1,
    )  # [S * L, 4]
    return per_layer.reshape(len(counts), -1, 4).sum(axis=1)


def device_compute(cost: CostModel, plan: Ran, counts: np.ndarray) -> np.ndarray:
    """`[S, D]` the model's forward expert seconds of every device under `plan` on each step of
    `counts[S, L, D, E]`, summed over layers (`PlanPricer.device_compute_s`)."""
    parts = group_size_parts(plan)
    if len(parts) > 1:
        plans = plans_of(plan)
        out = np.zeros((len(counts), counts.shape[2]))
        for part in parts:
            out[part] = device_compute(cost, [plans[s] for s in part], counts[part])
        return out
    pricer, loads = steps_as_layers(cost, plan, counts)
    per_layer = pricer.device_compute_s(loads)  # [S * L, D]
    return per_layer.reshape(*counts.shape[:2], -1).sum(axis=1)


__all__ = [
    "Ran",
    "busy_and_transfers",
    "device_compute",
    "group_size_parts",
    "live_parts",
    "plans_of",
    "predicted_phases",
    "step_phases",
    "steps_as_layers",
]
