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
  placement included; incrementally, `cost.expert_columns.ExpertColumns`: only the changed experts
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
- at most `max_moves` (default 4 E) moves per layer; tokens follow `Assignment.balanced` (the
  plan keeps the shares the search routed and priced by, expert column by expert column; they
  equal `Assignment.balanced` of the final placement up to the last bit).

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

from poise.core.placement import Assignment, Placement, Plan
from poise.core.water_fill import balanced_weights
from poise.cost.expert_columns import ROW_R, TERMS, TOTALS, ExpertColumns
from poise.cost.model import PlanCost
from poise.cost.phases import PHASE_NAMES, PhaseTimes
from poise.plan.policies.base import PlanContext, finish_plan, register, start_placement

_REL_TOL = 1e-12
MOVES = ("expand", "replace", "migrate", "shrink")
# The columns of a round, per layer: the hot expert expanded, the hot expert expanded into the
# slot the shrink frees, the hot expert migrated, the cold expert shrunk (the four candidate
# columns), then the hot and the cold expert's columns in force (priced in the same batch for
# the candidates' differences).
_EXPAND, _SWAP, _MIGRATE, _SHRINK, _HOT, _COLD = range(6)
# select[m, k]: move m (in MOVES order) changes candidate column k.
_SELECT = np.array(
    [
        [1, 0, 0, 0],  # expand
        [0, 1, 0, 1],  # replace = shrink the cold expert + expand the hot one
        [0, 0, 1, 0],  # migrate
        [0, 0, 0, 1],  # shrink
    ],
    dtype=bool,
)
_COLUMNS = [tuple(np.flatnonzero(row).tolist()) for row in _SELECT]  # per move, as indices
_CURRENT = np.array([_HOT, _HOT, _HOT, _COLD])  # per candidate column, the column in force
_LAYER_BYTES = 256 * 2**20  # terms kept per lockstep batch of layers, at most


def _argmin_where(values: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `[B, N]`: index of the smallest allowed value (lowest index on ties) and
    whether any value is allowed (the index is 0 where none is)."""
    return np.where(allowed, values, np.inf).argmin(axis=1), allowed.any(axis=1)


@dataclass
class Round:
    """The columns of one round for B layers, in column order (expand, swap, migrate, shrink,
    hot in force, cold in force): `experts[B, 6]`, `homes[B, 6]`, `copies[B, 6, D]`; `valid[B,
    4]` per move (MOVES order)."""

    experts: np.ndarray
    homes: np.ndarray
    copies: np.ndarray
    valid: np.ndarray


@dataclass
class SearchState:
    """The search state of N layers: `home[N, E]`, `copies_t[N, E, D]` (expert-major; both
    shared with `ExpertColumns`, which updates them), `received[N, D, E]` tokens computed under
    the current routing, and kept with them so that a round does not reduce `[N, D, E]` arrays
    for them: `total[N, E]` = `received.sum(axis=1)`, `ncopies[N, E]` copies per expert and
    `free[N, D]` free slots per device.

    NumPy sums the middle axis of `received` in device order, and a changed column's total is
    re-summed in that order (`np.cumsum`), so `total` stays `received.sum(axis=1)` bit for bit
    (with E = 1 NumPy may pair the terms differently, but one expert is never compared)."""

    home: np.ndarray
    copies_t: np.ndarray
    received: np.ndarray
    total: np.ndarray
    ncopies: np.ndarray
    free: np.ndarray

    @classmethod
    def start(
        cls,
        home: np.ndarray,
        copies_t: np.ndarray,
        copies: np.ndarray,
        received: np.ndarray,
        slots: int,
    ) -> SearchState:
        """From `home[N, E]`, `copies_t[N, E, D]`, the same copies `copies[N, D, E]` and
        `received[N, D, E]` (kept, not copied)."""
        return cls(
            home,
            copies_t,
            received,
            received.sum(axis=1),
            copies.sum(axis=1),
            slots - copies.sum(axis=2),
        )

    def set_columns(
        self,
        rows: np.ndarray,
        experts: np.ndarray,
        received: np.ndarray,
        copies: np.ndarray,
        old_copies: np.ndarray,
    ) -> None:
        """Column `experts[K]` of row `rows[K]` now computes `received[K, D]` tokens with copies
        `copies[K, D]` (were `old_copies[K, D]`). A row may change several experts."""
        self.received[rows, :, experts] = received
        self.total[rows, experts] = np.cumsum(received, axis=1)[:, -1]  # sums in device order
        self.ncopies[rows, experts] = copies.sum(axis=1)
        np.subtract.at(self.free, rows, copies - old_copies)


def candidates(state: SearchState, rows: np.ndarray) -> Round:
    """The moves of one round in the layers `rows[B]` (ascending indices into `state`), with
    the columns in force of their hot and cold experts. A move that does not exist in a layer
    is marked invalid (its columns repeat the current ones)."""
    B = rows.size
    N, D = state.free.shape
    everyone = B == N  # rows is then arange(N): no gathers
    i = np.arange(B)
    # Device loads: summing all N layers costs less than gathering most of them first.
    if 2 * B > N:
        dev_load = state.received.sum(axis=2)
        dev_load = dev_load if everyone else dev_load[rows]
    else:
        dev_load = state.received[rows].sum(axis=2)  # [B, D]
    ncopies = state.ncopies if everyone else state.ncopies[rows]
    per_copy = (state.total if everyone else state.total[rows]) / ncopies  # [B, E]
    free = state.free[rows]
    hot_device = dev_load.argmax(axis=1)
    # The most loaded device holds at least one expert, so `hot` always exists (the first
    # largest per-copy load among its experts).
    hot = np.where(state.copies_t[rows, :, hot_device] > 0, per_copy, -np.inf).argmax(axis=1)
    valid = np.empty((B, 4), dtype=bool)  # per move, MOVES order
    multi = ncopies > 1
    cold = np.where(multi, per_copy, np.inf).argmin(axis=1)
    has_cold = multi.any(axis=1) & (cold != hot)
    columns = np.empty((B, 6, D), dtype=state.copies_t.dtype)
    columns[:, :3] = columns[:, _HOT, None] = state.copies_t[rows, hot][:, None]
    hot_col = columns[:, _HOT]
    columns[:, _SHRINK] = columns[:, _COLD] = cold_col = state.copies_t[rows, cold]
    hot_home = state.home[rows, hot]
    cold_home = state.home[rows, cold]

    # Shrink: a copy of the cold expert from the non-home holder computing the fewest tokens
    # per copy (from its home when the home is its only holder, with several copies).
    per_copy_on = state.received[rows, :, cold] / np.maximum(cold_col, 1)
    allowed = (cold_col > 0) & (np.arange(D) != cold_home[:, None]) & has_cold[:, None]
    shrink_from, has_shrink = _argmin_where(per_copy_on, allowed)
    at_home = ~has_shrink & has_cold & (cold_col[i, cold_home] > 1)
    shrink_from = np.where(at_home, cold_home, shrink_from)
    has_shrink |= at_home
    # Targets: the least-loaded device with a free slot not holding the hot expert, before (0)
    # and after (1) the shrink frees a slot. Loads after the shrink are not re-routed here; the
    # cost model prices the real move.
    open_slot = np.empty((B, 2, D), dtype=bool)
    open_slot[:, 0] = free > 0
    free[i, shrink_from] += has_shrink
    open_slot[:, 1] = free > 0
    open_slot &= (hot_col == 0)[:, None]
    to = np.where(open_slot, dev_load[:, None], np.inf).argmin(axis=2)  # [B, 2]
    has_to = open_slot.any(axis=2)
    target, swap_to = to[:, 0], to[:, 1]
    has_target = has_to[:, 0]
    has_swap = has_to[:, 1] & has_shrink
    source = hot_device
    has_migrate = has_target & (dev_load[i, target] < dev_load[i, source])
    valid[:, 0] = has_target
    valid[:, 1] = has_swap
    valid[:, 2] = has_migrate
    valid[:, 3] = has_shrink
    columns[i, _EXPAND, target] += has_target
    columns[i, _SWAP, swap_to] += has_swap
    columns[i, _MIGRATE, source] -= has_migrate
    columns[i, _MIGRATE, target] += has_migrate
    columns[i, _SHRINK, shrink_from] -= has_shrink
    home_moves = has_migrate & (hot_home == source) & (columns[i, _MIGRATE, source] == 0)

    experts = np.empty((B, 6), dtype=np.int64)
    experts[:, :3] = experts[:, _HOT, None] = hot[:, None]
    experts[:, _SHRINK] = experts[:, _COLD] = cold
    homes = np.empty((B, 6), dtype=np.int64)
    homes[:, :3] = homes[:, _HOT, None] = hot_home[:, None]
    homes[:, _MIGRATE] = np.where(home_moves, target, hot_home)
    homes[:, _SHRINK] = homes[:, _COLD] = cold_home
    return Round(experts=experts, homes=homes, copies=columns, valid=valid)


def _route(counts_t: np.ndarray, copies_t: np.ndarray) -> np.ndarray:
    """`Assignment.balanced` per expert column: `counts_t[..., D]` loads, `copies_t[..., D]`
    copies -> shares `[..., D]` of each expert's remote tokens."""
    held = copies_t > 0
    local = np.where(held, counts_t, 0.0)
    remote = np.where(held, 0.0, counts_t).sum(axis=-1)
    return balanced_weights(local, remote, copies_t.astype(np.float64))


def _route_layers(counts_t: np.ndarray, copies_t: np.ndarray) -> np.ndarray:
    """`_route` on whole layers (`[L, E, D]`), bit for bit: an expert with one holder sends it
    everything, so only the experts with several holders go through `_route` (the water-fill
    works row by row on the experts with several holders in either case)."""
    held = copies_t > 0
    weights = held.astype(np.float64)
    multi = held.sum(axis=2) > 1
    if multi.any():
        weights[multi] = _route(counts_t[multi], copies_t[multi])
    return weights


def _choose(times: np.ndarray, best: np.ndarray) -> list[int]:
    """Per layer, the move to make (-1: none): the first in MOVES order strictly (relative
    1e-12) below `best[B]`, replaced by a later one only if strictly below it. `times[B, 4]`."""
    out = []
    for row, limit in zip(times.tolist(), best.tolist(), strict=True):
        choice, chosen = -1, np.inf
        for m, t in enumerate(row):
            if t < limit * (1.0 - _REL_TOL) and (choice < 0 or t < chosen * (1.0 - _REL_TOL)):
                choice, chosen = m, t
        out.append(choice)
    return out


@dataclass
class Searched:
    """What `search_layers` did: the moves per layer (`moves[L]`), the layers it searched
    (`open_layers[N]`, indices into the batch) and their priced state in the end
    (`ExpertColumns.phases`: phase times `[N]`, computed tokens `[N, D]`; None if none) and
    the assignment's shares of every layer (`Assignment.balanced`, per expert column)."""

    moves: list[list[str]]
    open_layers: np.ndarray
    priced: tuple[PhaseTimes, np.ndarray] | None
    weights: np.ndarray  # [L, E, D] the shares the search routed by, as it left them


def search_layers(
    ctx: PlanContext,
    home: np.ndarray,
    copies: np.ndarray,
    loads: np.ndarray,
    prev_home: np.ndarray | None,
    threshold: float,
    max_moves: int,
) -> Searched:
    """FlexMoE's adjustment loop on L layers in lockstep: `home[L, E]`, `copies[L, D, E]` (updated
    in place), `loads[L, D, E]`, `prev_home[L, E]` -> the moves made per layer and the price of
    the searched layers.

    Each layer runs its own loop; a round prices the open layers' candidates together with
    `ExpertColumns` (only the changed experts' columns are re-routed and re-priced); the result
    equals `ctx.cost.price` of each layer under `Assignment.balanced` with the migrations from
    `prev_home`."""
    slots = ctx.slots_per_device
    L, D, _ = loads.shape
    counts_t = np.ascontiguousarray(loads.transpose(0, 2, 1))  # [L, E, D]
    weights = _route_layers(counts_t, copies.transpose(0, 2, 1))  # [L, E, D]
    held = copies > 0
    remote = np.where(held, 0.0, loads)
    received = np.subtract(loads, remote)  # = np.where(held, loads, 0.0), bit for bit
    received += weights.transpose(0, 2, 1) * remote.sum(axis=1, keepdims=True)
    dev_load = received.sum(axis=2)  # [L, D]
    mean = dev_load.mean(axis=1)
    moves: list[list[str]] = [[] for _ in range(L)]
    open_layers = np.flatnonzero((mean > 0) & (dev_load.max(axis=1) > threshold * mean))
    if not open_layers.size or max_moves <= 0:
        return Searched(moves, np.empty(0, dtype=np.int64), None, weights)
    take = slice(None) if open_layers.size == L else open_layers  # no copies when all search
    received = received[take]  # [N, D, E]
    cols = ExpertColumns(
        ctx.cost,
        loads[take],
        home[take],
        copies[take],
        weights[take],
        None if prev_home is None else prev_home[take],
        received,
        counts_t[take],
    )
    # The placement in force is `cols.home` / `cols.copies_t`; `state` shares them.
    state = SearchState.start(cols.home, cols.copies_t, copies[take], received, slots)
    best = cols.price(cols.totals)  # [N] layer seconds, index into open_layers
    active = np.arange(open_layers.size)  # rows of `cols` and `state` still searching
    for _ in range(max_moves):
        rnd = candidates(state, active)
        B = active.size
        # Route the four candidate columns (one batch, as `Assignment.balanced` per column);
        # the two columns in force keep their shares.
        shares = np.empty((B, 6, D))
        shares[:, :4] = _route(
            cols.counts_t[active[:, None], rnd.experts[:, :4]], rnd.copies[:, :4]
        )
        shares[:, 4:] = cols.weights[active[:, None], rnd.experts[:, 4:]]
        terms = cols.column_terms(
            np.repeat(active, 6),
            rnd.experts.reshape(-1),
            rnd.homes.reshape(-1),
            rnd.copies.reshape(B * 6, D),
            shares.reshape(B * 6, D),
        ).reshape(B, 6, TERMS, D)
        # Per move, its columns' new minus current terms (replace: the swap's plus the shrink's).
        change = np.empty((B, 4, TERMS, D))
        np.subtract(terms[:, :3], terms[:, _HOT, None], out=change[:, :3])
        np.subtract(terms[:, _SHRINK], terms[:, _COLD], out=change[:, _SHRINK])
        change[:, _SWAP] += change[:, _SHRINK]
        # Each candidate's messages, recounted on its layer (not a sum over experts).
        messages = cols.candidate_messages(
            active,
            rnd.experts[:, :4],
            rnd.homes[:, :4],
            rnd.copies[:, :4],
            shares[:, :4],
            _SELECT,
            rnd.valid,
        )
        totals = cols.totals_after(active, change, messages)  # [B, 4, TOTALS, D]
        times = cols.price(totals.reshape(B * 4, TOTALS, D)).reshape(B, 4)
        times[~rnd.valid] = np.inf
        choice = _choose(times, best[active])
        moved = [j for j, m in enumerate(choice) if m >= 0]
        if not moved:
            break
        chosen = [choice[j] for j in moved]
        b = active[moved]
        # The columns each chosen move changes (`_SELECT`), and the columns in force they replace.
        pairs = [(j, k) for j, m in zip(moved, chosen, strict=True) for k in _COLUMNS[m]]
        mr, col = np.array(pairs).T
        lb = active[mr]  # rows of `cols` per changed column
        experts = rnd.experts[mr, col]
        new_copies = rnd.copies[mr, col]
        cols.apply(
            lb,
            experts,
            rnd.homes[mr, col],
            new_copies,
            shares[mr, col],
            b,
            totals[moved, chosen],
            candidate=(np.array(moved), np.array(chosen)),  # its pairs were counted this round
        )
        state.set_columns(
            lb, experts, terms[mr, col, ROW_R], new_copies, rnd.copies[mr, _CURRENT[col]]
        )
        best[b] = times[moved, chosen]
        for layer, m in zip(open_layers[b].tolist(), chosen, strict=True):
            moves[layer].append(MOVES[m])
        active = b
    home[take] = cols.home
    copies[take] = cols.copies_t.transpose(0, 2, 1)
    weights[take] = cols.weights  # (the same array when every layer searched)
    return Searched(moves, open_layers, cols.phases(), weights)


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
    searched: list[tuple[np.ndarray, tuple[PhaseTimes, np.ndarray]]] = []
    weights = np.empty((L, E, D))
    for start in range(0, L, batch):
        part = slice(start, min(L, start + batch))
        home = placement.home[part].copy()
        copies = placement.copies[part].copy()
        done = search_layers(
            ctx,
            home,
            copies,
            loads[part],
            None if prev is None else prev.home[part],
            threshold,
            max_moves,
        )
        moves += done.moves
        weights[part] = done.weights
        if done.priced is not None:
            searched.append((start + done.open_layers, done.priced))
        placement.home[part] = home
        placement.copies[part] = copies
    counts = {k: sum(m.count(k) for m in moves) for k in MOVES}
    notes = {"moves_per_layer": [len(m) for m in moves], "moves": counts, "threshold": threshold}
    assignment = Assignment(weights)  # what the search priced: `Assignment.balanced`
    # The search priced its layers (migrations from `prev` included); the rest kept the
    # placement in force, which nothing migrates to. A previous plan of another shape is
    # priced afresh by `finish_plan`.
    cost = None
    if prev is not None or previous is None:
        cost = _plan_cost(ctx, placement, assignment, loads, searched)
    return finish_plan("vexpert", placement, assignment, loads, previous, ctx, notes, cost)


def _plan_cost(
    ctx: PlanContext,
    placement: Placement,
    assignment: Assignment,
    loads: np.ndarray,
    searched: list[tuple[np.ndarray, tuple[PhaseTimes, np.ndarray]]],
) -> PlanCost:
    """The plan's `PlanCost`: the searched layers' phases from the search (`Searched.priced`,
    at `layers`), the other layers priced by the cost model (they did not move)."""
    L, D = loads.shape[0], loads.shape[1]
    fields = {name: np.empty(L) for name in PHASE_NAMES}
    device_load = np.empty((L, D))
    done = np.zeros(L, dtype=bool)
    for layers, (phases, load) in searched:
        for name in PHASE_NAMES:
            fields[name][layers] = getattr(phases, name)
        device_load[layers] = load
        done[layers] = True
    rest = np.flatnonzero(~done).tolist()
    if rest:
        pricer = ctx.cost.pricer(placement.take_layers(rest), assignment.take_layers(rest))
        phases, load = pricer.phases(loads[rest])
        for name in PHASE_NAMES:
            fields[name][rest] = getattr(phases, name)
        device_load[rest] = load
    return ctx.cost.cost_of(PhaseTimes(**fields), loads, device_load)
