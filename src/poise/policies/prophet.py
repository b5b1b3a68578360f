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

from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.cost import CostModel
from poise.cost_incremental import LayerState, prefix_cuts
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


@dataclass
class _Prefixes:
    """Replicating expert e (home h) on prefixes of `cands[m]` (heaviest first): the prefix
    lengths `cuts[G]` priced (all of 1..m when m is small, else a grid:
    `cost_incremental.prefix_cuts`), the layer seconds `times[G]`, and what the home's state
    becomes after each prefix (`tok_recv[G, 3]`, `par_send[G, 3]`, `comp[G]`)."""

    cuts: np.ndarray
    times: np.ndarray
    home_tok_recv: np.ndarray
    home_par_send: np.ndarray
    home_comp: np.ndarray


def _prefix_times(
    state: LayerState, counts: np.ndarray, e: int, h: int, level: np.ndarray, cands: np.ndarray
) -> _Prefixes:
    """Layer seconds after replicating e on each priced prefix of `cands`, in O(D + m).

    Per added replica d: d keeps its own tokens of e (its dispatch sends and its compute change
    once, at its step) and receives W_e; the home h receives fewer tokens and sends one more
    W_e at every step. So for a prefix of length c the slowest device is the slowest of: the
    home in its state after c steps, the candidates before c in their changed state (a running
    maximum), the candidates from c on and every other device in their current state (a
    suffix maximum and a constant). Equal to pricing each prefix's full state
    (`LayerState.layer_s`); no `[G, 3, D]` state is built."""
    m = len(cands)
    cuts = prefix_cuts(m)[1:]  # prefix lengths >= 1
    W_e = state.cost.spec.expert_bytes
    steps = np.arange(m)
    tok = counts[cands, e]  # [m]
    lv = level[cands]  # link level between home and each candidate
    base = state.device_terms(
        state.comp, state.tok_send, state.tok_recv, state.par_send, state.par_recv
    )  # 3 x [D]
    tok_send = state.tok_send[:, cands].copy()
    tok_send[lv, steps] -= tok
    par_recv = state.par_recv[:, cands].copy()
    par_recv[lv, steps] += W_e
    after = state.device_terms(
        state.comp[cands] + state.comp_s(tok),
        tok_send,
        state.tok_recv[:, cands],
        state.par_send[:, cands],
        par_recv,
    )  # 3 x [m]
    per_step = np.zeros((m, 3))
    per_step[steps, lv] = -tok
    home_tok_recv = state.tok_recv[:, h][None, :] + np.cumsum(per_step, axis=0)[cuts - 1]
    per_step[steps, lv] = W_e
    home_par_send = state.par_send[:, h][None, :] + np.cumsum(per_step, axis=0)[cuts - 1]
    left = state.R[h, e] - np.cumsum(tok)[cuts - 1]  # tokens the home still computes
    home_comp = state.comp[h] + state.comp_s(np.maximum(left, 0.0)) - state.comp_s(state.R[h, e])
    G = len(cuts)
    home = state.device_terms(
        home_comp[:, None],
        np.broadcast_to(state.tok_send[:, h][None, :, None], (G, 3, 1)),
        home_tok_recv[:, :, None],
        home_par_send[:, :, None],
        np.broadcast_to(state.par_recv[:, h][None, :, None], (G, 3, 1)),
    )  # 3 x [G, 1]
    others = np.ones(state.comp.shape[0], dtype=bool)
    others[cands] = False
    others[h] = False
    slowest = []
    for b, a, hm in zip(base, after, home, strict=True):
        rest = b[others].max(initial=-np.inf)
        changed = np.maximum.accumulate(a)[cuts - 1]  # candidates before the cut
        later = np.maximum.accumulate(b[cands][::-1])[::-1]  # candidates from each index on
        unchanged = np.append(later, -np.inf)[cuts]
        slowest.append(np.maximum(np.maximum(hm[:, 0], rest), np.maximum(changed, unchanged)))
    times = state.layer_s_from_max(*slowest)
    return _Prefixes(cuts, times, home_tok_recv, home_par_send, home_comp)


def _apply_prefix(
    state: LayerState,
    counts: np.ndarray,
    e: int,
    h: int,
    level: np.ndarray,
    chosen: np.ndarray,
    prefixes: _Prefixes,
    j: int,
) -> None:
    """Update `state` in place to e replicated on `chosen` (the prefix `prefixes.cuts[j]`)."""
    tok = counts[chosen, e]
    lv = level[chosen]
    state.tok_send[lv, chosen] -= tok
    state.par_recv[lv, chosen] += state.cost.spec.expert_bytes
    state.comp[chosen] += state.comp_s(tok)
    state.tok_recv[:, h] = prefixes.home_tok_recv[j]
    state.par_send[:, h] = prefixes.home_par_send[j]
    state.comp[h] = prefixes.home_comp[j]
    state.R[chosen, e] = tok
    state.R[h, e] -= tok.sum()


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
        prefixes = _prefix_times(state, counts, e, h, level_to[e], cands)
        j = int(np.argmin(prefixes.times))  # times[j]: the cuts[j] heaviest senders
        if not prefixes.times[j] < best:
            break  # first expert without gain ends the search
        best = float(prefixes.times[j])
        chosen = cands[: prefixes.cuts[j]]
        copies[chosen, e] = 1
        _apply_prefix(state, counts, e, h, level_to[e], chosen, prefixes, j)
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
