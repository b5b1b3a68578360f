"""`hybrid`: HybridEP's hybrid expert/data transmission (Yang et al., arXiv 2510.19470;
reconstructed from the published description, the paper body (its eq. 10-12) could not be read:
the model below is ours, in its spirit).

Devices are cut into *domains* (`cluster.domain_of()`): inside a domain, experts travel (an
expert needed there is copied into the domain once and its tokens stay in the domain); across
domains, tokens travel by all-to-all as in plain EP. A single-domain cluster whose inter-node
link is slower per device than its intra-node link uses nodes as domains; otherwise the policy
keeps the static layout (nothing to gain from moving experts).

Stream model (after HybridEP eq. 10-12, reconstructed). Per layer, let T[g, e] be the tokens
domain g sends to expert e homed outside g. Plain EP sends all of them across domains:
X = sum T[g, e] tokens, 4 X B_t bytes a step (dispatch and combine, forward and backward).
Replicating e into g instead moves W_e of weights in (Trans) and W_e of gradients out (Agg) and
keeps 4 T[g, e] B_t bytes of tokens inside g. The data fraction still sent across domains is

    p = 1 - sum_{(g, e) replicated} T[g, e] / X          (p = 1: plain EP, p = 0: all experts)

Pairs (g, e) are taken greedily by saved bytes per moved byte, 4 T[g, e] B_t / (2 W_e),
(descending, stable: lower domain, then heavier and lower-index expert first), subject to the
domain's free slots; the cut k* (the number of pairs taken) minimises the cost model's layer time
(`ctx.cost`: all-to-all per link level, expert compute, Trans and Agg under `ctx.cost.schedule`),
and p* = p(k*) in [0, 1]. Each cut is priced incrementally on its layer (checked against
`CostModel.price` in the tests).

A domain holds one replica of each expert moved into it, on the device of the domain that sends
most tokens to that expert among those with a free slot (lowest index on ties); every device of
the domain sends its tokens for that expert to that replica (`Assignment.group_local`: group
weights route inside the domain, other sources go to the home). One replica per domain keeps
the wide-area Trans to one copy per domain, which the cost model (direct home-to-replica Trans,
no relay inside the domain) prices best; copies on every device of the domain would multiply it.

Notes: `p_star[l]`, `domain_level` ("domain", "node" or None), `domain_size` (devices),
`replicated[l][g]` (experts moved into domain g, in greedy order), `replica_device[l][g]`,
`hybrid_layer_s[l]` (predicted layer seconds at k = 0 and k*).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.cost import CostModel
from poise.cost_incremental import LayerState, prefix_cuts, prefix_states
from poise.placement import Assignment, Placement, Plan
from poise.policies.base import PlanContext, finish_plan, register, start_placement
from poise.topology import Cluster

NAME = "hybrid"


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


def choose_pairs(
    counts: np.ndarray,
    home: np.ndarray,
    free: np.ndarray,
    size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy candidates for one layer: `(group, expert, device, tokens)` arrays in the order
    they are taken. `counts[D, E]`, `home[E]`, `free[D]` free slots, `size` devices per group."""
    D, E = counts.shape
    G = D // size
    per_group = counts.reshape(G, size, E)
    T = per_group.sum(axis=1)  # [G, E] tokens each group sends to e
    groups = np.arange(G)
    wanted = (home[None, :] // size != groups[:, None]) & (T > 0)  # [G, E]
    # Each group's wanted experts, most tokens first (stable: lower expert first).
    ranked = np.argsort(np.where(wanted, -T, np.inf), axis=1, kind="stable")
    free = free.reshape(G, size).copy()
    take = np.minimum(free.sum(axis=1), wanted.sum(axis=1))  # pairs per group
    gs, es, ds, ranks = [], [], [], []
    # All groups in lockstep: the i-th pick of every group that still takes one. Within a group
    # the picks stay sequential (each takes a free slot the next cannot).
    for i in range(int(take.max(initial=0))):
        g = np.flatnonzero(take > i)
        e = ranked[g, i]
        on_open = np.where(free[g] > 0, per_group[g, :, e], -np.inf)  # [A, size]
        j = on_open.argmax(axis=1)  # first max: lowest device
        free[g, j] -= 1
        gs.append(g)
        es.append(e)
        ds.append(g * size + j)
        ranks.append(np.full(g.size, i))
    if not gs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, np.zeros(0)
    g_arr, e_arr, d_arr = (np.concatenate(x).astype(np.int64) for x in (gs, es, ds))
    group_major = np.lexsort((np.concatenate(ranks), g_arr))  # group by group, picks in order
    g_arr, e_arr, d_arr = g_arr[group_major], e_arr[group_major], d_arr[group_major]
    t_arr = T[g_arr, e_arr].astype(np.float64)
    order = np.argsort(-t_arr, kind="stable")  # W_e is the same for all: ratio order = T order
    return g_arr[order], e_arr[order], d_arr[order], t_arr[order]


def cut_times(
    cost: CostModel,
    placement: Placement,
    counts: np.ndarray,
    size: int,
    groups: np.ndarray,
    experts: np.ndarray,
    devices: np.ndarray,
    tokens: np.ndarray,
    state: LayerState | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`(cuts[G], seconds[G])`: layer seconds with the first k pairs replicated for k in `cuts`
    (every k = 0..K when K is small, else a grid: `cost_incremental.prefix_cuts`), for one
    layer (`placement` of one layer with homes only, `counts[D, E]`, `state` its `LayerState`
    if already built)."""
    if state is None:
        state = LayerState(cost, placement, counts)
    cluster = cost.cluster
    K = len(groups)
    cuts = prefix_cuts(K)
    home = placement.home[0]
    h = home[experts]  # [K]
    src = groups[:, None] * size + np.arange(size)[None, :]  # [K, m] sources of each pair
    tok = counts[src, experts[:, None]]  # [K, m]
    lv_sh = cluster.level_between(src, h[:, None])
    lv_sr = cluster.level_between(src, devices[:, None])
    stays = lv_sr >= 0  # sources other than the replica device itself
    k_idx = np.repeat(np.arange(K), size).reshape(K, size)
    # Pair k: its group's sources stop sending e's tokens to the home and send them to the
    # replica device instead (the replica device's own tokens stay local).
    dst = devices[:, None].repeat(size, 1)
    send_step = np.concatenate([k_idx.ravel(), k_idx[stays]])
    send_lv = np.concatenate([lv_sh.ravel(), lv_sr[stays]])
    send_dev = np.concatenate([src.ravel(), src[stays]])
    recv_dev = np.concatenate([(h[:, None] + 0 * src).ravel(), dst[stays]])
    delta = np.concatenate([-tok.ravel(), tok[stays]])
    tok_send = prefix_states(state.tok_send, send_step, (send_lv, send_dev), delta, cuts)
    tok_recv = prefix_states(state.tok_recv, send_step, (send_lv, recv_dev), delta, cuts)
    lv_hr = cluster.level_between(h, devices)
    W_e = np.full(K, cost.spec.expert_bytes)
    pairs = np.arange(K)
    par_send = prefix_states(state.par_send, pairs, (lv_hr, h), W_e, cuts)
    par_recv = prefix_states(state.par_recv, pairs, (lv_hr, devices), W_e, cuts)
    # Compute: the replica takes the whole group's tokens; the home loses them.
    order = np.argsort(experts, kind="stable")
    se, st = experts[order], tokens[order]
    cum = np.cumsum(st)
    first = np.searchsorted(se, se, side="left")
    before_sorted = cum - st - np.where(first > 0, cum[first - 1], 0.0)
    before = np.empty(K)
    before[order] = before_sorted  # tokens of e moved away from its home by earlier pairs
    r_home = state.R[h, experts] - before
    comp_step = np.concatenate([pairs, pairs])
    comp_dev = np.concatenate([devices, h])
    comp_delta = np.concatenate(
        [
            state.comp_s(tokens),
            state.comp_s(np.maximum(r_home - tokens, 0.0)) - state.comp_s(r_home),
        ]
    )
    comp = prefix_states(state.comp, comp_step, (comp_dev,), comp_delta, cuts)
    return cuts, state.layer_s(comp, tok_send, tok_recv, par_send, par_recv)


@register(NAME)
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """`loads[L, D, E]` predicted tokens -> Plan with HybridEP's per-domain expert replicas."""
    L, D, _ = loads.shape
    start = start_placement(previous, ctx, L)
    placement = Placement.from_homes(start.home, D, ctx.slots_per_device)
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
    G = D // size
    p_star: list[float] = []
    replicated: list[list[list[int]]] = []
    replica_device: list[list[list[int]]] = []
    layer_s: list[list[float]] = []
    states = LayerState.for_layers(ctx.cost, placement, loads)
    for layer in range(L):
        counts = loads[layer]
        home = placement.home[layer]
        free = ctx.slots_per_device - placement.copies[layer].sum(axis=1)
        groups, experts, devices, tokens = choose_pairs(counts, home, free, size)
        one = placement.take_layers([layer])
        cuts, times = cut_times(
            ctx.cost, one, counts, size, groups, experts, devices, tokens, states[layer]
        )
        best = int(np.argmin(times))  # first minimum: the fewest pairs on ties
        k = int(cuts[best])
        placement.copies[layer, devices[:k], experts[:k]] = 1
        T = counts.reshape(G, size, -1).sum(axis=1)
        cross = float(np.where(home[None, :] // size != np.arange(G)[:, None], T, 0.0).sum())
        p_star.append(1.0 - float(tokens[:k].sum()) / cross if cross > 0 else 1.0)
        reps: list[list[int]] = [[] for _ in range(G)]
        devs: list[list[int]] = [[] for _ in range(G)]
        for g, e, d in zip(groups[:k], experts[:k], devices[:k], strict=True):
            reps[int(g)].append(int(e))
            devs[int(g)].append(int(d))
        replicated.append(reps)
        replica_device.append(devs)
        layer_s.append([float(times[0]), float(times[best])])
    notes.update(
        p_star=p_star, replicated=replicated, replica_device=replica_device, hybrid_layer_s=layer_s
    )
    assignment = Assignment.group_local(placement, size)
    return finish_plan(NAME, placement, assignment, loads, previous, ctx, notes)
