"""`prophet`: Pro-Prophet's planner, locality-based lightweight placement (Wang et al.,
arXiv 2411.10003, §IV "planner", Algorithm 1; reconstructed from the published description, the
paper body could not be read: equation shapes are ours, not quotations).

Lightweight placement: a hot expert's weights are sent (Trans) from its home to some of the
devices that hold its tokens; each such device computes its own tokens for the expert locally and
returns the gradients to the home (Agg). Homes never move, so nothing migrates. Sources without a
local copy send to the home (`Assignment.to_home`).

Greedy (after Pro-Prophet Algorithm 1, reconstructed), per layer, experts in descending total
load (stable: lower index first on ties):

1. candidates: the devices that send tokens to the expert (non-holders with tokens and a free
   slot), sorted by how many tokens they send (descending, lower device first on ties);
2. for n = 0, 1, ..., m - 1 the placement "all candidates but the n lightest" is priced (with
   more than 80 candidates, on large clusters, the kept prefix lengths 1..16 and a geometric
   grid of 64 more up to m: `cost_incremental.prefix_cuts`; our bound on planner work);
3. the best n is kept if it makes the layer strictly faster than without it; the first expert that
   brings no gain ends the search. Experts whose every sender is out of slots are skipped (the
   paper has no slot limit).

The price is the cost model's layer time under Pro-Prophet's block-wise schedule (after its
eq. 8, reconstructed; `schedule.Schedule("prophet")`): Trans of a block's replicas hides under
the block before it's forward expert and non-expert compute, Agg under the backward compute,

    T = FNEC + BNEC + 2 (A_d + A_c) + FEC + BEC
        + max(0, Trans - FEC - FNEC) + max(0, Agg - BEC - BNEC)

with FEC = max_d sum_e R[d, e] F_t / rate(R[d, e]) (eq. 1-2 style), A the hierarchical all-to-all
and Trans = Agg the replicas' weight traffic (`cost.py`). `ctx.cost` is used when its schedule is
`prophet`, otherwise a `prophet`-scheduled model on the same cluster and model. Each candidate is
priced incrementally on its layer alone; the result equals `CostModel.price` on that layer (the
tests check it). The returned plan is priced by `ctx.cost` like every other policy, so that
`auto` compares like with like; the prophet-schedule layer times are in
`notes["prophet_layer_s"]`, the replicated experts (in the order chosen) and their replica
devices in `notes["replicated"][l]` and `notes["replica_devices"][l]`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.cost import CostModel
from poise.cost_incremental import LayerState, prefix_cuts, prefix_states
from poise.placement import Assignment, Placement, Plan
from poise.policies.base import PlanContext, finish_plan, register, start_placement
from poise.schedule import Schedule

NAME = "prophet"


def prophet_cost(ctx: PlanContext) -> CostModel:
    """The cost model the planner searches with: `ctx.cost` if it already uses the prophet
    schedule, else the same cluster and model under `Schedule("prophet")`."""
    if ctx.cost.schedule.kind == "prophet":
        return ctx.cost
    return CostModel(ctx.cluster, ctx.spec, Schedule("prophet"))


def _candidates(
    state: LayerState, counts: np.ndarray, e: int, h: int, level: np.ndarray, cands: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """States after replicating expert e (home h) on prefixes of `cands` (heaviest first):
    `(lengths[G], states)`, each state array with a leading axis G, one row per prefix length
    (all of 1..m when m is small, else a grid: `cost_incremental.prefix_cuts`)."""
    m = len(cands)
    cuts = prefix_cuts(m)[1:]  # prefix lengths >= 1
    W_e = state.cost.spec.expert_bytes
    steps = np.arange(m)
    tok = counts[cands, e]  # [m]
    lv = level[cands]  # link level between home and each candidate
    # Per added replica: its tokens no longer go to the home; the home sends it W_e.
    tok_send = prefix_states(state.tok_send, steps, (lv, cands), -tok, cuts)
    tok_recv = prefix_states(state.tok_recv, steps, (lv, np.full(m, h)), -tok, cuts)
    par_send = prefix_states(state.par_send, steps, (lv, np.full(m, h)), np.full(m, W_e), cuts)
    par_recv = prefix_states(state.par_recv, steps, (lv, cands), np.full(m, W_e), cuts)
    comp = prefix_states(state.comp, steps, (cands,), state.comp_s(tok), cuts)
    left = state.R[h, e] - np.cumsum(tok)[cuts - 1]  # tokens the home still computes
    comp[:, h] += state.comp_s(np.maximum(left, 0.0)) - state.comp_s(state.R[h, e])
    return cuts, (comp, tok_send, tok_recv, par_send, par_recv)


def plan_layer(
    cost: CostModel,
    placement: Placement,
    counts: np.ndarray,
    slots: int,
    state: LayerState | None = None,
) -> tuple[Placement, list[int], list[list[int]], float, float]:
    """Algorithm 1 (reconstructed) on one layer. `placement`: one layer, homes only (modified in
    place); `counts[D, E]`; `state`: the layer's `LayerState` if already built (it is updated).
    Returns the placement, the replicated experts, their replica devices, and the layer seconds
    before and after."""
    D = counts.shape[0]
    if state is None:
        state = LayerState(cost, placement, counts)
    best = before = state.current_s()
    home = placement.home[0]
    copies = placement.copies[0]  # [D, E], a view: edits go into the placement
    level_to = cost.cluster.level_between(home[:, None], np.arange(D)[None, :])  # [E, D]
    order = np.argsort(-counts.sum(axis=0), kind="stable")
    replicated: list[int] = []
    devices: list[list[int]] = []
    for e in order:
        e = int(e)
        h = int(home[e])
        free = copies.sum(axis=1) < slots
        ok = (counts[:, e] > 0) & (copies[:, e] == 0) & free
        if not ok.any():
            if counts[:, e].sum() <= 0:
                break  # no tokens left to balance
            continue  # every sender is out of slots: skip
        idx = np.flatnonzero(ok)
        cands = idx[np.argsort(-counts[idx, e], kind="stable")]
        lengths, states = _candidates(state, counts, e, h, level_to[e], cands)
        times = state.layer_s(*states)  # times[j]: the lengths[j] heaviest senders
        j = int(np.argmin(times))
        if not times[j] < best:
            break  # first expert without gain ends the search
        best = float(times[j])
        chosen = cands[: lengths[j]]
        copies[chosen, e] = 1
        state.comp, state.tok_send, state.tok_recv = states[0][j], states[1][j], states[2][j]
        state.par_send, state.par_recv = states[3][j], states[4][j]
        state.R[chosen, e] = counts[chosen, e]
        state.R[h, e] -= counts[chosen, e].sum()
        replicated.append(e)
        devices.append([int(d) for d in chosen])
    return placement, replicated, devices, before, best


@register(NAME)
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """`loads[L, D, E]` predicted tokens -> Plan with Pro-Prophet's lightweight placement."""
    L, D, _ = loads.shape
    cost = prophet_cost(ctx)
    start = start_placement(previous, ctx, L)
    placement = Placement.from_homes(start.home, D, ctx.slots_per_device)
    replicated: list[list[int]] = []
    replica_devices: list[list[list[int]]] = []
    layer_s: list[list[float]] = []
    states = LayerState.for_layers(cost, placement, loads)
    for layer in range(L):
        one = placement.take_layers([layer])
        one.copies = one.copies.copy()
        _, reps, devs, before, after = plan_layer(
            cost, one, loads[layer], ctx.slots_per_device, states[layer]
        )
        placement.copies[layer] = one.copies[0]
        replicated.append(reps)
        replica_devices.append(devs)
        layer_s.append([before, after])
    notes: dict[str, Any] = {
        "replicated": replicated,
        "replica_devices": replica_devices,
        "prophet_layer_s": layer_s,
        "schedule": cost.schedule.name,
    }
    return finish_plan(NAME, placement, Assignment.to_home(placement), loads, previous, ctx, notes)
