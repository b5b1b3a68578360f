"""`hybrid`: HybridEP's hybrid expert/data transmission (Yang et al., arXiv 2510.19470).

Devices are cut into *domains* (`cluster.domain_of()`): inside a domain, experts travel (an
expert needed there is copied into the domain once and its tokens stay in the domain); across
domains, tokens travel by all-to-all as in plain EP. A single-domain cluster whose inter-node
link is slower per device than its intra-node link uses nodes as domains; otherwise the policy
keeps the static placement (nothing to gain from moving experts).

The paper's stream model (§III; G GPUs, D bytes of data a GPU sends in an all-to-all, P_E bytes
per expert, B bandwidth, Lat_PE the expert compute that can hide an all-gather). Definition 1:
p is the fraction of a GPU's outgoing data chunks still sent by all-to-all, the rest replaced
by gathering the experts instead. Volumes: all-to-all D (G - 1) / G p (eq. 3), all-gather
P_E (G - 1) (1 - p) (eq. 4); time = all-gather + 2 all-to-all (eq. 5), the all-gather hidden up
to Lat_PE (eq. 7), so

    Lat(p) = Lat_PE + 2 D (G - 1) p / (G B)                   if p >= 1 - B Lat_PE / (P_E (G-1))
    Lat(p) = p (G - 1) (2 D - G P_E) / (B G) + (G - 1) P_E / B    otherwise     (eq. 10-12)

and the optimum is p* = 1 - B Lat_PE / (P_E (G - 1)) when 2 D < G P_E, else p* = 0. The paper
assumes even routing and uniform chunks, gives every GPU of a domain every expert it gathers,
and has no gradient return.

What we do instead (the same trade, on measured loads and the full cost model). Per layer,
let T[g, e] be the tokens domain g sends to expert e homed outside g. Plain EP sends all of them
across domains: X = sum T[g, e] tokens, 4 X B_t bytes a step (dispatch and combine, forward
and backward). Replicating e into g instead moves W_e of weights in (Trans) and W_e of gradients
out (Agg) and keeps 4 T[g, e] B_t bytes of tokens inside g. The data fraction still sent across
domains is, as in Definition 1,

    p = 1 - sum_{(g, e) replicated} T[g, e] / X          (p = 1: plain EP, p = 0: all experts)

Pairs (g, e) are taken greedily by saved bytes per moved byte, 4 T[g, e] B_t / (2 W_e),
(descending, stable: lower domain, then heavier and lower-index expert first), subject to the
domain's free slots; the cut k* (the number of pairs taken) minimises the cost model's layer time
(`ctx.cost`: all-to-all per link level, expert compute, Trans and Agg under `ctx.cost.schedule`),
and p* = p(k*) in [0, 1]. Each cut is priced incrementally on its layer (checked against
`CostModel.price` in the tests). The paper's closed form, on the same layer's averages, is in
the notes (`p_closed_form`) for comparison.

A domain holds one replica of each expert moved into it, on the device of the domain that sends
most tokens to that expert among those with a free slot (lowest index on ties); every device of
the domain sends its tokens for that expert to that replica (`Assignment.group_local`: group
weights route inside the domain, other sources go to the home). Trans is a broadcast (the cost
model's): the copy crosses the wide-area link once per domain however many of its devices hold
it, so further copies inside the domain would only add intra-domain hops and take slots.

More devices than experts: the static placement already holds expert-data-parallel copies of every
expert (`poise.core.static_ep`: with E dividing D, DeepSpeed-MoE's expert-parallel groups of E
consecutive devices, device d holding expert d mod E and each token going to the copy in its
own group; else a block of devices per expert, its tokens split over all copies), so a domain
holds only some experts unless the EP groups lie inside the domains. Where they do (the domain
size a multiple of E) static already keeps every token in its domain and the plan is static's
(p* = 1). Otherwise the policy keeps those copies, gives every domain a copy of each expert it
lacks, heaviest first, while free slots last (the paper's p = 0 inside the domain), and routes
each domain's tokens to its own copies (`group_local` by domain; an expert a domain still lacks
is split over all copies); in each layer where the cost model prices that above static's
placement and routing, the layer keeps static's (p* = 1). One assignment has one group size,
so with DeepSpeed's EP groups a plan whose layers would mix the two keeps either static in
every layer or, in the layers without domain copies, the even split over the static copies,
whichever prices less over all layers (`notes["ep_group_size"]`: E with EP groups, else 0).
p* is reported as the cross-domain share of tokens left against static's.

Notes: `p_star[l]`, `p_closed_form[l]`, `domain_level` ("domain", "node" or None),
`domain_size` (devices), `replicated[l][g]` (experts moved into domain g, in greedy order),
`replica_device[l][g]`, `hybrid_layer_s[l]` (predicted layer seconds at k = 0 and k*).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.placement import Assignment, Placement, Plan
from poise.core.static_ep import ep_group_size, static_assignment
from poise.cost.incremental import (
    PREFIX_EXACT,
    PREFIX_POINTS,
    LayerState,
    prefix_cuts,
)
from poise.cost.traffic import sends
from poise.plan.policies.base import (
    PlanContext,
    finish_plan,
    register,
    start_homes,
    static_placement,
)

NAME = "hybrid"
_CHUNK_CELLS = 2**21  # prefix states (layers x cuts x 13 D) priced at once


def expert_domain(ctx: PlanContext) -> int | None:
    """HybridEP's expert-domain size S_ED in domains (`--option hybrid.expert_domain=N`): a
    domain gathers only the experts held in its block of N consecutive domains (the paper's
    §V-G "S_ED fixed"); None (the default): any expert, the domains as large as the cut
    chooses ("p fixed")."""
    value = ctx.option(NAME, "expert_domain", None)
    return None if value is None else int(value)


def domain_grouping(cluster: Cluster) -> tuple[str | None, int]:
    """`(level, devices per domain)` HybridEP partitions on: the cluster's domains, nodes when a
    single domain's inter-node link is the per-device bottleneck, else `(None, 0)`."""
    if cluster.domains > 1:
        return "domain", cluster.devices_per_domain
    if cluster.num_nodes > 1 and (
        cluster.inter_node.per_device_bw_Bps < cluster.intra_node.per_device_bw_Bps
    ):
        return "node", cluster.devices_per_node
    return None, 0


@dataclass
class Pairs:
    """Greedy candidates of L layers: pair i is `(group[i], expert[i], device[i])` of layer
    `layer[i]` with `tokens[i]` = T[group, expert]; layer l's pairs are `start[l]:start[l + 1]`,
    in the order they are taken. `T[L, G, E]`: tokens each group sends to each expert."""

    layer: np.ndarray
    group: np.ndarray
    expert: np.ndarray
    device: np.ndarray
    tokens: np.ndarray
    start: np.ndarray
    T: np.ndarray


def _first_sorted(key: np.ndarray, k: int) -> np.ndarray:
    """`np.argsort(key, axis=1, kind="stable")[:, :k]` (`key[X, n]`, `1 <= k <= n`): the k
    smallest of each row, ties by lower index, without sorting whole rows. A partition finds
    each row's k-th smallest value; only the entries up to it (ties included) are sorted."""
    X, n = key.shape
    if k >= n:
        return np.argsort(key, axis=1, kind="stable")
    kth = np.partition(key, k - 1, axis=1)[:, k - 1 : k]
    row, col = np.nonzero(key <= kth)  # row by row, lower index first: at least k per row
    order = np.lexsort((key[row, col], row))  # stable: ties keep the lower index first
    row, col = row[order], col[order]
    rank = np.arange(len(row)) - np.searchsorted(row, np.arange(X))[row]
    keep = rank < k
    out = np.empty((X, k), dtype=np.int64)
    out[row[keep], rank[keep]] = col[keep]
    return out


def choose_pairs(
    counts: np.ndarray,
    home: np.ndarray,
    free: np.ndarray,
    size: int,
    expert_domain: int | None = None,
) -> Pairs:
    """Greedy candidates of every layer: `counts[L, D, E]`, `home[L, E]`, `free[L, D]` free
    slots, `size` devices per group; `expert_domain` (HybridEP's S_ED, in groups; None: all):
    a group may take only experts homed in its block of `expert_domain` consecutive groups.
    Each group's wanted experts (homed outside it, with tokens) most tokens first (stable: lower
    expert first), each on the group's device that sends it most tokens among those with a free
    slot (lowest device on ties); a layer's pairs are then ordered by T descending (stable:
    group by group, picks in order)."""
    L, D, E = counts.shape
    G = D // size
    per_group = counts.reshape(L, G, size, E)
    T = per_group.sum(axis=2)  # [L, G, E] tokens each group sends to e
    home_group = home[:, None, :] // size  # [L, 1, E]
    wanted = (home_group != np.arange(G)[None, :, None]) & (T > 0)
    if expert_domain is not None:
        wanted &= home_group // expert_domain == np.arange(G)[None, :, None] // expert_domain
    free = free.reshape(L * G, size).copy()
    take = np.minimum(free.sum(axis=1), wanted.reshape(L * G, E).sum(axis=1))  # pairs per group
    K = int(take.max(initial=0))
    if K == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Pairs(empty, empty, empty, empty, np.zeros(0), np.zeros(L + 1, dtype=np.int64), T)
    # The first K wanted experts of every (layer, group), and what each device sends them.
    ranked = _first_sorted(np.where(wanted, -T, np.inf).reshape(L * G, E), K)  # [L G, K]
    at = (np.arange(L * G * size) * E).reshape(L * G, size, 1) + ranked[:, None, :]
    sends = np.take(counts.reshape(-1), at)  # [L G, size, K]
    # Every (layer, group) in lockstep: pick i of each that still takes one. Within a group
    # the picks stay sequential (each takes a free slot the next cannot).
    picks = np.empty((L * G, K), dtype=np.int64)
    rows = np.arange(L * G)
    for i in range(K):
        j = np.where(free > 0, sends[:, :, i], -np.inf).argmax(axis=1)  # first max: lowest
        picks[:, i] = j
        free[rows, j] -= take > i
    lg, rank = np.nonzero(np.arange(K)[None, :] < take[:, None])
    lyr, g = np.divmod(lg, G)
    e, j = ranked[lg, rank], picks[lg, rank]
    t = T[lyr, g, e]
    # Per layer: T descending; W_e is the same for all, so ratio order = T order.
    order = np.lexsort((rank, g, -t, lyr))
    lyr, g, e, j, t = lyr[order], g[order], e[order], j[order], t[order]
    start = np.searchsorted(lyr, np.arange(L + 1))
    return Pairs(lyr, g, e, g * size + j, t, start, T)


def _prefix_states(
    base: np.ndarray, cell: np.ndarray, seg: np.ndarray, value: np.ndarray, cuts: int
) -> np.ndarray:
    """`[cuts, B, width]` states of B layers after each priced prefix: `base[B, width]`; entry
    i adds `value[i]` to cell `cell[i]` of prefix-and-layer `seg[i]` (`first prefix that counts it
    * B + b`) and of every later prefix of its layer (`cost.incremental.prefix_states` for several
    layers and several state arrays side by side; per cell, the entries are summed in the order
    given, the prefixes accumulated in order, then added to the base). Prefix-major, so each
    step of the accumulation adds one contiguous block."""
    B, width = base.shape
    sums = np.bincount(seg * width + cell, weights=value, minlength=cuts * B * width)
    sums = sums.astype(np.float64, copy=False).reshape(cuts, B, width)  # (no entries: int zeros)
    for g in range(1, cuts):  # np.cumsum(sums, axis=0), bit for bit, a block at a time
        np.add(sums[g], sums[g - 1], out=sums[g])
    sums += base
    return sums


def pair_steps(
    key: np.ndarray, order: np.ndarray, delta: np.ndarray, start: np.ndarray
) -> np.ndarray:
    """`[N]` the change (-1, 0, +1) each event makes to whether its message exists: event i
    adds `delta[i]` to the multiplicity of the message `key[i]` (the experts it carries), which
    starts at `start[i]` (the same for every event of a key), the events of a key taken in
    ascending `order[i]`; the message exists while its multiplicity is > 0."""
    N = len(key)
    if not N:
        return np.zeros(0)
    by = np.lexsort((order, key))
    k, d = key[by], delta[by]
    total = np.cumsum(d)
    first = np.ones(N, dtype=bool)
    first[1:] = k[1:] != k[:-1]
    run_start = np.maximum.accumulate(np.where(first, np.arange(N), 0))
    after = start[by] + total - (total[run_start] - d[run_start])
    out = np.empty(N)
    out[by] = (after > 0).astype(np.float64) - (after - d > 0)
    return out


def cut_times(
    state: LayerState, counts: np.ndarray, home: np.ndarray, size: int, pairs: Pairs
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(cuts[B, C], seconds[B, C], states[C, B, CELLS, D])` for B layers: layer seconds with
    the first k pairs of each layer replicated for every k in the layer's `prefix_cuts` (every
    k = 0..K when K is small, else a grid), padded with -1 and inf after the layer's own cuts,
    and the per-device state (`LayerState.cells`, transposed) after each priced prefix.
    `state`: the layers' stacked `LayerState` (`LayerState.for_homes`), `counts[B, D, E]`,
    `home[B, E]`, `pairs` of these layers."""
    LS = LayerState
    B, D, _ = counts.shape
    start = pairs.start
    K = np.diff(start)
    Kmax = int(K.max(initial=0))
    lyr, groups, experts, devices, tokens = (
        pairs.layer,
        pairs.group,
        pairs.expert,
        pairs.device,
        pairs.tokens,
    )
    N = len(experts)
    pos = np.arange(N) - start[lyr]  # index of each pair in its layer
    if Kmax + 1 <= PREFIX_EXACT + PREFIX_POINTS:  # every prefix: pair k first counts at k + 1
        C = Kmax + 1
        cuts = np.arange(C)[None, :].repeat(B, 0)
        cuts[cuts > K[:, None]] = -1
        seg = pos + 1
    else:
        cut_list = [prefix_cuts(int(k)) for k in K]
        C = max(len(c) for c in cut_list)
        cuts = np.full((B, C), -1, dtype=np.int64)
        for b, c in enumerate(cut_list):
            cuts[b, : len(c)] = c
        # seg[i]: the first priced prefix of its layer that includes pair i.
        seg = np.concatenate(
            [
                np.searchsorted(c, np.arange(int(k)), side="right")
                for c, k in zip(cut_list, K, strict=True)
            ]
        ).astype(np.int64)
    seg = seg * B + lyr
    h = home[lyr, experts]  # [N]
    src = groups[:, None] * size + np.arange(size)[None, :]  # [N, m] sources of each pair
    tok = counts[lyr[:, None], src, experts[:, None]]  # [N, m]
    lv_sh = state.level_between(src, h[:, None])
    lv_sr = state.level_between(src, devices[:, None])
    stays = lv_sr >= 0  # sources other than the replica device itself
    seg_m = np.repeat(seg, size).reshape(N, size)
    # Pair k: its group's sources stop sending e's tokens to the home and send them to the
    # replica device instead (the replica device's own tokens stay local).
    dst = devices[:, None].repeat(size, 1)
    send_seg = np.concatenate([seg_m.ravel(), seg_m[stays]])
    send_lv = np.concatenate([lv_sh.ravel(), lv_sr[stays]])
    send_dev = np.concatenate([src.ravel(), src[stays]])
    recv_dev = np.concatenate([(h[:, None] + 0 * src).ravel(), dst[stays]])
    delta = np.concatenate([-tok.ravel(), tok[stays]])
    lv_hr = state.level_between(h, devices)
    W_e = np.full(N, state.cost.spec.expert_bytes)
    # Messages (`cost.messages`), a pair's multiplicity (the experts it carries) going to or
    # from zero: each source of the group with a message's worth of e's tokens (`sends`) stops
    # sending them to the home (s -> h, one expert less) and, but for the replica device, sends
    # them to the replica (s -> j, one more); the home sends the replica device one Trans
    # message, the first time it sends it any expert (homes only before: no Trans messages).
    go = sends(tok, state.cost.spec.token_bytes)  # [N, m]
    pos_m = np.repeat(pos, size).reshape(N, size)
    lyr_m = np.repeat(lyr, size).reshape(N, size)
    carried = state.carried  # [B, D, D] the experts each message carries (`home_pairs`)
    assert carried is not None, "cut_times prices a `LayerState.for_homes` state"
    ev_lyr = np.concatenate([lyr_m[go], lyr_m[go & stays]])
    ev_src = np.concatenate([src[go], src[go & stays]])
    ev_dst = np.concatenate([np.broadcast_to(h[:, None], src.shape)[go], dst[go & stays]])
    ev_delta = np.concatenate([np.full(int(go.sum()), -1.0), np.ones(int((go & stays).sum()))])
    ev_step = pair_steps(
        (ev_lyr * D + ev_src) * D + ev_dst,
        np.concatenate([pos_m[go], pos_m[go & stays]]),
        ev_delta,
        carried[ev_lyr, ev_src, ev_dst],
    )
    ev_seg = np.concatenate([seg_m[go], seg_m[go & stays]])
    ev_lv = np.concatenate([lv_sh[go], lv_sr[go & stays]])
    moved = ev_step != 0
    ev_seg, ev_lv, ev_step = ev_seg[moved], ev_lv[moved], ev_step[moved]
    ev_src, ev_dst = ev_src[moved], ev_dst[moved]
    par_step = pair_steps((lyr * D + h) * D + devices, pos, np.ones(N), np.zeros(N))
    # Compute: the replica takes the whole group's tokens; the home loses them. `before[i]`:
    # tokens of e moved away from its home by the layer's earlier pairs (a running sum over the
    # layer's pairs sorted by expert, stable).
    order = np.lexsort((pos, experts, lyr))
    se, st, sl = experts[order], tokens[order], lyr[order]
    run = np.ones(N, dtype=bool)
    run[1:] = (se[1:] != se[:-1]) | (sl[1:] != sl[:-1])
    first = np.maximum.accumulate(np.where(run, np.arange(N), 0)) - start[sl]
    padded = np.zeros((B, Kmax))
    padded[sl, pos] = st  # pos of sorted entries: their index in the layer's sorted order
    cum = np.cumsum(padded, axis=1)
    cum_first = cum[sl, np.maximum(first - 1, 0)]
    before_sorted = cum[sl, pos] - st - np.where(first > 0, cum_first, 0.0)
    before = np.empty(N)
    before[order] = before_sorted
    # Trans is a broadcast (`traffic.replica_traffic`): the home sends each expert's copy once,
    # at the first of its pairs (every pair of an expert is in another domain, one replica per
    # domain, so each replica receives it over the level between its domain and the home's).
    first_pair = np.empty(N, dtype=bool)
    first_pair[order] = run
    r_home = state.R[lyr, h, experts] - before
    comp_seg = np.concatenate([seg, seg])
    comp_dev = np.concatenate([devices, h])
    # Seconds of the replica's tokens, of what the home keeps and of what it had, in one pass.
    secs = state.comp_s(np.concatenate([tokens, np.maximum(r_home - tokens, 0.0), r_home]))
    comp_delta = np.concatenate([secs[:N], secs[N : 2 * N] - secs[2 * N :]])
    # All five per-device states side by side (`LayerState.cells` as columns), [B, CELLS * D]:
    # compute, then dispatch tokens and Trans bytes sent, then received, each per link level.
    base = np.ascontiguousarray(state.cells.transpose(0, 2, 1)).reshape(B, LS.CELLS * D)
    step = LS.LEVEL_STEP
    cell = np.concatenate(
        [
            comp_dev,
            (LS.TOK_SEND + step * send_lv) * D + send_dev,
            (LS.TOK_RECV + step * send_lv) * D + recv_dev,
            (LS.PAR_SEND + step * lv_hr) * D + h,
            (LS.PAR_RECV + step * lv_hr) * D + devices,
            (LS.MSG_TOK_OUT + step * ev_lv) * D + ev_src,
            (LS.MSG_TOK_IN + step * ev_lv) * D + ev_dst,
            (LS.MSG_PAR_OUT + step * lv_hr) * D + h,
            (LS.MSG_PAR_IN + step * lv_hr) * D + devices,
        ]
    )
    states = _prefix_states(
        base,
        cell,
        np.concatenate([comp_seg, send_seg, send_seg, seg, seg, ev_seg, ev_seg, seg, seg]),
        np.concatenate(
            [
                comp_delta,
                delta,
                delta,
                np.where(first_pair, W_e, 0.0),
                W_e,
                ev_step,
                ev_step,
                par_step,
                par_step,
            ]
        ),
        C,
    )
    states = states.reshape(C, B, LS.CELLS, D)
    times = state.packed_layer_s(states).T  # [B, C]
    return cuts, np.where(cuts >= 0, times, np.inf), states


@register(NAME, builds_on="homes")
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """`loads[L, D, E]` predicted tokens -> Plan with HybridEP's per-domain expert replicas."""
    L, D, _ = loads.shape
    placement = Placement.from_homes(start_homes(previous, ctx, L), D, ctx.slots_per_device)
    level, size = domain_grouping(ctx.cluster)
    notes: dict[str, Any] = {"domain_level": level, "domain_size": size}
    if level is None:
        notes.update(
            p_star=[1.0] * L,
            replicated=[[] for _ in range(L)],
            replica_device=[[] for _ in range(L)],
        )
        return finish_plan(
            NAME, placement, Assignment.to_home(placement), loads, previous, ctx, notes
        )
    if loads.shape[2] < D:  # more devices than experts
        return _plan_with_edp_copies(loads, previous, ctx, notes, size)
    G = D // size
    home = placement.home
    homed = np.bincount((np.arange(L)[:, None] * D + home).ravel(), minlength=L * D)
    free = ctx.slots_per_device - homed.reshape(L, D)  # [L, D] (the copies are the homes)
    pairs = choose_pairs(loads, home, free, size, expert_domain(ctx))
    state = LayerState.for_homes(ctx.cost, home, loads)
    # Layers in chunks whose prefix states stay within _CHUNK_CELLS cells per array.
    C = len(prefix_cuts(int(np.diff(pairs.start).max(initial=0))))
    chunk = max(1, _CHUNK_CELLS // (C * LayerState.CELLS * D))
    k = np.zeros(L, dtype=np.int64)
    layer_s: list[list[float]] = []
    chosen = np.empty((L, D, LayerState.CELLS))  # each layer's state at its chosen cut
    for lo in range(0, L, chunk):
        hi = min(L, lo + chunk)
        a, b = pairs.start[lo], pairs.start[hi]
        part = Pairs(
            pairs.layer[a:b] - lo,
            pairs.group[a:b],
            pairs.expert[a:b],
            pairs.device[a:b],
            pairs.tokens[a:b],
            pairs.start[lo : hi + 1] - a,
            pairs.T[lo:hi],
        )
        cuts, times, states = cut_times(
            state.take(slice(lo, hi)), loads[lo:hi], home[lo:hi], size, part
        )
        best = np.argmin(times, axis=1)  # first minimum: the fewest pairs on ties
        rows = np.arange(hi - lo)
        k[lo:hi] = cuts[rows, best]
        chosen[lo:hi] = states[best, rows].transpose(0, 2, 1)
        layer_s += np.stack([times[:, 0], times[rows, best]], axis=1).tolist()
    pos = np.arange(len(pairs.layer)) - pairs.start[pairs.layer]
    taken = pos < k[pairs.layer]
    placement.copies[pairs.layer[taken], pairs.device[taken], pairs.expert[taken]] = 1
    cross_T = np.where(home[:, None, :] // size != np.arange(G)[None, :, None], pairs.T, 0.0)
    p_star: list[float] = []
    for layer in range(L):
        a = int(pairs.start[layer])
        n = int(k[layer])
        cross = float(cross_T[layer].sum())
        p_star.append(1.0 - float(pairs.tokens[a : a + n].sum()) / cross if cross > 0 else 1.0)
    # The taken pairs of each (layer, group), in greedy order.
    key = pairs.layer[taken] * G + pairs.group[taken]
    by_group = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[by_group], np.arange(L * G + 1)).tolist()
    experts = pairs.expert[taken][by_group].tolist()
    devices = pairs.device[taken][by_group].tolist()
    spans = [[(bounds[i], bounds[i + 1]) for i in range(lg, lg + G)] for lg in range(0, L * G, G)]
    replicated = [[experts[a:b] for a, b in layer] for layer in spans]
    replica_device = [[devices[a:b] for a, b in layer] for layer in spans]
    notes.update(
        p_star=p_star,
        p_closed_form=p_closed_form(loads, home, size, ctx).tolist(),
        replicated=replicated,
        replica_device=replica_device,
        hybrid_layer_s=layer_s,
    )
    # `Assignment.group_local(placement, size)`, built from the pairs: a domain holds at most
    # one copy of each expert (its replica, or the home), so every holder's group weight is 1.
    to_home = Assignment.to_home(placement)
    group_weights = to_home.weights.copy()
    group_weights[pairs.layer[taken], pairs.expert[taken], pairs.device[taken]] = 1.0
    assignment = Assignment(to_home.weights, group_weights, size)
    # The search priced each cut as the cost model prices it (`LayerState.packed_layer_s`);
    # the plan is priced by the cost model itself.
    return finish_plan(NAME, placement, assignment, loads, previous, ctx, notes)


def p_closed_form(loads: np.ndarray, home: np.ndarray, size: int, ctx: PlanContext) -> np.ndarray:
    """`[L]` HybridEP's optimum p* (eq. 10-12, see the module docstring) on each layer's
    averages: G domains, D = the mean bytes a domain sends across domains per all-to-all, P_E =
    expert bytes, B = the per-device bandwidth of the link between domains (times the domain's
    devices), Lat_PE = the mean expert forward seconds per domain (what can hide the gather)."""
    cluster, spec = ctx.cluster, ctx.spec
    L, Dv, _ = loads.shape
    G = Dv // size
    if G < 2:
        return np.ones(L)
    if loads.flags.c_contiguous:  # [L, Dv, E] leaving its domain: zero the home domain's rows
        cross = np.array(loads)  # (as `loads * mask`, bit for bit)
        by_domain = cross.reshape(L, G, size, home.shape[1])
        by_domain[np.arange(L)[:, None], home // size, :, np.arange(home.shape[1])[None, :]] = 0
    else:
        dom = np.arange(Dv) // size
        cross = loads * (dom[None, :, None] != dom[home][:, None, :])
    data = cross.sum(axis=(1, 2)) / G * spec.token_bytes  # [L] bytes per domain
    link = cluster.inter_domain if cluster.domains > 1 else cluster.inter_node
    bw = link.per_device_bw_Bps * size
    p_e = float(spec.expert_bytes)
    rate = cluster.gemm_flops(spec.gemm_dtype)
    lat_pe = loads.sum(axis=(1, 2)) / G * spec.flops_per_token_fwd / (rate * size)
    p = 1.0 - bw * lat_pe / (p_e * (G - 1))
    return np.where(2.0 * data < G * p_e, np.clip(p, 0.0, 1.0), 0.0)


def _fill_domains(
    placement: Placement, loads: np.ndarray, size: int, expert_domain: int | None = None
) -> list[list[list[tuple[int, int]]]]:
    """Give every domain a copy of each expert it lacks, heaviest first (tokens the domain sends
    to it), each on the domain's device with the most free slots (lowest index on ties), while
    slots last; `placement.copies` is updated in place. `expert_domain` (S_ED, in domains;
    None: all): a domain gathers only experts held in its block of `expert_domain` consecutive
    domains before this call. Returns `[L][G]` lists of (expert, device) added."""
    L, D, _ = loads.shape
    G = D // size
    block = G if expert_domain is None else min(expert_domain, G)
    return [
        _fill_layer(placement.copies[layer], placement.slots_per_device, loads[layer], G, block)
        for layer in range(L)
    ]


def _fill_layer(
    copies: np.ndarray, slots: int, loads: np.ndarray, G: int, block: int
) -> list[list[tuple[int, int]]]:
    """`_fill_domains` on one layer, every domain at once: `copies[D, E]` (updated in place),
    `loads[D, E]`, G domains, expert domains of `block` domains. Each domain's missing experts
    go, heaviest first, to its device with the most free slots (the first of them on ties)
    while one has a free slot: a round per missing expert, each round a step of every domain's
    own loop."""
    D, E = copies.shape
    size = D // G
    by_group = copies.reshape(G, size, E).sum(axis=1) > 0  # [G, E] before adding
    free = (slots - copies.sum(axis=1)).reshape(G, size)  # [G, size]
    block_of = np.arange(G) // block * block
    reachable = np.stack([by_group[lo : lo + block].any(axis=0) for lo in range(0, G, block)])
    wanted = reachable[block_of // block] & ~by_group  # [G, E] reachable and not held
    demand = loads.reshape(G, size, E).sum(axis=1)  # [G, E] tokens each domain sends to e
    order = np.argsort(-demand, axis=1, kind="stable")  # heaviest first
    keep = np.take_along_axis(wanted, order, axis=1)
    missing = np.take_along_axis(order, np.argsort(~keep, axis=1, kind="stable"), axis=1)
    count = keep.sum(axis=1)  # [G] missing experts, in `missing[g, :count[g]]`
    groups = np.arange(G)
    got: list[list[tuple[int, int]]] = [[] for _ in range(G)]
    for k in range(int(count.max(initial=0))):
        slot = free.argmax(axis=1)  # [G] the device with the most free slots, first on ties
        go = (k < count) & (free[groups, slot] > 0)  # a domain that ran out stays out
        g = groups[go]
        if not g.size:
            break
        device, expert = g * size + slot[go], missing[go, k]
        copies[device, expert] += 1
        free[g, slot[go]] -= 1
        for i, e, d in zip(g.tolist(), expert.tolist(), device.tolist(), strict=True):
            got[i].append((e, d))
    return got


def _plan_with_edp_copies(
    loads: np.ndarray,
    previous: Plan | None,
    ctx: PlanContext,
    notes: dict[str, Any],
    size: int,
) -> Plan:
    """More devices than experts: the static placement's expert-data-parallel copies plus a copy of
    each expert a domain lacks, each domain's tokens kept on its own copies, where that prices
    below static (see the module docstring)."""
    L, D, E = loads.shape
    G = D // size
    static = static_placement(L, E, D, ctx.slots_per_device)
    routing = static_assignment(static)
    ep = ep_group_size(E, D)
    notes["ep_group_size"] = ep
    per_domain = loads.reshape(L, G, size, E).sum(axis=2)  # [L, G, E] tokens from domain g
    static_cross = _static_cross_domain(static, per_domain, size, ep)
    static_s = ctx.cost.price(static, routing, loads).layer_s
    if ep and size % ep == 0:
        # DeepSpeed's EP groups lie inside the domains: static keeps every token in its domain
        # already, so there is nothing to gather (p* = 1).
        nothing: list[list[list[tuple[int, int]]]] = [[[] for _ in range(G)] for _ in range(L)]
        return _edp_plan(
            static, routing, loads, previous, ctx, notes, static_s, static_s, nothing, G
        )
    placement = static.copy()
    added = _fill_domains(placement, loads, size, expert_domain(ctx))
    local = Assignment.group_local(placement, size, base=Assignment.even(placement))
    # Per layer the cheaper placement (the gathered experts cost Trans and Agg over the slow link,
    # and keeping tokens in their domain can pile them on few copies): never slower than static.
    local_s = ctx.cost.price(placement, local, loads).layer_s
    use_local = local_s < static_s
    fallback, fallback_s = routing, static_s
    if ep and use_local.any() and not use_local.all():
        # An assignment has one group size: static's EP groups (E devices) and the domains
        # (`size`) do not mix by layer. The layers that keep no domain copies then take the
        # even split over all static copies (group-local routing off), or the whole plan
        # stays static, whichever prices less over all layers.
        even = Assignment.even(static)
        even_s = ctx.cost.price(static, even, loads).layer_s
        mixed = np.where(local_s < even_s, local_s, even_s)
        if mixed.sum() < static_s.sum():
            use_local, fallback, fallback_s = local_s < even_s, even, even_s
        else:
            use_local = np.zeros(L, dtype=bool)
    placement.copies[~use_local] = static.copies[~use_local]
    assignment = Assignment.from_layers(
        [(local if use_local[layer] else fallback, layer) for layer in range(L)]
    )
    held = placement.copies.reshape(L, G, size, E).sum(axis=2) > 0  # [L, G, E]
    # The group-local routing keeps in the domain all tokens of the experts it holds.
    cross = (per_domain * ~held).sum(axis=(1, 2))
    p_local = np.where(static_cross > 0, cross / np.where(static_cross > 0, static_cross, 1), 1.0)
    notes["p_star"] = np.where(use_local, p_local, 1.0).tolist()
    best_s = np.where(use_local, local_s, fallback_s)
    return _edp_plan(
        placement, assignment, loads, previous, ctx, notes, static_s, best_s,
        [[added[layer][g] if use_local[layer] else [] for g in range(G)] for layer in range(L)],
        G,
    )  # fmt: skip


def _static_cross_domain(
    static: Placement, per_domain: np.ndarray, size: int, ep: int
) -> np.ndarray:
    """`[L]` tokens that leave their domain under static's routing, from the tokens each domain
    sends to each expert, `per_domain[L, G, E]`: with DeepSpeed's EP groups (`ep` > 0, nesting
    with the domains) those of the experts the domain holds no copy of (each goes to its EP
    group's one copy; a group inside a domain holds every expert); with the even split over all
    copies, the share landing outside the domain."""
    L, G, E = per_domain.shape
    in_domain = static.copies.reshape(L, G, size, E).sum(axis=2)  # [L, G, E]
    if ep:
        return (per_domain * (in_domain == 0)).sum(axis=(1, 2))
    share = in_domain / static.copies.sum(axis=1)[:, None, :]
    return (per_domain * (1.0 - share)).sum(axis=(1, 2))


def _edp_plan(
    placement: Placement,
    assignment: Assignment,
    loads: np.ndarray,
    previous: Plan | None,
    ctx: PlanContext,
    notes: dict[str, Any],
    static_s: np.ndarray,
    best_s: np.ndarray,
    added: list[list[list[tuple[int, int]]]],
    G: int,
) -> Plan:
    """The E < D plan with its notes: `added[l][g]` the (expert, device) copies domain g took
    in layer l (empty where the layer keeps static's)."""
    L = len(static_s)
    notes.setdefault("p_star", [1.0] * L)
    notes.update(
        hybrid_layer_s=np.stack([static_s, best_s], axis=1).tolist(),
        p_closed_form=[None] * L,
        replicated=[[[e for e, _ in added[layer][g]] for g in range(G)] for layer in range(L)],
        replica_device=[[[d for _, d in added[layer][g]] for g in range(G)] for layer in range(L)],
        edp_copies=True,
    )
    return finish_plan(NAME, placement, assignment, loads, previous, ctx, notes)
