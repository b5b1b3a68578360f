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
  layer alone with the cost model (the schedule, Trans/Agg and migrations from the previous
  placement included; incrementally, `cost_incremental.ExpertColumns`: only the changed experts
  are re-routed and re-priced) and applies the one with the lowest predicted layer time, if it is
  strictly (relative 1e-12) below the current one; candidates within relative 1e-12 of each other
  count as tied and the earlier one wins:
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

import numpy as np

from poise.cost_incremental import ROW_R, ExpertColumns
from poise.placement import Assignment, Plan, balanced_weights
from poise.policies.base import PlanContext, finish_plan, register, start_placement

_REL_TOL = 1e-12

# A column change: (expert, its new copies `[D]`, its new home).
Change = tuple[int, np.ndarray, int]


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
) -> list[tuple[str, list[Change]]]:
    """The moves of one round, in order, each as the expert columns it changes: `home[E]`,
    `copies[D, E]`, `received[D, E]` tokens computed under the current routing."""
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
    moves: list[tuple[str, list[Change]]] = []
    hot_col = copies[:, hot]
    hot_home = int(home[hot])

    target = _pick_min(dev_load, (free > 0) & (hot_col == 0))
    if target is not None:
        c = hot_col.copy()
        c[target] += 1
        moves.append(("expand", [(hot, c, hot_home)]))

    shrink: Change | None = None
    if cold is not None:
        cold_col = copies[:, cold]
        cold_home = int(home[cold])
        per_copy_on = received[:, cold] / np.maximum(cold_col, 1)
        not_home = np.arange(copies.shape[0]) != cold_home
        shrink_from = _pick_min(per_copy_on, (cold_col > 0) & not_home)
        if shrink_from is None and cold_col[cold_home] > 1:
            shrink_from = cold_home
        if shrink_from is not None:
            shrunk = cold_col.copy()
            shrunk[shrink_from] -= 1
            shrink = (cold, shrunk, cold_home)
            free_after = free.copy()
            free_after[shrink_from] += 1
            # Loads after the shrink are not re-routed here; the cost model prices the real move.
            swap_to = _pick_min(dev_load, (free_after > 0) & (hot_col == 0))
            if swap_to is not None:
                c = hot_col.copy()
                c[swap_to] += 1
                moves.append(("replace", [shrink, (hot, c, hot_home)]))

    source = hot_device
    if target is not None and dev_load[target] < dev_load[source]:
        c = hot_col.copy()
        c[source] -= 1
        c[target] += 1
        h = target if hot_home == source and c[source] == 0 else hot_home
        moves.append(("migrate", [(hot, c, h)]))

    if shrink is not None:
        moves.append(("shrink", [shrink]))
    return moves


def _route(counts_t: np.ndarray, copies_t: np.ndarray) -> np.ndarray:
    """`Assignment.balanced` per expert column: `counts_t[K, D]` loads, `copies_t[K, D]` copies
    -> shares `[K, D]` of each expert's remote tokens."""
    held = copies_t > 0
    local = np.where(held, counts_t, 0.0)
    remote = np.where(held, 0.0, counts_t).sum(axis=1)
    return balanced_weights(local, remote, copies_t.astype(np.float64))


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
    -> `(home, copies, moves)` (`home`, `copies` are updated in place).

    Candidates are priced with `ExpertColumns`: only the changed experts' columns are re-routed
    and re-priced; the result equals `ctx.cost.price` of the layer under `Assignment.balanced`
    with the migrations from `prev_home`."""
    slots = ctx.slots_per_device
    counts = loads_l[0]
    counts_t = np.ascontiguousarray(counts.T)  # [E, D]
    weights = _route(counts_t, copies.T)  # [E, D]
    received = np.where(copies > 0, counts, 0.0) + weights.T * np.where(
        copies > 0, 0.0, counts
    ).sum(axis=0)
    dev_load = received.sum(axis=1)
    mean = dev_load.mean()
    if mean <= 0 or dev_load.max() / mean <= threshold:
        return home, copies, []
    layer = ExpertColumns(ctx.cost, counts, home, copies, weights, prev_home)
    best = float(layer.price(layer.totals[None])[0])
    received = np.ascontiguousarray(layer.terms[:, ROW_R].T)  # [D, E]
    moves: list[str] = []
    while len(moves) < max_moves:
        cands = _candidates(home, copies, received, slots)
        if not cands:
            break
        changes = [change for _, cols in cands for change in cols]
        experts = np.array([e for e, _, _ in changes], dtype=np.int64)
        new_copies = np.stack([c for _, c, _ in changes])  # [K, D]
        new_home = np.array([h for _, _, h in changes], dtype=np.int64)
        terms = layer.column_terms(
            experts, new_home, new_copies, _route(counts_t[experts], new_copies)
        )
        select = np.zeros((len(cands), len(changes)), dtype=bool)
        k = 0
        for m, (_, cols) in enumerate(cands):
            select[m, k : k + len(cols)] = True
            k += len(cols)
        totals = layer.candidates(experts, terms, select)
        times = layer.price(totals)
        choice = None
        for m in range(len(cands)):
            t = float(times[m])
            if t < best * (1.0 - _REL_TOL) and (
                choice is None or t < times[choice] * (1.0 - _REL_TOL)
            ):
                choice = m
        if choice is None:
            break
        best = float(times[choice])
        cols = select[choice]
        layer.apply(experts[cols], terms[cols], totals[choice])
        for e, c, h in (changes[k] for k in np.flatnonzero(cols)):
            copies[:, e] = c
            home[e] = h
        received[:, experts[cols]] = terms[cols, ROW_R].T
        moves.append(cands[choice][0])
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
