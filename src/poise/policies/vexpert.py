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

from dataclasses import dataclass

import numpy as np

from poise.cost_incremental import ROW_R, TERMS, ExpertColumns
from poise.placement import Assignment, Plan, balanced_weights
from poise.policies.base import PlanContext, finish_plan, register, start_placement

_REL_TOL = 1e-12
MOVES = ("expand", "replace", "migrate", "shrink")
# The four changed columns of a round, per layer: the hot expert expanded, the hot expert
# expanded into the slot the shrink frees, the hot expert migrated, the cold expert shrunk.
_EXPAND, _SWAP, _MIGRATE, _SHRINK = range(4)
# select[m, k]: move m (in MOVES order) changes column k.
_SELECT = np.array(
    [
        [1, 0, 0, 0],  # expand
        [0, 1, 0, 1],  # replace = shrink the cold expert + expand the hot one
        [0, 0, 1, 0],  # migrate
        [0, 0, 0, 1],  # shrink
    ],
    dtype=bool,
)
_LAYER_BYTES = 256 * 2**20  # terms kept per lockstep batch of layers, at most


def _argmin_where(values: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `[B, N]`: index of the smallest allowed value (lowest index on ties) and
    whether any value is allowed (the index is 0 where none is)."""
    return np.where(allowed, values, np.inf).argmin(axis=1), allowed.any(axis=1)


@dataclass
class Round:
    """The candidate columns of one round for B layers: `experts[B, 4]`, `homes[B, 4]`,
    `copies[B, 4, D]` in column order (expand, swap, migrate, shrink) and `valid[B, 4]` per move
    (MOVES order)."""

    experts: np.ndarray
    homes: np.ndarray
    copies: np.ndarray
    valid: np.ndarray


def candidates(home: np.ndarray, copies: np.ndarray, received: np.ndarray, slots: int) -> Round:
    """The moves of one round in B layers: `home[B, E]`, `copies[B, D, E]`, `received[B, D, E]`
    tokens computed under the current routing. A move that does not exist in a layer is marked
    invalid (its columns repeat the current ones)."""
    B, D, _ = copies.shape
    rows = np.arange(B)
    devices = np.arange(D)[None, :]
    total = received.sum(axis=1)  # [B, E]
    ncopies = copies.sum(axis=1)
    per_copy = total / ncopies
    dev_load = received.sum(axis=2)  # [B, D]
    free = slots - copies.sum(axis=2)
    hot_device = dev_load.argmax(axis=1)
    # The most loaded device holds at least one expert, so `hot` always exists.
    hot, _ = _argmin_where(-per_copy, copies[rows, hot_device] > 0)
    multi = ncopies > 1
    cold, has_cold = _argmin_where(per_copy, multi)
    has_cold &= cold != hot
    hot_col = copies[rows, :, hot]  # [B, D]
    hot_home = home[rows, hot]

    target, has_target = _argmin_where(dev_load, (free > 0) & (hot_col == 0))
    expand = hot_col.copy()
    expand[rows, target] += has_target

    cold_col = copies[rows, :, cold]
    cold_home = home[rows, cold]
    per_copy_on = received[rows, :, cold] / np.maximum(cold_col, 1)
    allowed = (cold_col > 0) & (devices != cold_home[:, None]) & has_cold[:, None]
    shrink_from, has_shrink = _argmin_where(per_copy_on, allowed)
    at_home = ~has_shrink & has_cold & (cold_col[rows, cold_home] > 1)
    shrink_from = np.where(at_home, cold_home, shrink_from)
    has_shrink |= at_home
    shrunk = cold_col.copy()
    shrunk[rows, shrink_from] -= has_shrink
    free_after = free.copy()
    free_after[rows, shrink_from] += has_shrink
    # Loads after the shrink are not re-routed here; the cost model prices the real move.
    swap_to, has_swap = _argmin_where(dev_load, (free_after > 0) & (hot_col == 0))
    has_swap &= has_shrink
    swap = hot_col.copy()
    swap[rows, swap_to] += has_swap

    source = hot_device
    has_migrate = has_target & (dev_load[rows, target] < dev_load[rows, source])
    migrate = hot_col.copy()
    migrate[rows, source] -= has_migrate
    migrate[rows, target] += has_migrate
    home_moves = has_migrate & (hot_home == source) & (migrate[rows, source] == 0)
    migrate_home = np.where(home_moves, target, hot_home)

    return Round(
        experts=np.stack([hot, hot, hot, cold], axis=1),
        homes=np.stack([hot_home, hot_home, migrate_home, cold_home], axis=1),
        copies=np.stack([expand, swap, migrate, shrunk], axis=1),
        valid=np.stack([has_target, has_swap, has_migrate, has_shrink], axis=1),
    )


def _route(counts_t: np.ndarray, copies_t: np.ndarray) -> np.ndarray:
    """`Assignment.balanced` per expert column: `counts_t[..., D]` loads, `copies_t[..., D]`
    copies -> shares `[..., D]` of each expert's remote tokens."""
    held = copies_t > 0
    local = np.where(held, counts_t, 0.0)
    remote = np.where(held, 0.0, counts_t).sum(axis=-1)
    return balanced_weights(local, remote, copies_t.astype(np.float64))


def _choose(times: np.ndarray, best: np.ndarray) -> np.ndarray:
    """Per layer, the move to make (-1: none): the first in MOVES order strictly (relative
    1e-12) below `best[B]`, replaced by a later one only if strictly below it. `times[B, 4]`."""
    choice = np.full(times.shape[0], -1)
    chosen_t = np.full(times.shape[0], np.inf)
    for m in range(times.shape[1]):
        t = times[:, m]
        better = (t < best * (1.0 - _REL_TOL)) & ((choice < 0) | (t < chosen_t * (1.0 - _REL_TOL)))
        choice = np.where(better, m, choice)
        chosen_t = np.where(better, t, chosen_t)
    return choice


def search_layers(
    ctx: PlanContext,
    home: np.ndarray,
    copies: np.ndarray,
    loads: np.ndarray,
    prev_home: np.ndarray | None,
    threshold: float,
    max_moves: int,
) -> list[list[str]]:
    """FlexMoE's adjustment loop on L layers in lockstep: `home[L, E]`, `copies[L, D, E]` (updated
    in place), `loads[L, D, E]`, `prev_home[L, E]` -> the moves made per layer.

    Each layer runs its own loop; a round prices the open layers' candidates together with
    `ExpertColumns` (only the changed experts' columns are re-routed and re-priced); the result
    equals `ctx.cost.price` of each layer under `Assignment.balanced` with the migrations from
    `prev_home`."""
    slots = ctx.slots_per_device
    L, D, _ = loads.shape
    counts_t = np.ascontiguousarray(loads.transpose(0, 2, 1))  # [L, E, D]
    weights = _route(counts_t, copies.transpose(0, 2, 1))  # [L, E, D]
    held = copies > 0
    received = np.where(held, loads, 0.0) + weights.transpose(0, 2, 1) * np.where(
        held, 0.0, loads
    ).sum(axis=1, keepdims=True)
    dev_load = received.sum(axis=2)  # [L, D]
    mean = dev_load.mean(axis=1)
    moves: list[list[str]] = [[] for _ in range(L)]
    open_layers = np.flatnonzero((mean > 0) & (dev_load.max(axis=1) > threshold * mean))
    if not open_layers.size or max_moves <= 0:
        return moves
    prev = None if prev_home is None else prev_home[open_layers]
    cols = ExpertColumns(
        ctx.cost,
        loads[open_layers],
        home[open_layers],
        copies[open_layers],
        weights[open_layers],
        prev,
    )
    best = cols.price(cols.totals)  # [B] layer seconds, index into open_layers
    received = received[open_layers]  # [B, D, E]
    active = np.arange(open_layers.size)  # rows of `cols` still searching
    for _ in range(max_moves):
        layers = open_layers[active]
        rnd = candidates(home[layers], copies[layers], received[active], slots)
        B = active.size
        flat_layers = np.repeat(active, 4)
        flat_experts = rnd.experts.reshape(-1)
        flat_copies = rnd.copies.reshape(B * 4, D)
        shares = _route(cols.counts_t[flat_layers, flat_experts], flat_copies)
        terms = cols.column_terms(
            flat_layers, flat_experts, rnd.homes.reshape(-1), flat_copies, shares
        ).reshape(B, 4, TERMS, D)
        totals = cols.candidates(active, rnd.experts, terms, _SELECT)  # [B, 4, TERMS, D]
        times = cols.price(totals.reshape(B * 4, TERMS, D)).reshape(B, 4)
        times = np.where(rnd.valid, times, np.inf)
        choice = _choose(times, best[active])
        moved = np.flatnonzero(choice >= 0)
        if not moved.size:
            break
        b = active[moved]
        picked = _SELECT[choice[moved]]  # [n, 4] columns each chosen move changes
        row, col = np.nonzero(picked)
        lb = b[row]  # rows of `cols` per changed column
        layer_ids = open_layers[lb]
        experts = rnd.experts[moved[row], col]
        new_copies = rnd.copies[moved[row], col]
        new_homes = rnd.homes[moved[row], col]
        new_terms = terms[moved[row], col]
        new_weights = shares.reshape(B, 4, D)[moved[row], col]
        cols.apply(lb, experts, new_homes, new_copies, new_weights, b, totals[moved, choice[moved]])
        copies[layer_ids, :, experts] = new_copies
        home[layer_ids, experts] = new_homes
        received[lb, :, experts] = new_terms[:, ROW_R]
        best[b] = times[moved, choice[moved]]
        for layer, m in zip(open_layers[b], choice[moved], strict=True):
            moves[layer].append(MOVES[m])
        active = b
    return moves


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
    # Layers in lockstep batches whose per-expert terms fit in _LAYER_BYTES.
    batch = max(1, _LAYER_BYTES // (E * TERMS * D * 8))
    moves: list[list[str]] = []
    for start in range(0, L, batch):
        part = slice(start, min(L, start + batch))
        home = placement.home[part].copy()
        copies = placement.copies[part].copy()
        moves += search_layers(
            ctx,
            home,
            copies,
            loads[part],
            None if prev is None else prev.home[part],
            threshold,
            max_moves,
        )
        placement.home[part] = home
        placement.copies[part] = copies
    counts = {k: sum(m.count(k) for m in moves) for k in MOVES}
    notes = {"moves_per_layer": [len(m) for m in moves], "moves": counts, "threshold": threshold}
    return finish_plan(
        "vexpert", placement, Assignment.balanced(placement, loads), loads, previous, ctx, notes
    )
