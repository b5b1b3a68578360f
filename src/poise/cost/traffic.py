"""Where a plan's tokens and bytes go: per device and link level, as the cost model prices them.

All inputs are loads `counts[L, D, E]` (token-to-expert assignments per source device) and a
`Placement`/`Assignment`; everything is vectorised over layers, devices and experts, and node /
domain sums replace D x D traffic matrices (devices are numbered node-major).

- Tokens computed on device d for expert e (`Assignment.received`, `Routing.received`):
      R[d, e] = c[d, e] * h[d, e] + w[e, d] * sum_s c[s, e] * (1 - h[s, e])
  with h the holder mask and w the assignment weights.
- Dispatch traffic (`level_traffic`, `Routing.traffic`): for each device and link level v
  (intra-node, inter-node, inter-domain), the tokens it sends and receives over v; with
  group-local routing (HybridEP's domains, DeepSpeed-MoE's EP groups of the static baseline) a
  source whose group holds e routes inside its group.
- Trans (`replica_traffic`): each replica receives W_e once, over the level between it and its
  home, and the home sends it once (a broadcast); migrations (`migration_traffic`) move M_e
  from the old home to the new one.
- Messages (`Routing.messages`, `replica_messages`, `migration_messages`; counted by
  `poise.cost.messages`): per device and level, the peers it sends to and receives from. In
  the dispatch source s sends to device d iff some expert e has at least a byte of s's remote
  tokens (`sends`: c[s, e] (1 - h[s, e]) B_t >= MIN_TRAFFIC_BYTES, the shed share for a
  holder) and d takes a share of them (w[d, e] > 0; under group-local routing, gw[d, e] > 0 in
  s's group for the experts s routes locally). Trans and Agg: one message per (home, replica
  device) pair, migrations one per (old home, new home) pair, at the level between the two.

`cost/model.py` turns these into seconds.
"""

from __future__ import annotations

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement
from poise.cost.messages import DIRECT_RUN, level_counts, pack, pair_counts
from poise.cost.network import MIN_TRAFFIC_BYTES


def sends(tokens: np.ndarray, token_bytes: float) -> np.ndarray:
    """`tokens`' cells (elementwise, bool) that are a message's worth: at least
    `MIN_TRAFFIC_BYTES / token_bytes` tokens, a byte (less is float residue, not traffic)."""
    return np.asarray(tokens) >= MIN_TRAFFIC_BYTES / token_bytes


def _group_sum(x: np.ndarray, groups: int) -> np.ndarray:
    """Sum the device axis (axis 1 of `[L, D, ...]`) into `[L, groups, ...]`; devices are numbered
    node-major, so each group is a contiguous run of D // groups devices."""
    L, D = x.shape[:2]
    rest = x.shape[2:]
    if groups == D:
        return x
    return x.reshape(L, groups, D // groups, *rest).sum(axis=2)


def _within_groups(
    remote: np.ndarray, w: np.ndarray, w_group: np.ndarray, groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(send, recv)` `[L, D]` for `groups` contiguous device groups: send[d] = sum_e remote[d, e]
    * (share of e's remote tokens landing in d's group); recv[d] = sum_e w[d, e] * (remote
    tokens of e from d's group). `remote`, `w`: `[L, D, E]`; `w_group[L, G, E]`: `w` summed
    over each group's devices."""
    L, D, E = remote.shape
    r4 = remote.reshape(L, groups, D // groups, E)
    w4 = w.reshape(L, groups, D // groups, E)
    r_group = r4.sum(axis=2)
    send = np.einsum("lgde,lge->lgd", r4, w_group).reshape(L, D)
    recv = np.einsum("lgde,lge->lgd", w4, r_group).reshape(L, D)
    return send, recv


class Routing:
    """Where one placement and assignment send tokens, with everything that does not depend on
    the loads computed once: the holder mask `held[L, D, E]`, the shares `w[L, D, E]` of each
    expert's remote tokens landing on each device, and their sums per node, per domain and over
    the cluster (`[L, G, E]`). `level_traffic` and `PlanPricer` go through here; a simulator
    pricing one plan on many steps builds it once."""

    def __init__(self, cluster: Cluster, placement: Placement, assignment: Assignment) -> None:
        self.cluster = cluster
        self.placement = placement
        self.assignment = assignment
        self.held = placement.holders()
        self.shed = assignment.shed  # [L, D, E] or None: holders keep all their own tokens
        # `w[L, D, E]`: the assignment weights `[L, E, D]` transposed, destination device first
        # (`w[l, d, e] = weights[l, e, d]`), contiguous.
        self.w = np.ascontiguousarray(assignment.weights.transpose(0, 2, 1))
        self.groups = (cluster.num_nodes, cluster.domains, 1)
        L, D, E = self.w.shape
        sums: dict[int, np.ndarray] = {}  # a level with as many groups as another shares its sums
        for g in self.groups:
            if g not in sums:
                sums[g] = self.w.reshape(L, g, D // g, E).sum(axis=2)
        self.w_group = [sums[g] for g in self.groups]
        # [L, D, E] the devices that take a share of e's tokens: bool where `level_counts`
        # tests every pair at once (`messages.meet_matrix`), else as bits (`messages.pack`)
        direct = D <= DIRECT_RUN
        self.takes = self.w > 0 if direct else pack(self.w > 0)
        # Group-local routing only: `local[L, D, E]` per source, routes e inside its group;
        # `gw[L, D, E]` the group weights `[L, E, D]` transposed like `w`, contiguous.
        self.local = self.gw = self.takes_local = None
        self._cells: np.ndarray | None = None  # flat indices of the holder cells, when needed
        if assignment.grouped:
            assert assignment.group_weights is not None
            self.local = assignment.source_local()
            self.gw = np.ascontiguousarray(assignment.group_weights.transpose(0, 2, 1))
            self.takes_local = self.gw > 0 if direct else pack(self.gw > 0)

    def take_layers(self, start: int, stop: int) -> Routing:
        """The routing of layers `start:stop` (views of this one's arrays)."""
        part = Routing.__new__(Routing)
        part.cluster, part.groups = self.cluster, self.groups
        p, a = self.placement, self.assignment
        part.placement = Placement(p.home[start:stop], p.copies[start:stop], p.slots_per_device)
        part.assignment = Assignment(
            a.weights[start:stop],
            None if a.group_weights is None else a.group_weights[start:stop],
            a.group_size,
            a.by_counts,
            None if a.shed is None else a.shed[start:stop],
        )
        part.held, part.w = self.held[start:stop], self.w[start:stop]
        part.shed = None if self.shed is None else self.shed[start:stop]
        part.w_group = [wg[start:stop] for wg in self.w_group]
        part.local = None if self.local is None else self.local[start:stop]
        part.gw = None if self.gw is None else self.gw[start:stop]
        part.takes = self.takes[start:stop]
        part.takes_local = None if self.takes_local is None else self.takes_local[start:stop]
        part._cells = None
        return part

    def remote(self, counts: np.ndarray) -> np.ndarray:
        """`[L, D, E]` tokens that leave their source: it holds no copy, or sheds them
        (`Assignment.remote`)."""
        return self.assignment.remote(self.held, counts)

    def split(self, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """`(global, local)` parts of `remote[L, D, E]` under group-local routing: the tokens
        of sources that route by the global weights and of those that route inside their
        group (None without groups). `received` and `traffic` take it to share the work."""
        if self.local is None:
            return None
        remote_loc = np.where(self.local, remote, 0.0)
        return remote - remote_loc, remote_loc  # = np.where(local, 0.0, remote), bit for bit

    def received(
        self,
        counts: np.ndarray,
        remote: np.ndarray | None = None,
        split: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """`[L, D, E]` tokens each device computes (`Assignment.received`)."""
        remote = self.remote(counts) if remote is None else remote
        if self.local is None:
            return self._local_plus(counts, remote.sum(axis=1))
        assert self.gw is not None
        remote_glob, _ = self.split(remote) if split is None else split
        L, D, E = remote.shape
        size = self.assignment.group_size
        out = self._local_plus(counts, remote_glob.sum(axis=1))
        group_remote = remote.reshape(L, D // size, size, E).sum(axis=2)  # [L, D / size, E]
        out += (self.gw.reshape(L, D // size, size, E) * group_remote[:, :, None, :]).reshape(
            L, D, E
        )
        return out

    def _local_plus(self, counts: np.ndarray, total: np.ndarray) -> np.ndarray:
        """`np.where(held, kept, 0.0) + w * total[:, None, :]` (`total[L, E]`; `kept` the
        counts less the shed share), bit for bit, with one `[L, D, E]` array instead of three:
        `0.0 + x` is `x + 0.0` (which also turns -0.0 into 0.0), and only the few holder cells
        add their own tokens."""
        out = self.w * total[:, None, :]
        out += 0.0
        cells = self._held_cells()
        flat = out.reshape(-1)
        kept = np.asarray(counts, dtype=np.float64).reshape(-1)[cells]
        if self.shed is not None:
            kept = kept - kept * self.shed.reshape(-1)[cells]
        flat[cells] = kept + flat[cells]
        return out

    def _held_cells(self) -> np.ndarray:
        """Flat indices of the holder cells of `held` (computed once)."""
        if self._cells is None:
            self._cells = np.flatnonzero(self.held)
        return self._cells

    def traffic(
        self,
        counts: np.ndarray,
        remote: np.ndarray | None = None,
        split: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`(send, recv)` tokens per device and link level, each `[3, L, D]` (`level_traffic`)."""
        remote = self.remote(counts) if remote is None else remote
        if self.local is None:
            send, recv = _global_traffic(self.groups, remote, self.w, self.w_group)
            return np.maximum(send, 0.0), np.maximum(recv, 0.0)
        remote_glob, remote_loc = self.split(remote) if split is None else split
        send, recv = _global_traffic(self.groups, remote_glob, self.w, self.w_group)
        assignment = self.assignment
        assert assignment.group_weights is not None
        send_l, recv_l = _group_local_traffic(
            self.cluster,
            assignment.group_size,
            remote_loc,
            assignment.group_weights.transpose(0, 2, 1),
        )
        send = send + send_l
        recv = recv + recv_l
        return np.maximum(send, 0.0), np.maximum(recv, 0.0)

    def messages(
        self,
        counts: np.ndarray,
        token_bytes: float,
        remote: np.ndarray | None = None,
        split: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`(out, into)` `[3, L, D]`: the peers each device sends dispatch tokens to and
        receives them from, per link level (`messages.level_counts`). Source s sends to d iff

            exists e: sends(remote[s, e]) and w[d, e] > 0                (global routing)
                   or sends(remote_loc[s, e]) and gw[d, e] > 0, g(d) = g(s)   (group-local)

        with `remote` the tokens that leave their source (`Routing.remote`) at `token_bytes`
        each (`sends`); the combine all-to-all is the same messages the other way."""
        remote = self.remote(counts) if remote is None else remote
        if self.local is None:
            return level_counts(self.cluster, sends(remote, token_bytes), self.takes)
        remote_glob, remote_loc = self.split(remote) if split is None else split
        return level_counts(
            self.cluster,
            sends(remote_glob, token_bytes),
            self.takes,
            sends(remote_loc, token_bytes),
            self.takes_local,
            self.assignment.group_size,
        )


def _global_traffic(
    groups: tuple[int, int, int], remote: np.ndarray, w: np.ndarray, w_group: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """`(send, recv)` `[3, L, D]` per link level (before clipping residues at 0) of `remote[L,
    D, E]` tokens routed by the shares `w[L, D, E]`, with `w_group` their sums over the
    `groups` (nodes, domains, 1) of contiguous devices.

    Per source: tokens whose destination lies in its node / its domain / anywhere (sums of
    remote * the share of e's copies in that node / domain); per holder: its share of the
    remote tokens of its node's / domain's / all sources. Devices are numbered node-major, so a
    node or domain is a contiguous run and reshapes replace D x D matrices. Levels with as many
    groups (one domain; one node) share one computation."""
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for wg, g in zip(w_group, groups, strict=True):
        if g not in parts:
            parts[g] = _within_groups(remote, w, wg, g)
    (send_node, recv_node), (send_dom, recv_dom), (send_all, recv_all) = (parts[g] for g in groups)
    send = np.stack([send_node, send_dom - send_node, send_all - send_dom])
    recv = np.stack([recv_node, recv_dom - recv_node, recv_all - recv_dom])
    return send, recv


def homes_traffic(
    cluster: Cluster, home: np.ndarray, remote: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`level_traffic` of `Placement.from_homes(home)` under `Assignment.to_home` (`home[L, E]`,
    no replicas), given the tokens `remote[L, D, E]` that leave their source (all but the
    home's own): the same arrays, bit for bit, with the shares built from the homes (one
    holder per expert, share 1) instead of transposed and summed."""
    L, D, E = remote.shape
    layer, expert = np.arange(L)[:, None], np.arange(E)[None, :]
    w = np.zeros((L, D, E))
    w[layer, home, expert] = 1.0
    groups = (cluster.num_nodes, cluster.domains, 1)
    sums: dict[int, np.ndarray] = {}
    for g in groups:
        if g not in sums:
            sums[g] = np.zeros((L, g, E))
            sums[g][layer, home // (D // g), expert] = 1.0
    send, recv = _global_traffic(groups, remote, w, [sums[g] for g in groups])
    return np.maximum(send, 0.0), np.maximum(recv, 0.0)


def homes_messages(
    cluster: Cluster, home: np.ndarray, remote: np.ndarray, token_bytes: float
) -> tuple[np.ndarray, np.ndarray]:
    """`Routing.messages` of `Placement.from_homes(home)` under `Assignment.to_home` (`home[L,
    E]`, `remote[L, D, E]` the tokens that leave their source): each source sends to the homes
    of the experts it sends a message's worth of tokens to."""
    L, D, E = remote.shape
    takes = np.zeros((L, D, E), dtype=bool)
    takes[np.arange(L)[:, None], home, np.arange(E)[None, :]] = True
    return level_counts(cluster, sends(remote, token_bytes), takes)


def level_traffic(
    cluster: Cluster, placement: Placement, assignment: Assignment, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens each device sends and receives in the dispatch all-to-all, per link level.

    Returns `(send, recv)`, each `[3, L, D]` for levels intra-node, inter-node, inter-domain.
    Linear in L*D*E: node and domain sums replace the D x D traffic matrix.

    With group-local routing (`Assignment.group_weights`: HybridEP's domains, the static
    baseline's DeepSpeed-MoE expert-parallel groups) a source whose group routes e locally sends
    inside its group; groups must nest with the cluster's levels (a group lies in one node, is a
    run of whole nodes inside one domain, or a run of whole domains)."""
    return Routing(cluster, placement, assignment).traffic(counts)


def _group_local_traffic(
    cluster: Cluster, group_size: int, remote_loc: np.ndarray, gw: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`(send, recv)` `[3, L, D]` of the tokens routed inside their group: `remote_loc[L, D, E]`
    tokens of sources that route locally, `gw[L, D, E]` the group weights `[L, E, D]` transposed
    (destination device first; per group summing to one)."""
    dpn, dpd = cluster.devices_per_node, cluster.devices_per_domain
    L, D, E = remote_loc.shape
    send = np.zeros((3, L, D))
    recv = np.zeros((3, L, D))
    n_groups = D // group_size
    per_group = _group_sum(remote_loc, n_groups)  # [L, n_groups, E]
    if dpn % group_size == 0:  # the group lies inside one node: all its traffic is intra-node
        send[0] = remote_loc.sum(axis=2)
        # gw * (the group's remote tokens, repeated over its devices), C order as the plain
        # product of the two [L, D, E] arrays would be, summed over experts.
        share = np.multiply(
            gw.reshape(L, n_groups, group_size, E), per_group[:, :, None, :], order="C"
        )
        recv[0] = share.reshape(L, D, E).sum(axis=2)
    elif group_size % dpn == 0 and dpd % group_size == 0:  # whole nodes inside one domain
        group_remote = np.repeat(per_group, group_size, axis=1)
        node_of = cluster.node_of()
        in_node = _group_sum(gw, cluster.num_nodes)[:, node_of, :]
        send[0] = (remote_loc * in_node).sum(axis=2)
        send[1] = (remote_loc * (1.0 - in_node)).sum(axis=2)
        r_node = _group_sum(remote_loc, cluster.num_nodes)[:, node_of, :]
        recv[0] = (gw * r_node).sum(axis=2)
        recv[1] = (gw * (group_remote - r_node)).sum(axis=2)
    elif group_size % dpd == 0:  # whole domains (DeepSpeed's EP groups across domains)
        group_remote = np.repeat(per_group, group_size, axis=1)
        node_of, domain_of = cluster.node_of(), cluster.domain_of()
        in_node = _group_sum(gw, cluster.num_nodes)[:, node_of, :]
        in_domain = _group_sum(gw, cluster.domains)[:, domain_of, :]
        send[0] = (remote_loc * in_node).sum(axis=2)
        send[1] = (remote_loc * (in_domain - in_node)).sum(axis=2)
        send[2] = (remote_loc * (1.0 - in_domain)).sum(axis=2)
        r_node = _group_sum(remote_loc, cluster.num_nodes)[:, node_of, :]
        r_domain = _group_sum(remote_loc, cluster.domains)[:, domain_of, :]
        recv[0] = (gw * r_node).sum(axis=2)
        recv[1] = (gw * (r_domain - r_node)).sum(axis=2)
        recv[2] = (gw * (group_remote - r_domain)).sum(axis=2)
    else:
        raise PlanError(
            f"group size {group_size} does not nest with nodes of {dpn} and domains "
            f"of {dpd} devices",
            field="assignment.group_size",
        )
    return send, recv


ReplicaCells = tuple[np.ndarray, np.ndarray, np.ndarray]  # (layer, device, expert) per replica


def replica_cells(placement: Placement) -> ReplicaCells:
    """`(layer, device, expert)`: the coordinates of every replica (a copy off its expert's
    home), in C order of `[L, D, E]`. Replicas are few next to L * D * E cells, so Trans is
    counted from these; `replica_traffic` and `replica_messages` take them from a caller that
    needs both."""
    flat = np.flatnonzero(placement.replicas())  # 1-D: much faster than a 3-D np.nonzero
    _, D, E = placement.copies.shape
    return flat // (D * E), flat // E % D, flat % E


def replica_traffic(
    cluster: Cluster,
    placement: Placement,
    bytes_per_copy: float,
    *,
    broadcast: bool = True,
    replicas: ReplicaCells | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes per level each device sends and receives when every replica gets `bytes_per_copy`
    from its home (Trans; Agg moves the same bytes the other way): `(send, recv)`, each
    `[3, L, D]`.

    With `broadcast` (Trans as the pipelined broadcast NCCL runs, Agg as its reduce:
    Pro-Prophet eq. 4-5 and FasterMoE's shadowing charge one copy whatever the number of
    receivers) the home sends the copy once, over the farthest level it must reach; the copy
    enters each other domain once (its first replica receives it over level 2), each other node
    once (level 1), and the node's other replicas receive it over level 0 from a holder in
    their node (`_broadcast_hops`); what replicas pass on is not charged beyond what they
    receive. Without `broadcast`, the home sends one copy per replica and each receives it over
    the level between it and the home (direct sends: the reference the tests hold the
    broadcast against). `replicas`: `replica_cells(placement)`, where the caller has them."""
    L, D, E = placement.copies.shape
    # Counted per (level, layer, device) from the replicas' coordinates, each at the level
    # between its holder and its home.
    layer, device, expert = replica_cells(placement) if replicas is None else replicas
    home = placement.home[layer, expert]
    level = cluster.level_between(device, home)  # 0, 1, 2 (a replica is not on its home)
    cells = 3 * L * D
    hop = _broadcast_hops(cluster, layer * E + expert, device, level) if broadcast else level
    recv = np.bincount((hop * L + layer) * D + device, minlength=cells).reshape(3, L, D)
    if broadcast and layer.size:
        # One send per replicated (layer, expert), at the farthest level of its replicas.
        column = layer * E + expert
        farthest = np.zeros(L * E, dtype=np.int64)
        np.maximum.at(farthest, column, level)
        sources = np.unique(column)
        lv, ly, src = farthest[sources], sources // E, placement.home.ravel()[sources]
        send = np.bincount((lv * L + ly) * D + src, minlength=cells).reshape(3, L, D)
    else:
        send = np.bincount((level * L + layer) * D + home, minlength=cells).reshape(3, L, D)
    return send * float(bytes_per_copy), recv * float(bytes_per_copy)


def replica_messages(
    cluster: Cluster, placement: Placement, replicas: ReplicaCells | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`(out, into)` `[3, L, D]` messages of Trans (and of Agg, the other way): one per (home,
    replica device) pair of a layer, at the level between the two (`messages.pair_counts`): a
    home sends one message to each device holding replicas of its experts, a replica device
    receives one from each home whose experts it replicates. The bytes travel as a broadcast
    (`replica_traffic`); the messages are counted per pair, as the (n - 1) latencies of a
    pipelined chain over n holders (`cost.collectives.chain_broadcast_s`). `replicas`:
    `replica_cells(placement)`, where the caller has them."""
    layer, device, expert = replica_cells(placement) if replicas is None else replicas
    return pair_counts(cluster, layer, placement.home[layer, expert], device, placement.layers)


def _broadcast_hops(
    cluster: Cluster, column: np.ndarray, device: np.ndarray, level: np.ndarray
) -> np.ndarray:
    """The level over which each replica receives a broadcast copy: 2 for the first replica
    (lowest device) of a domain other than the home's, 1 for the first of a node other than the
    home's within a reached domain, else 0 (its node already holds the copy). `column`,
    `device`, `level` (to the home): one entry per replica."""
    order = np.lexsort((device, column))  # by column, then device: nodes and domains ascend
    first_in_node = np.zeros(len(device), dtype=bool)
    first_in_domain = np.zeros(len(device), dtype=bool)
    col = column[order]
    for size, first in (
        (cluster.devices_per_node, first_in_node),
        (cluster.devices_per_domain, first_in_domain),
    ):
        group = device[order] // size
        starts = np.ones(len(order), dtype=bool)
        starts[1:] = (col[1:] != col[:-1]) | (group[1:] != group[:-1])
        first[order[starts]] = True
    return np.where(
        level == 2,
        np.where(first_in_domain, 2, np.where(first_in_node, 1, 0)),
        np.where((level == 1) & first_in_node, 1, 0),
    )


def padded_counts(counts: np.ndarray) -> np.ndarray:
    """`[..., L, D, E]` loads as DeepSpeed-MoE's dropless dispatcher moves and computes them: every
    (source, expert) pair of a layer carries the layer's capacity, the largest count of any
    source for any expert, C_l = max_{s, e} counts[l, s, e] (DeepSpeed's `top1gating` /
    `top2gating` with `drop_tokens=False`: capacity = all-reduce MAX of each rank's largest
    `exp_counts`, then one `[E, C, d_model]` buffer per rank, padding included). Idempotent."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0:
        return counts
    capacity = counts.max(axis=(-2, -1), keepdims=True)  # per layer (and step)
    return np.broadcast_to(capacity, counts.shape).copy()


def migration_traffic(
    cluster: Cluster, migrations: np.ndarray, layers: int, bytes_per_move: float
) -> tuple[np.ndarray, np.ndarray]:
    """`(send, recv)` `[3, L, D]` bytes for migration rows (layer, expert, old home, new home)."""
    D = cluster.num_devices
    send = np.zeros((3, layers, D))
    recv = np.zeros((3, layers, D))
    if len(migrations):
        lv = cluster.level_between(migrations[:, 2], migrations[:, 3])
        np.add.at(send, (lv, migrations[:, 0], migrations[:, 2]), bytes_per_move)
        np.add.at(recv, (lv, migrations[:, 0], migrations[:, 3]), bytes_per_move)
    return send, recv


def migration_messages(
    cluster: Cluster, migrations: np.ndarray, layers: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(out, into)` `[3, L, D]` messages of migration rows (layer, expert, old home, new home):
    one per (old home, new home) pair of a layer, at the level between them."""
    migrations = np.asarray(migrations, dtype=np.int64).reshape(-1, 4)
    return pair_counts(cluster, migrations[:, 0], migrations[:, 2], migrations[:, 3], layers)
