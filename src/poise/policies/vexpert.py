"""`vexpert`: FlexMoE's dynamic expert management (Nie et al., SIGMOD 2023).

What follows the paper:

- the vExpert abstraction: a logical expert is served by one or more copies, each taking a slot
  on a device (here: its home plus replicas, `Placement.copies`), and its tokens may go to any
  copy;
- an imbalance trigger: the scheduler acts only when the balance ratio (largest over mean device
  load) exceeds a threshold;
- the primitives Expand (add a copy of a hot expert), Shrink (drop a copy of a cold expert) and
  Migrate (move a copy between devices), applied between the hottest and the coldest expert;
- guidance by a cost model: an adjustment is made only if the predicted step time falls, and the
  loop stops when no adjustment helps.

Our choices (the paper's exact values and rules were not available to us):

- threshold 1.1 on the balance ratio, measured with tokens routed by `Assignment.balanced`;
- hottest expert = largest load per copy among the experts held by the most loaded device (the
  one that sets the step), coldest = smallest load per copy among experts with more than one
  copy (lowest id on ties); per layer, each round prices these candidates on that
  layer alone with `ctx.cost.price` (the schedule, Trans/Agg and migrations from the previous
  placement included) and applies the one with the lowest predicted layer time, if it is strictly
  (relative 1e-12) below the current one:
    * expand: a copy of the hottest on the least-loaded device with a free slot not holding it;
    * replace: shrink then expand in one move (FlexMoE's Expand into a slot freed by Shrink),
      needed once every slot is full;
    * migrate: move one copy of the hottest from the most loaded device to the least-loaded
      device with a free slot not holding it (the home moves with it when that was the home's
      only copy);
    * shrink: drop a copy of the coldest multi-copy expert from the non-home holder where it
      computes the fewest tokens per copy;
- at most `max_moves` (default 4 E) moves per layer; tokens follow `Assignment.balanced`.

Worked example (`tests/test_policy_vexpert.py`): 4 experts on 2 devices x 3 slots, static homes
[0, 0, 1, 1]; expert 0 gets 1000 tokens from each device, the others 10. Device loads are 2020
and 40 (balance ratio 1.96 > 1.1). Expanding expert 0 onto device 1's free slot lets device 1
keep its own 1000 tokens (loads 1020 and 1040), which saves far more compute and all-to-all time
than one expert's Trans and Agg cost, so the plan holds two copies of expert 0 and the predicted
step time falls. Single moves with strict improvement can stall where only a pair of moves would
help (e.g. a swap between two full devices); that is the greedy's nature, kept as is.

Options (`ctx.option("vexpert", ...)`): `threshold` (1.1), `max_moves` (4 E).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from poise.placement import Assignment, Placement, Plan
from poise.policies.base import PlanContext, finish_plan, register, start_placement

_REL_TOL = 1e-12


def _layer_time(
    ctx: PlanContext,
    home: np.ndarray,
    copies: np.ndarray,
    loads_l: np.ndarray,
    prev_home: np.ndarray | None,
) -> float:
    """Predicted seconds of one layer: `home[E]`, `copies[D, E]`, `loads_l[1, D, E]`."""
    placement = Placement(home[None], copies[None], ctx.slots_per_device)
    assignment = Assignment.balanced(placement, loads_l)
    migrations = None
    if prev_home is not None:
        moved = np.nonzero(prev_home != home)[0]
        if moved.size:
            migrations = np.stack(
                [np.zeros_like(moved), moved, prev_home[moved], home[moved]], axis=1
            ).astype(np.int64)
    return float(ctx.cost.price(placement, assignment, loads_l, migrations).layer_s[0])


def _pick_min(values: np.ndarray, allowed: np.ndarray) -> int | None:
    """Index of the smallest allowed value (lowest index on ties), None if none is allowed."""
    if not allowed.any():
        return None
    return int(np.where(allowed, values, np.inf).argmin())


def _candidates(
    home: np.ndarray,
    copies: np.ndarray,
    received: np.ndarray,
    slots: int,
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """The moves of one round: `(name, home[E], copies[D, E])`, each a fresh copy."""
    total = received.sum(axis=0)  # [E]
    ncopies = copies.sum(axis=0)
    per_copy = total / ncopies
    dev_load = received.sum(axis=1)  # [D]
    free = slots - copies.sum(axis=1)
    hot_device = int(dev_load.argmax())
    hot = _pick_min(-per_copy, copies[hot_device] > 0)
    assert hot is not None  # the most loaded device holds at least one expert
    multi = ncopies > 1
    cold = _pick_min(per_copy, multi)
    if cold == hot:
        cold = None

    target = _pick_min(dev_load, (free > 0) & (copies[:, hot] == 0))
    if target is not None:
        c = copies.copy()
        c[target, hot] += 1
        yield "expand", home.copy(), c

    shrink_from = None
    if cold is not None:
        per_copy_on = received[:, cold] / np.maximum(copies[:, cold], 1)
        not_home = np.arange(copies.shape[0]) != home[cold]
        shrink_from = _pick_min(per_copy_on, (copies[:, cold] > 0) & not_home)
        if shrink_from is None and copies[home[cold], cold] > 1:
            shrink_from = int(home[cold])
    if shrink_from is not None:
        shrunk = copies.copy()
        shrunk[shrink_from, cold] -= 1
        free_after = slots - shrunk.sum(axis=1)
        # Loads after the shrink are not re-routed here; the cost model prices the real move.
        swap_to = _pick_min(dev_load, (free_after > 0) & (shrunk[:, hot] == 0))
        if swap_to is not None:
            c = shrunk.copy()
            c[swap_to, hot] += 1
            yield "replace", home.copy(), c

    source = hot_device
    if target is not None and dev_load[target] < dev_load[source]:
        c = copies.copy()
        h = home.copy()
        c[source, hot] -= 1
        c[target, hot] += 1
        if h[hot] == source and c[source, hot] == 0:
            h[hot] = target
        yield "migrate", h, c

    if shrink_from is not None:
        yield "shrink", home.copy(), shrunk


def search_layer(
    ctx: PlanContext,
    home: np.ndarray,
    copies: np.ndarray,
    loads_l: np.ndarray,
    prev_home: np.ndarray | None,
    threshold: float,
    max_moves: int,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """FlexMoE's adjustment loop on one layer: `home[E]`, `copies[D, E]`, `loads_l[1, D, E]`
    -> `(home, copies, moves)`."""
    slots = ctx.slots_per_device

    def route(h: np.ndarray, c: np.ndarray) -> np.ndarray:
        placement = Placement(h[None], c[None], slots)
        return Assignment.balanced(placement, loads_l).received(placement, loads_l)[0]

    received = route(home, copies)
    dev_load = received.sum(axis=1)
    mean = dev_load.mean()
    if mean <= 0 or dev_load.max() / mean <= threshold:
        return home, copies, []
    best = _layer_time(ctx, home, copies, loads_l, prev_home)
    moves: list[str] = []
    while len(moves) < max_moves:
        choice = None
        for name, h, c in _candidates(home, copies, received, slots):
            t = _layer_time(ctx, h, c, loads_l, prev_home)
            if t < best * (1.0 - _REL_TOL) and (choice is None or t < choice[0]):
                choice = (t, name, h, c)
        if choice is None:
            break
        best, name, home, copies = choice
        moves.append(name)
        received = route(home, copies)
    return home, copies, moves


@register("vexpert")
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """FlexMoE's vExpert scheduling; see the module docstring. `loads`: `[L, D, E]`."""
    L, D, E = loads.shape
    threshold = float(ctx.option("vexpert", "threshold", 1.1))
    max_moves = int(ctx.option("vexpert", "max_moves", 4 * E))
    placement = start_placement(previous, ctx, L)
    prev = (
        previous.placement
        if previous is not None
        and previous.placement.home.shape == (L, E)
        and previous.placement.devices == D
        else None
    )
    moves: list[list[str]] = []
    for layer in range(L):
        home, copies, done = search_layer(
            ctx,
            placement.home[layer].copy(),
            placement.copies[layer].copy(),
            loads[layer : layer + 1],
            None if prev is None else prev.home[layer],
            threshold,
            max_moves,
        )
        placement.home[layer] = home
        placement.copies[layer] = copies
        moves.append(done)
    counts = {k: sum(m.count(k) for m in moves) for k in ("expand", "replace", "migrate", "shrink")}
    notes = {"moves_per_layer": [len(m) for m in moves], "moves": counts, "threshold": threshold}
    return finish_plan(
        "vexpert", placement, Assignment.balanced(placement, loads), loads, previous, ctx, notes
    )
