"""`eplb`: DeepSeek's Expert-Parallelism Load Balancer (redundant experts, hierarchical packing).

A re-implementation in NumPy of the algorithm published in github.com/deepseek-ai/EPLB, as pure
functions over arrays (shapes in brackets; X is any batch of rows, usually layers):

1. `balanced_packing(weight[X, n], m)`: n items into m packs of exactly n/m items each. Items are
   taken heaviest first (stable descending sort: among equal weights the lower index goes first)
   and each goes to the lightest pack that is not yet full (lowest pack index on ties). With
   n/m == 1 item i simply goes to pack i.
2. `replicate_experts(weight[X, E], phys)`: phys >= E physical slots; slot i < E holds expert i,
   and each further slot gets the expert with the largest load per copy, `argmax_e w[e] / cnt[e]`
   (lowest index on ties). This minimises the largest per-replica load (Jefferson/D'Hondt).
3. `rebalance_experts_hierarchical(weight[L, E], phys, groups, nodes, gpus)`: expert groups
   (contiguous) are packed onto the nodes by group load; experts are replicated inside each node
   to phys/nodes slots; the node's replicas (load w/cnt each) are packed onto its gpus/nodes GPUs,
   phys/gpus slots per GPU.
4. `rebalance_experts(weight[L, E], phys, groups, nodes, gpus)`: hierarchical when the groups
   divide by the nodes (and E by the groups), otherwise global: hierarchical with one group and
   one node (replicate over the whole cluster, then pack onto all GPUs). With D = gpus devices of
   P slots each (phys = D*P), returns `phy2log[L, D*P]`, `log2phy[L, E, maxcnt]` (-1 padded) and
   `logcnt[L, E]`.

Deviations from the reference, all benign: loads are float64 (the reference casts to float32);
sorts are explicitly stable (the reference's `torch.sort` is not guaranteed stable, but its
published output matches a stable sort); broken preconditions raise `PlanError` instead of an
`assert`; in automatic mode a group count that does not divide the experts also selects global
mode (the reference would fail its assertion).

Worked example (the EPLB README's; two layers, 12 experts, 16 slots on 2 nodes x 4 GPUs):

    >>> w = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    ...               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    >>> phy2log, log2phy, logcnt = rebalance_experts(w, 16, 4, 2, 8)
    >>> phy2log[0].tolist()
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]

The registered policy `eplb` sums `loads[L, D, E]` over sources into `weight[L, E]`, fills every
slot of the cluster (D*P: D devices x P slots per device), and turns `phy2log` into a
`Placement`: physical slot i lives on device i // P and an expert's home is the device of its
rank-0 copy. Tokens follow `Assignment.balanced`: EPLB's packing assumes that every copy of an
expert carries w[e] / cnt[e]; since a source holding a copy keeps its own tokens, an even split
of the remote tokens would load the copies unequally, while the water-filling of `balanced` gives
each copy that share whenever the local tokens allow it (option `routing: even` for the plain
split in proportion to copies).

Options (`ctx.option("eplb", ...)`): `groups` (default: nodes if experts divide by nodes, else
1), `mode` (`auto`, `hierarchical`, `global`), `routing` (`balanced`, `even`).
"""

from __future__ import annotations

import heapq

import numpy as np

from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement, Plan
from poise.plan.policies.base import PlanContext, finish_plan, register
from poise.plan.policies.lpt import lpt_assign

MODES = ("auto", "hierarchical", "global")


def _as_weight(weight: np.ndarray) -> np.ndarray:
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 2:
        raise PlanError(f"weight must be [rows, items], got shape {w.shape}", field="eplb.weight")
    if not np.all(np.isfinite(w)) or (w.size and w.min() < 0):
        raise PlanError("weight must be finite and non-negative", field="eplb.weight")
    return w


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n weighted items into `num_packs` packs of n / num_packs items, evening pack sums.

    `weight[X, n]` -> `(pack_index[X, n], rank_in_pack[X, n])`, both int64. Greedy LPT with a
    cardinality limit: heaviest item first (stable: lower index first on equal weights) into the
    lightest non-full pack (lowest pack index on ties); `rank_in_pack` counts the items that
    were already in the pack.

    >>> balanced_packing(np.array([[4.0, 3, 2, 1]]), 2)[0].tolist()
    [[0, 1, 1, 0]]
    """
    w = _as_weight(weight)
    X, n = w.shape
    if num_packs < 1 or n % num_packs:
        raise PlanError(
            f"{n} items do not split evenly into {num_packs} packs", field="eplb.num_packs"
        )
    if n == num_packs:  # one item per pack
        return np.tile(np.arange(n, dtype=np.int64), (X, 1)), np.zeros((X, n), dtype=np.int64)
    order, packs, ranks = _packing_in_order(w, num_packs)
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    np.put_along_axis(pack_index, order, packs, axis=1)
    np.put_along_axis(rank_in_pack, order, ranks, axis=1)
    return pack_index, rank_in_pack


def _packing_in_order(w: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`balanced_packing`'s greedy in processing order: `(order, pack, rank)`, all `[X, n]`,
    item `order[x, j]` (the j-th heaviest) going to `pack[x, j]` as its `rank[x, j]`-th item."""
    per_pack = w.shape[1] // num_packs
    order = np.argsort(-w, axis=1, kind="stable")
    if num_packs >= HEAP_PACKS:
        packs, ranks = _packing_by_heap(w, order, num_packs, per_pack)
    else:  # the greedy on all X rows at once, blocks of items solved together (`lpt`)
        packs, ranks = lpt_assign(np.take_along_axis(w, order, axis=1), num_packs, per_pack)
    return order, packs, ranks


def _slot_items(w: np.ndarray, num_packs: int) -> np.ndarray | None:
    """`balanced_packing(w, num_packs)` as `item[X, n]`: the item in slot `pack * n / num_packs +
    rank` (the inverse of that slot numbering); None for one item per pack (the identity)."""
    X, n = w.shape
    if n == num_packs:
        return None
    order, packs, ranks = _packing_in_order(w, num_packs)
    item = np.empty((X, n), dtype=np.int64)
    np.put_along_axis(item, packs * (n // num_packs) + ranks, order, axis=1)
    return item


HEAP_PACKS = 256  # from this many packs a heap per row beats a vectorised scan of all packs


def _packing_by_heap(
    w: np.ndarray, order: np.ndarray, num_packs: int, per_pack: int
) -> tuple[np.ndarray, np.ndarray]:
    """`balanced_packing`'s greedy with a heap of (pack sum, pack index) per row: the same
    choices (lightest non-full pack, lowest index on ties) in O(n log packs) instead of
    O(n * packs); for thousands of devices. Returns `(pack[X, n], rank[X, n])` in processing
    order (`order[x, j]` is the j-th item taken)."""
    X, n = w.shape
    pack_of = np.empty((X, n), dtype=np.int64)
    rank_of = np.empty((X, n), dtype=np.int64)
    for x in range(X):
        heap = [(0.0, p) for p in range(num_packs)]  # already a heap: sums equal, index order
        filled = [0] * num_packs
        weights = w[x].tolist()
        packs, ranks = [0] * n, [0] * n
        for j, item in enumerate(order[x].tolist()):
            load, pack = heapq.heappop(heap)
            packs[j], ranks[j] = pack, filled[pack]
            filled[pack] += 1
            if filled[pack] < per_pack:
                heapq.heappush(heap, (load + weights[item], pack))
        pack_of[x], rank_of[x] = packs, ranks
    return pack_of, rank_of


def replicate_experts(
    weight: np.ndarray, num_phy: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spread `num_log` logical experts over `num_phy >= num_log` physical slots.

    `weight[X, num_log]` -> `(phy2log[X, num_phy], rank[X, num_phy], logcnt[X, num_log])`:
    slot i < num_log holds expert i (rank 0); every later slot holds the expert with the largest
    `weight / logcnt` so far (lowest index on ties), as its copy number `rank`.

    >>> p, r, c = replicate_experts(np.array([[6.0, 2.0, 3.0]]), 5)
    >>> p.tolist(), r.tolist(), c.tolist()
    ([[0, 1, 2, 0, 0]], [[0, 0, 0, 1, 2]], [[3, 1, 1]])
    """
    w = _as_weight(weight)
    num_log = w.shape[1]
    if num_phy < num_log:
        raise PlanError(
            f"{num_log} experts need at least as many slots, got {num_phy}",
            field="eplb.num_replicas",
        )
    return _replicate(w, num_phy)


def _replicate(w: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`replicate_experts` on checked weights."""
    X, num_log = w.shape
    phy2log = np.empty((X, num_phy), dtype=np.int64)
    phy2log[:, :num_log] = np.arange(num_log)
    rank = np.zeros((X, num_phy), dtype=np.int64)
    logcnt = np.ones((X, num_log), dtype=np.int64)
    picks = _largest_quotients(w, num_phy - num_log)
    if picks is not None:
        expert, copy = picks
        phy2log[:, num_log:] = expert
        rank[:, num_log:] = copy
        flat = (np.arange(X)[:, None] * num_log + expert).ravel()
        logcnt += np.bincount(flat, minlength=X * num_log).reshape(X, num_log)
        return phy2log, rank, logcnt
    rows = np.arange(X)
    for i in range(num_log, num_phy):
        e = np.argmax(w / logcnt, axis=1)
        phy2log[:, i] = e
        rank[:, i] = logcnt[rows, e]
        logcnt[rows, e] += 1
    return phy2log, rank, logcnt


def _largest_quotients(w: np.ndarray, picks: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`replicate_experts`' picks without its loop: `(expert[X, picks], copy[X, picks])`, or
    None where this shortcut does not apply (a zero weight among those that could be picked).

    Each pick takes the largest `w[e] / cnt[e]` (lowest e on ties) and raises cnt[e]; as an
    expert's quotients w / 1 > w / 2 > ... fall, the picks are the `picks` largest quotients
    w[e] / c over all (e, c >= 1), in order of value (ties: lower e, then lower c), each
    expert's c-th pick being its copy number c (D'Hondt's method). A bound t from below on
    them limits the sort to the experts with w[e] >= t and c <= w[e] / t (+1 for rounding):
    with at most E picks, the `picks`-th largest weight (the largest weights are quotients with
    c = 1, at least `picks` of them >= t); with more, t = sum(w) / (picks + E + 1), under which
    sum_e floor(w[e] / t) > sum_e w[e] / t - E = picks + 1 quotients lie (every weight
    positive)."""
    X, E = w.shape
    if picks == 0:
        return np.zeros((X, 0), dtype=np.int64), np.zeros((X, 0), dtype=np.int64)
    if picks <= E:
        floor = np.partition(w, E - picks, axis=1)[:, E - picks]  # the picks-th largest weight
        if not np.all(floor > 0):
            return None
    else:
        if not np.all(w > 0):
            return None
        floor = w.sum(axis=1) / (picks + E + 1)
    row, expert = np.nonzero(w >= floor[:, None])  # by row, then expert
    weight = w[row, expert]
    count = np.minimum(np.floor(weight / floor[row]).astype(np.int64) + 1, picks)
    row, expert, weight = np.repeat(row, count), np.repeat(expert, count), np.repeat(weight, count)
    start = np.repeat(np.cumsum(count) - count, count)
    copy = np.arange(row.size) - start + 1  # c = 1, 2, ... per expert
    quotient = weight / copy  # as `w / logcnt` computes it
    order = np.lexsort((-quotient, row))  # stable: ties keep the lower (e, c) first
    per_row = np.bincount(row, minlength=X)
    first = np.cumsum(per_row) - per_row
    take = order[(first[:, None] + np.arange(picks)[None, :]).ravel()]
    return expert[take].reshape(X, picks), copy[take].reshape(X, picks)


def _check_hierarchy(E: int, phys: int, groups: int, nodes: int, gpus: int) -> None:
    """`rebalance_experts_hierarchical`'s preconditions, all broken ones in one `PlanError`."""
    problems = []
    if groups < 1 or E % groups:
        problems.append(f"{E} experts do not split into {groups} groups")
    if nodes < 1 or groups % nodes:
        problems.append(f"{groups} groups do not split over {nodes} nodes")
    if gpus < 1 or gpus % nodes:
        problems.append(f"{gpus} GPUs do not split over {nodes} nodes")
    if gpus < 1 or phys % gpus:
        problems.append(f"{phys} physical slots do not split over {gpus} GPUs")
    if phys < E:
        problems.append(f"{E} experts need at least {E} physical slots, got {phys}")
    if problems:
        raise PlanError("; ".join(problems), field="eplb")


def rebalance_experts_hierarchical(
    weight: np.ndarray,
    num_physical_experts: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hierarchical EPLB: groups to nodes, replication inside nodes, replicas to GPUs.

    `weight[L, E]` -> `(phy2log[L, D*P], phyrank[L, D*P], logcnt[L, E])` with D = `num_gpus`
    and D*P = `num_physical_experts` (P slots per GPU): GPU g owns physical slots [g P, (g + 1)
    P). Requires E % num_groups == 0, num_groups % num_nodes == 0, D % num_nodes == 0,
    num_physical_experts % D == 0 and num_physical_experts >= E.
    """
    w = _as_weight(weight)
    _check_hierarchy(w.shape[1], num_physical_experts, num_groups, num_nodes, num_gpus)
    return _hierarchical(w, num_physical_experts, num_groups, num_nodes, num_gpus)


def _hierarchical(
    w: np.ndarray, phys: int, groups: int, nodes: int, gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`rebalance_experts_hierarchical` on checked arguments. Renumberings that are the identity
    (one group per node; one node) are skipped."""
    L, E = w.shape
    group_size = E // groups
    per_node_log, per_node_phy = E // nodes, phys // nodes

    # 1. Expert groups onto nodes; renumber experts node-major ("mlog" ids): mlog id
    # slot * group_size + i is expert group_in_slot * group_size + i.
    group_load = w.reshape(L, groups, group_size).sum(axis=2)
    group_in_slot = _slot_items(group_load, nodes)
    if group_in_slot is None:  # one group per node: mlog ids are expert ids
        mlog2log = None
        mlog_load = w.reshape(L * nodes, per_node_log)
    else:
        mlog2log = ((group_in_slot * group_size)[:, :, None] + np.arange(group_size)).reshape(L, E)
        mlog_load = np.take_along_axis(w, mlog2log, axis=1).reshape(L * nodes, per_node_log)

    # 2. Replicate inside each node: rows are (layer, node).
    phy2mlog, phyrank, mlogcnt = _replicate(mlog_load, per_node_phy)

    # 3. A node's replicas onto its GPUs, each replica weighing load / copies.
    phy_load = np.take_along_axis(mlog_load / mlogcnt, phy2mlog, axis=1)
    pphy2phy = _slot_items(phy_load, gpus // nodes)
    if pphy2phy is None:  # one replica per GPU: slots stay in order
        pphy2mlog, pphyrank = phy2mlog.reshape(L, phys), phyrank.reshape(L, phys)
    else:
        pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, phys)
        pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(L, phys)
    if nodes > 1:  # node-local mlog ids to global ones
        pphy2mlog = pphy2mlog.reshape(L, nodes, per_node_phy)
        pphy2mlog = (pphy2mlog + (np.arange(nodes) * per_node_log)[None, :, None]).reshape(L, phys)
    if mlog2log is None:
        return pphy2mlog, pphyrank, mlogcnt.reshape(L, E)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    logcnt = np.empty((L, E), dtype=np.int64)
    np.put_along_axis(logcnt, mlog2log, mlogcnt.reshape(L, E), axis=1)
    return phy2log, pphyrank, logcnt


def resolve_mode(experts: int, num_groups: int, num_nodes: int, mode: str = "auto") -> str:
    """`hierarchical` or `global` for `mode` in `MODES`; `auto` picks hierarchical when the
    experts split into groups and the groups over nodes."""
    if mode not in MODES:
        raise PlanError(
            f"unknown EPLB mode {mode!r} (known: {', '.join(MODES)})", field="eplb.mode"
        )
    if mode != "auto":
        return mode
    ok = (
        num_groups >= 1
        and num_nodes >= 1
        and experts % num_groups == 0
        and num_groups % num_nodes == 0
    )
    return "hierarchical" if ok else "global"


def rebalance_experts(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    mode: str = "auto",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's entry point.

    `weight[L, E]` -> `(phy2log[L, D*P], log2phy[L, E, maxcnt], logcnt[L, E])` with D*P =
    `num_replicas` physical slots on D = `num_gpus` GPUs: `phy2log[l, i]` is the expert in physical
    slot i, `log2phy[l, e, k]` the slot of copy k of
    expert e (-1 past its `logcnt[l, e]` copies).
    """
    w = _as_weight(weight)
    L, E = w.shape
    if resolve_mode(E, num_groups, num_nodes, mode) == "hierarchical":
        groups, nodes = num_groups, num_nodes
    else:
        groups, nodes = 1, 1
    _check_hierarchy(E, num_replicas, groups, nodes, num_gpus)
    phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, groups, nodes, num_gpus)
    maxcnt = int(logcnt.max()) if logcnt.size else 1
    log2phy = np.full((L, E * maxcnt), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy,
        phy2log * maxcnt + phyrank,
        np.broadcast_to(np.arange(num_replicas), phy2log.shape),
        axis=1,
    )
    return phy2log, log2phy.reshape(L, E, maxcnt), logcnt


def _placement(phy2log: np.ndarray, phyrank: np.ndarray, experts: int, devices: int) -> Placement:
    """`eplb_format.placement_from_eplb(phy2log, devices, log2phy=log2phy)` for a full
    `rebalance_experts` result (every slot used; an expert's home holds its copy of rank 0,
    `log2phy[:, e, 0]`), without its checks and its `np.add.at`: the same `Placement`."""
    L, phys = phy2log.shape
    E = experts
    P = phys // devices
    device = np.arange(phys) // P  # slot i lives on device i // P
    flat = ((np.arange(L)[:, None] * devices + device[None, :]) * E + phy2log).ravel()
    copies = np.bincount(flat, minlength=L * devices * E).reshape(L, devices, E)
    layer, slot = np.nonzero(phyrank == 0)  # one rank-0 slot per expert
    home = np.empty((L, E), dtype=np.int64)
    home[layer, phy2log[layer, slot]] = slot // P
    return Placement(home=home, copies=copies.astype(np.int32), slots_per_device=P)


@register("eplb", builds_on=None)
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """EPLB over every slot of the cluster; see the module docstring. `loads`: `[L, D, E]`."""
    _, D, E = loads.shape
    slots = ctx.slots_per_device
    num_replicas = D * slots
    if num_replicas < E:
        raise PlanError(
            f"EPLB needs a slot per expert: {E} experts, {D} devices x {slots} slots",
            source="eplb",
            field="slots",
        )
    nodes = ctx.cluster.num_nodes
    groups = int(ctx.option("eplb", "groups", nodes if E % nodes == 0 else 1))
    mode = resolve_mode(E, groups, nodes, str(ctx.option("eplb", "mode", "auto")))
    weight = _as_weight(np.asarray(loads, dtype=np.float64).sum(axis=1))
    # `rebalance_experts(weight, num_replicas, groups, nodes, D, mode)` without its `log2phy`.
    if mode != "hierarchical":
        groups, nodes = 1, 1
    _check_hierarchy(E, num_replicas, groups, nodes, D)
    phy2log, phyrank, _ = _hierarchical(weight, num_replicas, groups, nodes, D)
    placement = _placement(phy2log, phyrank, E, D)
    routing = ctx.option("eplb", "routing", "balanced")
    if routing == "balanced":
        assignment = Assignment.balanced(placement, loads)
    elif routing == "even":
        assignment = Assignment.even(placement)
    else:
        raise PlanError(
            f"unknown routing {routing!r} (known: balanced, even)", source="eplb", field="routing"
        )
    notes = {
        "mode": mode,
        "groups": groups if mode == "hierarchical" else 1,
        "nodes": nodes if mode == "hierarchical" else 1,
        "replicas": num_replicas,
        "routing": routing,
    }
    return finish_plan("eplb", placement, assignment, loads, previous, ctx, notes)
