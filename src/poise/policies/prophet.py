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
from poise.cost_incremental import PREFIX_EXACT, PREFIX_POINTS, LayerState, prefix_cuts
from poise.placement import Assignment, Placement, Plan
from poise.policies.base import PlanContext, finish_plan, register, start_homes
from poise.schedule import Schedule

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
    """Replicating expert `expert[b]` (home `home[b]`) of layer `layer[b]` on prefixes of its
    candidates `cands[b, :m[b]]` (heaviest first), for B layers at once: the prefix lengths
    `cuts[B, C]` priced (0-padded; all of 1..m when m is small, else a grid:
    `cost_incremental.prefix_cuts`), the layer seconds `times[B, C]` (inf at padding), and what
    the home's state becomes after each prefix (`home_tok_recv[B, C, 3]`, `home_par_send[B, C,
    3]`, `home_comp[B, C]`)."""

    def __init__(
        self,
        state: LayerState,
        counts: np.ndarray,
        layer: np.ndarray,
        expert: np.ndarray,
        home: np.ndarray,
        ok: np.ndarray,
    ) -> None:
        """Layer seconds after each priced prefix, in O(B (D + m)).

        Per added replica d: d keeps its own tokens of e (its dispatch sends and its compute
        change once, at its step) and receives W_e; the home h receives fewer tokens and sends
        one more W_e at every step. So for a prefix of length c the slowest device is the
        slowest of: the home in its state after c steps, the candidates before c in their
        changed state (a running maximum), the candidates from c on and every other device in
        their current state (a suffix maximum and a constant). Equal to pricing each prefix's
        full state (`LayerState.layer_s`); no `[C, 3, D]` state is built. `ok[B, D]`: the
        candidate senders of each layer's expert."""
        cluster = state.cost.cluster
        B, D = ok.shape
        b_idx = np.arange(B)
        rows = b_idx[:, None]
        col = counts[layer, :, expert]  # [B, D]
        m = ok.sum(axis=1)
        M = int(m.max())
        # Candidates: senders by tokens, descending (stable: lower device first).
        cands = np.argsort(np.where(ok, -col, np.inf), axis=1, kind="stable")[:, :M]
        valid = np.arange(M)[None, :] < m[:, None]  # [B, M]
        cuts = _padded_cuts(m)
        C = cuts.shape[1]
        last = np.maximum(cuts - 1, 0)
        W_e = state.cost.spec.expert_bytes
        steps = np.arange(M)[None, :]
        tok = np.where(valid, col[rows, cands], 0.0)  # [B, M]
        lv = cluster.level_between(home[:, None], cands)  # link level home -> candidate
        comp, tok_send, tok_recv = state.comp[layer], state.tok_send[layer], state.tok_recv[layer]
        par_send, par_recv = state.par_send[layer], state.par_recv[layer]
        # The home after each priced prefix.
        per_step = np.zeros((B, M, 3))
        per_step[rows, steps, lv] = -tok
        self.home_tok_recv = (
            tok_recv[b_idx, :, home][:, None, :] + np.cumsum(per_step, axis=1)[rows, last]
        )  # [B, C, 3]
        per_step[rows, steps, lv] = np.where(valid, W_e, 0.0)
        self.home_par_send = (
            par_send[b_idx, :, home][:, None, :] + np.cumsum(per_step, axis=1)[rows, last]
        )
        r_home = state.R[layer, home, expert]  # [B]
        left = r_home[:, None] - np.cumsum(tok, axis=1)[rows, last]  # tokens the home computes
        self.home_comp = (
            comp[b_idx, home][:, None]
            + state.comp_s(np.maximum(left, 0.0))
            - state.comp_s(r_home)[:, None]
        )
        # Each candidate after its own step.
        at = (rows[:, :, None], np.arange(3)[None, :, None], cands[:, None, :])  # -> [B, 3, M]
        c_send = tok_send[at]
        c_send[rows, lv, steps] -= tok
        c_par_recv = par_recv[at]
        c_par_recv[rows, lv, steps] += W_e

        # Per-device terms of every device now [D], each candidate after its step [M] and the
        # home after each prefix [C], side by side in one pass: [3 (compute, a2a, Trans), B, X].
        def side(now: np.ndarray, cand: np.ndarray, home_after: np.ndarray) -> np.ndarray:
            return np.concatenate([now, cand, home_after], axis=-1)

        h_send = np.broadcast_to(tok_send[b_idx, :, home][:, :, None], (B, 3, C))
        h_par_recv = np.broadcast_to(par_recv[b_idx, :, home][:, :, None], (B, 3, C))
        terms = np.stack(
            state.device_terms(
                side(comp, comp[rows, cands] + state.comp_s(tok), self.home_comp),
                side(tok_send, c_send, h_send),
                side(tok_recv, tok_recv[at], self.home_tok_recv.transpose(0, 2, 1)),
                side(par_send, par_send[at], self.home_par_send.transpose(0, 2, 1)),
                side(par_recv, c_par_recv, h_par_recv),
            )
        )
        now, after, home_after = terms[..., :D], terms[..., D : D + M], terms[..., D + M :]
        others = np.ones((B, D), dtype=bool)
        others[rows, cands] = ~valid
        others[b_idx, home] = False
        rest = np.where(others, now, -np.inf).max(axis=2)[..., None]  # [3, B, 1]
        changed = np.maximum.accumulate(after, axis=2)[:, rows, last]  # candidates before the cut
        cand_now = np.where(valid, now[:, rows, cands], -np.inf)
        later = np.maximum.accumulate(cand_now[..., ::-1], axis=2)[..., ::-1]  # from each on
        later = np.concatenate([later, np.full((3, B, 1), -np.inf)], axis=2)
        unchanged = later[:, rows, cuts]
        slowest = np.maximum(np.maximum(home_after, rest), np.maximum(changed, unchanged))
        self.cuts = cuts
        self.times = np.where(cuts > 0, state.layer_s_from_max(*slowest), np.inf)
        self.cands, self.tok, self.lv = cands, tok, lv


def search_layers(
    cost: CostModel, placement: Placement, counts: np.ndarray, slots: int, state: LayerState
) -> tuple[list[list[int]], list[list[list[int]]], list[list[float]]]:
    """Algorithm 1 (reconstructed) on every layer in lockstep. `placement`: homes only (its
    copies get the replicas); `counts[L, D, E]`; `state`: the layers' stacked `LayerState`
    (updated). Each round takes the next expert of every layer still searching. Returns per
    layer the replicated experts, their replica devices, and the layer seconds before and
    after."""
    L, _, E = counts.shape
    W_e = cost.spec.expert_bytes
    home, copies = placement.home, placement.copies
    before = state.layer_s(
        state.comp, state.tok_send, state.tok_recv, state.par_send, state.par_recv
    )
    best = before.copy()
    order = np.argsort(-counts.sum(axis=1), axis=1, kind="stable")  # [L, E]
    used = copies.sum(axis=2)  # [L, D]
    nxt = np.zeros(L, dtype=np.int64)  # each layer's next position in its order
    replicated: list[list[int]] = [[] for _ in range(L)]
    devices: list[list[list[int]]] = [[] for _ in range(L)]
    active = np.arange(L)
    while True:
        active = active[nxt[active] < E]
        if not active.size:
            break
        e = order[active, nxt[active]]
        col = counts[active, :, e]  # [A, D]
        ok = (col > 0) & (copies[active, :, e] == 0) & (used[active] < slots)
        has = ok.any(axis=1)
        # No candidate: skip the expert (every sender is out of slots), or stop when it has no
        # tokens (nor has any later expert).
        stop = ~has & (col.sum(axis=1) <= 0)
        nxt[active[~has]] += 1
        go = np.flatnonzero(has)
        gain = np.zeros(active.size, dtype=bool)
        if go.size:
            lyr, eg = active[go], e[go]
            hg = home[lyr, eg]
            pre = _Prefixes(state, counts, lyr, eg, hg, ok[go])
            j = np.argmin(pre.times, axis=1)  # times[b, j]: the cuts[b, j] heaviest senders
            b_idx = np.arange(go.size)
            t_best = pre.times[b_idx, j]
            better = t_best < best[lyr]  # the first expert without gain ends the search
            gain[go] = better
            if better.any():
                b = np.flatnonzero(better)
                lb, eb, hb, jb = lyr[b], eg[b], hg[b], j[b]
                n = pre.cuts[b, jb]
                sel = np.arange(pre.cands.shape[1])[None, :] < n[:, None]  # [n_b, M]
                rb, kb = np.nonzero(sel)
                ll, dd = lb[rb], pre.cands[b[rb], kb]
                tok, lv = pre.tok[b[rb], kb], pre.lv[b[rb], kb]
                copies[ll, dd, eb[rb]] = 1
                used[ll, dd] += 1
                state.tok_send[ll, lv, dd] -= tok
                state.par_recv[ll, lv, dd] += W_e
                state.comp[ll, dd] += state.comp_s(tok)
                state.tok_recv[lb, :, hb] = pre.home_tok_recv[b, jb]
                state.par_send[lb, :, hb] = pre.home_par_send[b, jb]
                state.comp[lb, hb] = pre.home_comp[b, jb]
                # (R is not updated: each expert's column is read once, before it changes.)
                best[lb] = t_best[b]
                nxt[lb] += 1
                chosen = pre.cands[b].tolist()
                for i, (layer, ex) in enumerate(zip(lb.tolist(), eb.tolist(), strict=True)):
                    replicated[layer].append(ex)
                    devices[layer].append(chosen[i][: int(n[i])])
        active = active[~stop & (gain | ~has)]
    return replicated, devices, [[float(x), float(y)] for x, y in zip(before, best, strict=True)]


@register(NAME)
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """`loads[L, D, E]` predicted tokens -> Plan with Pro-Prophet's lightweight placement."""
    L, D, _ = loads.shape
    cost = prophet_cost(ctx)
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
    return finish_plan(NAME, placement, Assignment.to_home(placement), loads, previous, ctx, notes)
