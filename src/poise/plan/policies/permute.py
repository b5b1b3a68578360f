"""`permute`: SmartMoE's online expert re-placement (Zhai et al., USENIX ATC '23).

As in the public SmartMoE artifact's greedy mapping, per layer:

1. Expert load `h[e]`: the mean of the last `window` steps of `ctx.history[S, L, E]` (tokens
   per expert and step, summed over sources); with no history, `loads[L, D, E]` summed over
   sources.
2. Experts sorted by `h` descending. Tie order (our choice; the artifact's unstable
   `argsort` leaves it unspecified): a stable sort, so the lower expert id goes first.
3. Longest-processing-time greedy with `ceil(E / D)` expert slots per device: each expert goes
   to the device with the least accumulated load among those with a free slot (lowest device
   index on ties); stickiness: if its current device has a free slot and ties that minimum, it
   stays there.
4. The new homes are adopted only if their largest device load is strictly below that of the
   current homes (both on `h`); otherwise the layer keeps its current homes.

Homes only: no replicas, remote tokens go to the home (`Assignment.to_home`); every home change
is a migration, priced by `finish_plan`. Replicas of a previous plan from another policy are
dropped. With more devices than experts there is nothing to permute and the static placement
(DeepSpeed-MoE's expert-parallel groups and their routing, `poise.core.static_ep`) is kept.

Worked example (one layer, 4 experts on 2 devices, static homes [0, 0, 1, 1]):
`h = [10, 8, 1, 1]` gives device loads [18, 2]; the greedy places 0 on device 0 (tie, sticky),
1 on device 1, 2 on device 1 (load 8 < 10), 3 on device 0 (device 1 full): homes [0, 1, 1, 0],
loads [11, 9]; 11 < 18, so it is adopted. With `h = [10, 1, 1, 8]` the greedy reaches [11, 9]
again, but the static loads are already [11, 9]: rejected, the homes stay.

Option (`ctx.option("permute", ...)`): `window` (steps of history, default 10).
"""

from __future__ import annotations

import math

import numpy as np

from poise.core.placement import Assignment, Placement, Plan
from poise.core.static_ep import static_assignment
from poise.plan.policies.base import (
    PlanContext,
    finish_plan,
    register,
    start_homes,
    static_placement,
)
from poise.plan.policies.lpt import lpt_assign


def expert_loads(loads: np.ndarray, history: np.ndarray | None, window: int) -> np.ndarray:
    """`h[L, E]`: the mean over the last `window` steps of `history[S, L, E]` (tokens routed to
    each expert per step), or `loads[L, D, E]` summed over sources when there is no history."""
    L, _, E = loads.shape
    if history is not None and len(history) > 0 and np.asarray(history).shape[1:] == (L, E):
        recent = np.asarray(history, dtype=np.float64)[-max(1, int(window)) :]
        return recent.mean(axis=0)
    return np.asarray(loads, dtype=np.float64).sum(axis=1)


def greedy_homes(h: np.ndarray, current: np.ndarray, devices: int, capacity: int) -> np.ndarray:
    """SmartMoE's greedy mapping, vectorised over layers.

    `h[L, E]` expert loads, `current[L, E]` current homes -> new homes `[L, E]` with at most
    `capacity` experts per device (see the module docstring for the order and ties).

    >>> greedy_homes(np.array([[10.0, 8, 1, 1]]), np.array([[0, 0, 1, 1]]), 2, 2).tolist()
    [[0, 1, 1, 0]]
    """
    L, E = h.shape
    if capacity * devices < E:
        raise ValueError(f"{E} experts do not fit {devices} devices x {capacity}")
    order = np.argsort(-h, axis=1, kind="stable")
    # Every layer at once, blocks of expert ranks solved together (`lpt.lpt_assign`).
    devs, _ = lpt_assign(
        np.take_along_axis(h, order, axis=1),
        devices,
        capacity,
        sticky=np.take_along_axis(np.asarray(current, dtype=np.int64), order, axis=1),
    )
    homes = np.empty((L, E), dtype=np.int64)
    np.put_along_axis(homes, order, devs, axis=1)
    return homes


def device_loads(h: np.ndarray, homes: np.ndarray, devices: int) -> np.ndarray:
    """`[L, D]` sum of `h[L, E]` over the experts homed on each device."""
    L = h.shape[0]
    flat = (np.arange(L)[:, None] * devices + homes).ravel()
    # bincount adds each device's loads in expert order from 0.0, as np.add.at did.
    return np.bincount(flat, weights=h.ravel(), minlength=L * devices).reshape(L, devices)


@register("permute", builds_on="homes")
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """SmartMoE's re-placement; see the module docstring. `loads`: `[L, D, E]`."""
    L, D, E = loads.shape
    if D > E:
        placement = static_placement(L, E, D, ctx.slots_per_device)
        return finish_plan(
            "permute",
            placement,
            static_assignment(placement),
            loads,
            previous,
            ctx,
            {"accepted": [False] * L, "reason": "more devices than experts"},
        )
    window = int(ctx.option("permute", "window", 10))
    h = expert_loads(loads, ctx.history, window)
    current = start_homes(previous, ctx, L)
    capacity = math.ceil(E / D)
    proposed = greedy_homes(h, current, D, capacity)
    cur_max = device_loads(h, current, D).max(axis=1)
    new_max = device_loads(h, proposed, D).max(axis=1)
    accept = new_max < cur_max
    homes = np.where(accept[:, None], proposed, current)
    placement = Placement.from_homes(homes, D, ctx.slots_per_device)
    notes = {
        "accepted": accept.tolist(),
        "max_load_before": cur_max.tolist(),
        "max_load_after": np.where(accept, new_max, cur_max).tolist(),
        "window": window,
    }
    return finish_plan(
        "permute", placement, Assignment.to_home(placement), loads, previous, ctx, notes
    )
