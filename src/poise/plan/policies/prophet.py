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
   grid of 64 more up to m: `cost.incremental.prefix_cuts`; our bound on planner work);
3. the best n is kept if it makes the layer strictly faster than without it; the first expert that
   brings no gain ends the search. Experts whose every sender is out of slots are skipped (the
   paper has no slot limit).

The price is the cost model's layer time under Pro-Prophet's block-wise schedule (after its
eq. 8, reconstructed; `schedule.Schedule("prophet")`): Trans of a block's replicas hides under
the block before it's forward expert and non-expert compute, Agg under the backward compute,

    T = FNEC + BNEC + 2 (A_d + A_c) + FEC + BEC
        + max(0, Trans - FEC - FNEC) + max(0, Agg - BEC - BNEC)

with FEC = max_d sum_e R[d, e] F_t / rate(R[d, e]) (eq. 1-2 style), A the hierarchical all-to-all
and Trans = Agg the replicas' weight traffic (`poise.cost`). `ctx.cost` is used when its schedule is
`prophet`, otherwise a `prophet`-scheduled model on the same cluster and model. Each candidate is
priced incrementally on its layer alone, links as capacities and Trans as a broadcast; the result
equals `CostModel.price` on that layer (the tests check it) but for one choice: the search lets
the copy enter a node at the first replica it adds there, the model at the node's lowest device
(the same bytes on every shared link; `_broadcast_hops`). The returned plan is priced by
`ctx.cost` like every other policy, so that `auto` compares like with like; the prophet-schedule
layer times are in `notes["prophet_layer_s"]`, the replicated experts (in the order chosen) and
their replica devices in `notes["replicated"][l]` and `notes["replica_devices"][l]`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.placement import Assignment, Placement, Plan
from poise.core.static_ep import static_assignment
from poise.cost.incremental import PREFIX_EXACT, PREFIX_POINTS, LayerState, prefix_cuts
from poise.cost.model import CostModel
from poise.cost.network import MIN_TRAFFIC_BYTES
from poise.cost.schedule import Schedule
from poise.cost.traffic import sends
from poise.plan.policies.base import (
    PlanContext,
    finish_plan,
    register,
    start_homes,
    static_placement,
)

NAME = "prophet"


def prophet_cost(ctx: PlanContext) -> CostModel:
    """The cost model the planner searches with: `ctx.cost` if it already uses the prophet
    schedule, else the same cluster and model under `Schedule("prophet")`."""
    if ctx.cost.schedule.kind == "prophet":
        return ctx.cost
    return CostModel(ctx.cluster, ctx.spec, Schedule("prophet"))


def _padded_cuts(m: np.ndarray) -> np.ndarray:
    """`[B, C]` the priced prefix lengths >= 1 of each row (`prefix_cuts(m[b])[1:]`), padded
    with 0 (no prefix)."""
    if int(m.max()) + 1 <= PREFIX_EXACT + PREFIX_POINTS:  # every length 1..m
        lengths = np.arange(1, int(m.max()) + 1)
        return np.where(lengths[None, :] <= m[:, None], lengths, 0)
    rows = [prefix_cuts(int(n))[1:] for n in m]
    cuts = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for b, r in enumerate(rows):
        cuts[b, : len(r)] = r
    return cuts


class _Prefixes:
    """Replicating the expert under search in layer `layer[b]` (home `home[b]`) on prefixes of
    its candidates `cands[b, :m[b]]` (heaviest first), for B layers at once: the prefix lengths
    `cuts[B, C]` priced (0-padded; all of 1..m when m is small, else a grid:
    `cost.incremental.prefix_cuts`), the layer seconds `times[B, C]` (inf at padding), and the
    device states they were priced on, side by side (`LayerState.packed_terms`), `side[B,
    CELLS, D + 2 M + C]`: every device now, each candidate now and after its step, the home
    after each prefix."""

    def __init__(
        self,
        state: LayerState,
        layer: np.ndarray,
        home: np.ndarray,
        ok: np.ndarray,
        col: np.ndarray,
        r_home: np.ndarray,
    ) -> None:
        """Layer seconds after each priced prefix, in O(B (D + m + G C)) with G the links of a
        shared level.

        Per added replica d: d keeps its own tokens of e (its dispatch sends and its compute
        change once, at its step) and receives W_e over its broadcast hop; the home h receives
        fewer tokens and sends W_e once, over the farthest level reached so far. Messages
        (`state.carried`, `state.trans_carried`: the experts each message carries): d's
        message to h ends if it carried only e; h sends d a Trans message unless it already
        sends it replicas of other experts; the candidates are distinct devices, so each
        step's changes are its own, whatever came before it in the prefix. So for a
        prefix of length c the slowest device is the slowest of: the home in its state after c
        steps, the candidates before c in their changed state (a running maximum), the
        candidates from c on and every other device in their current state (a suffix maximum
        and a constant); the links several devices share are priced from their loads after
        each prefix (`_shared_link_s`). Equal to pricing each prefix's full state
        (`LayerState.layer_s`); no `[C, CELLS, D]` state is built. `ok[B, D]`: the candidate
        senders of each layer's expert, `col[B, D]` its tokens per source, `r_home[B]` the
        tokens its home computes."""
        LS = LayerState
        B, D = ok.shape
        rows = np.arange(B)[:, None]
        m = ok.sum(axis=1)
        M = int(m.max())
        # Candidates: senders by tokens, descending (stable: lower device first).
        cands = np.argsort(np.where(ok, -col, np.inf), axis=1, kind="stable")[:, :M]
        valid = np.arange(M)[None, :] < m[:, None]  # [B, M]
        # Small m: cuts[b, c] = c + 1 (valid) or 0 (padding, priced inf), so the state after
        # prefix c is the one after step c and no gather is needed.
        all_cuts = M + 1 <= PREFIX_EXACT + PREFIX_POINTS
        cuts = np.where(valid, np.arange(1, M + 1), 0) if all_cuts else _padded_cuts(m)
        C = cuts.shape[1]
        W_e = state.cost.spec.expert_bytes
        steps = np.arange(M)[None, :]
        tok = col[rows, cands]  # [B, M] (padding: unused)
        # Link level home -> candidate (padding may be the home: level -1, its columns unused).
        lv = state.level_between(home[:, None], cands)
        hop = _broadcast_hops(state.cost.cluster, cands, lv, valid)
        step = LS.LEVEL_STEP
        # Side by side (whole rows of `cells` gathered, then turned into columns): every device
        # now [D], each candidate now [M] and after its step [M], the home after each prefix
        # [C]: [B, CELLS, D + 2 M + C].
        idx = np.empty((B, D + 2 * M + C), dtype=np.int64)
        idx[:, :D] = np.arange(D)
        idx[:, D : D + M] = cands
        idx[:, D + M : D + 2 * M] = cands
        idx[:, D + 2 * M :] = home[:, None]
        idx += (layer * D)[:, None]
        rows_of = np.take(state.cells.reshape(-1, LS.CELLS), idx, axis=0)
        side = np.ascontiguousarray(rows_of.transpose(0, 2, 1))
        cand_side, home_side = side[:, :, D + M : D + 2 * M], side[:, :, D + 2 * M :]
        # Messages of each step (padding: none): d's dispatch message to the home ends
        # (`drops`), the home's Trans message to d begins (`joins`).
        lvv = np.where(valid, lv, 0)
        to_home = state.carried[layer[:, None], cands, home[:, None]]
        drops = (valid & sends(tok, state.cost.spec.token_bytes) & (to_home == 1)).astype(float)
        joins = (valid & (state.trans_carried[layer[:, None], home[:, None], cands] == 0)).astype(
            float
        )
        # The home after each step: tokens received per level, tokens it computes, the
        # messages it receives tokens in and sends Trans in per level, and the broadcast's one
        # copy sent over the farthest level reached so far.
        per_step = np.zeros((B, 10, M))
        per_step[rows, lvv, steps] = np.where(valid, -tok, 0.0)
        per_step[:, 3] = tok
        per_step[rows, 4 + lvv, steps] = -drops
        per_step[rows, 7 + lvv, steps] = joins
        after = np.cumsum(per_step, axis=2)  # [B, 10, M]
        farthest = np.maximum.accumulate(np.where(valid, lv, -1), axis=1)  # [B, M]
        if not all_cuts:
            at_cut = np.maximum(cuts - 1, 0)
            after = np.take_along_axis(after, at_cut[:, None, :], axis=2)
            farthest = np.take_along_axis(farthest, at_cut, axis=1)
        left = r_home[:, None] - after[:, 3]  # tokens the home computes
        seconds = state.comp_s(np.concatenate([tok, np.maximum(left, 0.0), r_home[:, None]], 1))
        home_side[:, LS.TOK_RECV : LS.TOK_RECV + 3 * step : step] += after[:, :3]
        home_side[:, LS.MSG_TOK_IN : LS.MSG_TOK_IN + 3 * step : step] += after[:, 4:7]
        home_side[:, LS.MSG_PAR_OUT : LS.MSG_PAR_OUT + 3 * step : step] += after[:, 7:10]
        for v in range(3):
            home_side[:, LS.PAR_SEND + step * v] += np.where(farthest == v, W_e, 0.0)
        home_side[:, LS.COMP] += seconds[:, M : M + C]
        home_side[:, LS.COMP] -= seconds[:, M + C :]
        # Each candidate after its own step: its tokens stay, the copy arrives over its hop.
        cand_side[:, LS.COMP] += seconds[:, :M]
        at = LS.TOK_SEND + step * lv
        cand_side[rows, at, steps] -= tok
        cand_side[rows, LS.PAR_RECV + step * hop, steps] += W_e
        cand_side[rows, LS.MSG_TOK_OUT + step * lvv, steps] -= drops
        cand_side[rows, LS.MSG_PAR_IN + step * lvv, steps] += joins

        # Per-device terms (compute, own links, latencies) of all columns in one pass.
        terms = state.packed_terms(side)  # [B, TERMS, D + 2 M + C]
        now = terms[:, :, :D]
        others = ~ok  # neither a candidate (the senders in `ok`) nor the home
        others[rows[:, 0], home] = False
        T = LS.TERMS
        # From each step on: the candidates not yet changed, then every other device.
        rest = np.full((B, T, M + 1), -np.inf)
        np.copyto(rest[:, :, :M], terms[:, :, D : D + M], where=valid[:, None, :])
        rest[:, :, M] = np.where(others[:, None, :], now, -np.inf).max(axis=2)
        rest = np.maximum.accumulate(rest[:, :, ::-1], axis=2)[:, :, ::-1]
        changed = np.maximum.accumulate(terms[:, :, D + M : D + 2 * M], axis=2)  # before c
        if all_cuts:
            unchanged = rest[:, :, 1:]
        else:
            changed = np.take_along_axis(changed, np.maximum(cuts - 1, 0)[:, None, :], axis=2)
            unchanged = np.take_along_axis(rest, cuts[:, None, :], axis=2)
        slowest = np.maximum(np.maximum(terms[:, :, D + 2 * M :], changed), unchanged)  # [B, T, C]
        groups = _shared_link_s(state, side, home, cands, valid, cuts, all_cuts)  # [B, 2, C]
        times = state.layer_s_from_parts(slowest.swapaxes(1, 2), groups.swapaxes(1, 2))
        self.cuts = cuts
        self.times = np.where(cuts > 0, times, np.inf)
        self.cands, self.side = cands, side


def _broadcast_hops(
    cluster: Cluster, cands: np.ndarray, lv: np.ndarray, valid: np.ndarray
) -> np.ndarray:
    """`[B, M]` the level over which candidate `cands[b, k]` receives the broadcast copy once
    the first k + 1 candidates hold it (`traffic.replica_traffic`): 2 for the first of its
    domain (outside the home's), 1 for the first of its node (outside the home's), else 0.
    "First" is in the search's order (heaviest sender first), where the cost model takes the
    lowest device of the node: the same bytes on every shared link, the level-0 and level-1
    bytes of two devices of one node possibly swapped (the plan is priced by the model)."""
    B, M = cands.shape
    first = {}
    for size, name in ((cluster.devices_per_node, "node"), (cluster.devices_per_domain, "dom")):
        key = np.where(valid, (np.arange(B)[:, None] * cluster.num_devices + cands) // size, -1)
        flat = key.ravel()
        mark = np.zeros(flat.size, dtype=bool)
        _, at = np.unique(flat, return_index=True)
        mark[at] = True
        first[name] = mark.reshape(B, M) & valid
    return np.where(
        lv == 2,
        np.where(first["dom"], 2, np.where(first["node"], 1, 0)),
        np.where((lv == 1) & first["node"], 1, 0),
    )


def _shared_link_s(
    state: LayerState,
    side: np.ndarray,
    home: np.ndarray,
    cands: np.ndarray,
    valid: np.ndarray,
    cuts: np.ndarray,
    all_cuts: bool,
) -> np.ndarray:
    """`[B, 2, C]` seconds of the busiest shared link (all-to-all, Trans) after each priced
    prefix, exactly: each link's load is the sum over the devices behind it, so per shared
    level the loads of every link now, plus the changes of the candidates in the prefix (at
    their links) and of the home (at its link), maxed over the links (`network.group_seconds`).
    O(B G C) per shared level with G its links. `side`: `_Prefixes`' columns."""
    B, _, X = side.shape
    M, C = cands.shape[1], cuts.shape[1]
    D = X - 2 * M - C
    out = np.zeros((B, 2, C))
    if not state.shared:
        return out
    links = state.cost.cluster.links()
    inputs = state.group_inputs(side)  # [B, S, 4, X]
    rows = np.arange(B)[:, None]
    # The priced prefix (index into cuts) from which each candidate counts.
    if all_cuts:
        seg = np.broadcast_to(np.arange(M), (B, M))
    else:
        seg = np.stack(
            [
                np.searchsorted(np.where(c > 0, c, np.iinfo(np.int64).max), np.arange(1, M + 1))
                for c in cuts
            ]
        )
    for s, (v, size) in enumerate(state.shared):
        G = D // size
        x = inputs[:, s]  # [B, 4, X]
        base = x[:, :, :D].reshape(B, 4, G, size).sum(axis=3)  # [B, 4, G]
        delta = x[:, :, D + M : D + 2 * M] - x[:, :, D : D + M]  # [B, 4, M]
        keep = valid & (seg < C)
        b_i, k_i = np.nonzero(keep)
        g_i = cands[b_i, k_i] // size
        flat = ((b_i[:, None] * 4 + np.arange(4)) * G + g_i[:, None]) * C + seg[b_i, k_i][:, None]
        acc = np.bincount(
            flat.ravel(), weights=delta[b_i, :, k_i].ravel(), minlength=B * 4 * G * C
        ).reshape(B, 4, G, C)
        load = np.cumsum(acc, axis=3)
        load += base[..., None]
        hg = home // size
        load[rows[:, 0], :, hg] += x[:, :, D + 2 * M :] - x[rows[:, 0], :, home][:, :, None]
        busiest = load.max(axis=2)  # [B, 4, C]
        busy = np.where(busiest >= MIN_TRAFFIC_BYTES, busiest, 0.0) / links[v].bw_Bps
        np.maximum(out[:, 0], np.maximum(busy[:, 0], busy[:, 1]), out=out[:, 0])
        np.maximum(out[:, 1], np.maximum(busy[:, 2], busy[:, 3]), out=out[:, 1])
    return out


def search_layers(
    cost: CostModel, placement: Placement, counts: np.ndarray, slots: int, state: LayerState
) -> tuple[list[list[int]], list[list[list[int]]], list[list[float]]]:
    """Algorithm 1 (reconstructed) on every layer in lockstep. `placement`: homes only (its
    copies get the replicas); `counts[L, D, E]`; `state`: the layers' stacked `LayerState`
    (updated). Each round takes the next expert of every layer still searching. Returns per
    layer the replicated experts, their replica devices, and the layer seconds before and
    after."""
    L, D, E = counts.shape
    home, copies = placement.home, placement.copies
    before = state.packed_layer_s(np.ascontiguousarray(state.cells.swapaxes(1, 2)))
    best = before.copy()
    order = np.argsort(-counts.sum(axis=1), axis=1, kind="stable")  # [L, E]
    used = np.bincount((np.arange(L)[:, None] * D + home).ravel(), minlength=L * D)
    used = used.reshape(L, D)  # slots used: the homes
    replicated: list[list[int]] = [[] for _ in range(L)]
    devices: list[list[list[int]]] = [[] for _ in range(L)]
    every_device = np.arange(D)
    # The layers still searching and the position in its order of each one's next expert.
    active = np.arange(L) if E else np.zeros(0, dtype=np.int64)
    nxt = np.zeros(active.size, dtype=np.int64)
    while active.size:
        e = order[active, nxt]
        nxt += 1
        h = home[active, e]
        col = counts[active, :, e]  # [A, D]
        # Senders without a copy (the expert is seen once: its only copy is the home) and with
        # a free slot.
        ok = (col > 0) & (every_device != h[:, None]) & (used[active] < slots)
        has = ok.any(axis=1)
        # No candidate: skip the expert (every sender is out of slots), or stop when it has no
        # tokens (nor has any later expert). Otherwise go on while replicas bring a gain.
        go = None if has.all() else np.flatnonzero(has)
        if go is None:
            cont = np.zeros(active.size, dtype=bool)
            lyr, eg, hg, ok_g, col_g = active, e, h, ok, col
        else:
            cont = col.sum(axis=1) > 0
            lyr, eg, hg, ok_g, col_g = active[go], e[go], h[go], ok[go], col[go]
        if lyr.size:
            # (R is never updated: each expert's column is read once, before it changes.)
            pre = _Prefixes(state, lyr, hg, ok_g, col_g, state.R[lyr, hg, eg])
            rows = np.arange(lyr.size)
            j = np.argmin(pre.times, axis=1)  # times[b, j]: the cuts[b, j] heaviest senders
            t_best = pre.times[rows, j]
            better = t_best < best[lyr]  # the first expert without gain ends the search
            if go is None:
                cont = better
            else:
                cont[go] = better
            if better.any():
                n = np.where(better, pre.cuts[rows, j], 0)  # replicas taken
                M = pre.cands.shape[1]
                rb, kb = np.nonzero(np.arange(M)[None, :] < n[:, None])
                ll, dd = lyr[rb], pre.cands[rb, kb]
                copies[ll, dd, eg[rb]] = 1
                used[ll, dd] += 1
                # The messages' multiplicities follow (`_Prefixes`).
                hh = hg[rb]
                tb = state.cost.spec.token_bytes
                state.carried[ll, dd, hh] -= sends(counts[ll, dd, eg[rb]], tb)
                state.trans_carried[ll, hh, dd] += 1
                # The replicas and the home take the states they were priced in.
                state.cells[ll, dd] = pre.side[rb, :, D + M + kb]
                b = np.flatnonzero(better)
                lb, jb = lyr[b], j[b]
                state.cells[lb, hg[b]] = pre.side[b, :, D + 2 * M + jb]
                best[lb] = t_best[b]
                chosen = pre.cands[b].tolist()
                picked = zip(lb.tolist(), eg[b].tolist(), n[b].tolist(), strict=True)
                for i, (layer, ex, k) in enumerate(picked):
                    replicated[layer].append(ex)
                    devices[layer].append(chosen[i][:k])
        cont &= nxt < E
        active, nxt = active[cont], nxt[cont]
    return replicated, devices, [[float(x), float(y)] for x, y in zip(before, best, strict=True)]


@register(NAME, builds_on="homes")
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """`loads[L, D, E]` predicted tokens -> Plan with Pro-Prophet's lightweight placement.

    More devices than experts (E < D; Pro-Prophet has one expert per GPU): the plan keeps the
    static placement's expert-data-parallel copies and its routing over them
    (`poise.core.static_ep`: DeepSpeed-MoE's expert-parallel groups where E divides D), and no
    lightweight replicas are searched (the search prices replicas against a single home), so
    the plan is static's."""
    L, D, E = loads.shape
    cost = prophet_cost(ctx)
    if E < D:
        static = static_placement(L, E, D, ctx.slots_per_device)
        routing = static_assignment(static)
        static_s = cost.price(static, routing, loads).layer_s.tolist()
        notes_edp: dict[str, Any] = {
            "replicated": [[] for _ in range(L)],
            "replica_devices": [[] for _ in range(L)],
            "prophet_layer_s": [[t, t] for t in static_s],
            "schedule": cost.schedule.name,
            "edp_copies": True,
        }
        return finish_plan(NAME, static, routing, loads, previous, ctx, notes_edp)
    placement = Placement.from_homes(start_homes(previous, ctx, L), D, ctx.slots_per_device)
    state = LayerState.for_homes(cost, placement.home, loads)
    replicated, replica_devices, layer_s = search_layers(
        cost, placement, loads, ctx.slots_per_device, state
    )
    notes: dict[str, Any] = {
        "replicated": replicated,
        "replica_devices": replica_devices,
        "prophet_layer_s": layer_s,
        "schedule": cost.schedule.name,
    }
    assignment = Assignment.to_home(placement)
    # The search priced each prefix as the cost model does, up to the device a broadcast enters
    # a node by (`_broadcast_hops`); the plan is priced by the cost model itself.
    return finish_plan(NAME, placement, assignment, loads, previous, ctx, notes)
