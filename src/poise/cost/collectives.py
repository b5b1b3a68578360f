"""Alpha-beta models of the collectives of MoE training, each by its algorithm, and an
all-reduce on the hierarchical link model (NumPy only).

**Collectives by their algorithms** (`p2p_s`, `broadcast_s`, `reduce_s`, `all_gather_s`,
`reduce_scatter_s`, `all_to_all_s`, `hierarchical_all_to_all_s`, and the all-reduces below).
One link level: latency `lat` (seconds per message and hop), bandwidth `bw` (bytes per second
each way per member), `n` members, a message of `m` bytes. NCCL prices each algorithm it has
for a collective as `lat * steps + bytes / bw` and runs the fastest (`ncclTopoGetAlgoTime` in
NCCL's src/graph/tuning.cc); the functions below do the same, with the bandwidth term each
algorithm needs at best. nccl-tests' doc/PERFORMANCE.md defines the algorithm bandwidth
algBw = m / t and the bus bandwidth busBw = algBw * f(n), the rate each member's link must
sustain, with f = 1 for broadcast and reduce (all m bytes leave the root / enter it), 2 (n - 1)
/ n for all-reduce, (n - 1) / n for all-gather, reduce-scatter and all-to-all (`BUS_FACTOR`,
`bus_bandwidth`). So at zero latency every ring below runs at busBw = bw exactly:

    p2p                    m / bw + lat
    broadcast / reduce     chain (pipelined ring, root first): m / bw + (n - 1) lat
                           double binary tree:                  m / bw + ceil(log2 n) lat
                           `broadcast_s` / `reduce_s`: the faster (the tree; they tie for n <= 3)
    all_gather             ring: (n - 1) / n * m / bw + (n - 1) lat      m = the gathered output
    reduce_scatter         ring: (n - 1) / n * m / bw + (n - 1) lat      m = each member's input
    all_to_all (flat)      pairwise: (n - 1) / n * m / bw + (n - 1) lat  m = a member's send buffer
    all_reduce             ring: 2 (n - 1) / n * m / bw + 2 (n - 1) lat;
                           tree: 2 m / bw + 2 ceil(log2 n) lat (reduce, then broadcast)

Broadcast and reduce pipeline the message in chunks, so for large m their time is one message
(m / bw), not one per receiver: the root's link is the bottleneck and the receivers forward
chunks (the chain: Thakur, Rabenseifner & Gropp, IJHPCA 2005, pipelined; the double binary
tree, each member an inner node of one tree and a leaf of the other so that each sends m bytes
in all: Sanders, Speck & Träff, Parallel Computing 2009, used by NCCL since 2.4). The chunks'
fill time is not charged (it vanishes as chunks shrink, while NCCL keeps several in flight so
the per-chunk latency overlaps the transfers): latency is charged once per hop.

The hierarchical all-to-all (`hierarchical_all_to_all_s`) runs on two levels, g members per
node in N nodes: an all-to-all inside each node that gathers on each member the data bound for
the nodes it talks to, then an all-to-all among the N members of the same local index, one per
node, each now carrying g members' data (Tutel's 2DH all-to-all: Hwang et al., "Tutel: Adaptive
Mixture-of-Experts at Scale", MLSys 2023; DeepEP's node-aggregated dispatch runs the same two
phases the other way round, the network first, then NVLink):

    T_2DH = (g - 1) / g * m / bw0 + (g - 1) lat0  +  (N - 1) / N * m / bw1 + (N - 1) lat1

against the flat pairwise exchange on the same levels (`two_level_all_to_all_s`), whose n - 1
rounds of m / n bytes go g - 1 times inside the node and n - g times across:

    T_flat = (g - 1) (lat0 + m / (n bw0)) + (n - g) (lat1 + m / (n bw1))

2DH pays N - 1 network latencies instead of n - g at the price of one more pass over NVLink: it
wins for small messages on many nodes.

In MoE training these price: Trans (a broadcast from an expert's home to its replicas), Agg (a
reduce of the replicas' gradients to the home), the expert-data-parallel copies' gradients (an
all-reduce among them), a migration (a point-to-point transfer), the tokens' dispatch and
combine (all-to-all) and the dense gradients (the hierarchical all-reduce below, every step for
every policy: `poise.cost.step_overheads`).

**Alpha-beta collectives** (`collective_time`, `CollectiveFit`; used by `poise.layouts.parm`). A
collective runs on a group of `n` ranks. Its message size `m` (bytes) is defined per collective,
always as the larger of a rank's two buffers:

- `all_to_all`: m = a rank's send buffer (its own chunk included; m / n goes to each rank);
- `all_gather`: m = the gathered output on each rank (each rank contributes m / n);
- `reduce_scatter`: m = the input on each rank (each rank keeps m / n of the sum);
- `all_reduce`: m = the buffer on each rank.

With alpha (seconds per message) and beta (seconds per byte, 1 / bandwidth) the times are

    all_to_all      t = (n - 1) (alpha + beta m / n)     pairwise exchange: n - 1 rounds of m / n
    all_gather      t = (n - 1) (alpha + beta m / n)     ring: n - 1 steps of m / n
    reduce_scatter  t = (n - 1) (alpha + beta m / n)     ring (the additions are not charged)
    all_reduce      t = 2 (n - 1) (alpha + beta m / n)   ring: reduce-scatter, then all-gather

and 0 for n = 1. Sources: the pairwise all-to-all, ring all-gather and ring reduce-scatter of
Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005); the ring all-reduce of Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations" (JPDC 2009). Parm (Pan et al., INFOCOM 2024) and its successor
FSMoE (ASPLOS 2025, Eq. 1) price each collective with such a linear model, alpha + beta * bytes,
fitted per collective from measurements; `CollectiveFit` holds those fitted parameters per
collective and link level, in the per-step form above, so one fit serves any group size.

A group's parameters are those of the slowest link level it spans (`span_level`): a group of
`size` ranks `stride` apart starting at rank 0, ranks numbered node-major as in
`poise.core.cluster.Cluster`. From a `Cluster`, alpha is the level's latency and beta the inverse of
the bandwidth one device gets on that level when every device sends at once
(`Link.per_device_bw_Bps`).

**Hierarchical all-reduce** (`hierarchical_allreduce_s` and its helpers):
Seconds of an all-reduce on the hierarchical link model of `core.cluster.Cluster` (NumPy only).

Per link level, for n members, G bytes, bandwidth bw and latency lat:

- ring (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009; Thakur, Rabenseifner and Gropp, IJHPCA 2005): a reduce-scatter and
  an all-gather around the ring,
      T_ring = 2 (n - 1) / n * G / bw + 2 (n - 1) lat
- tree (a pipelined reduce then broadcast over binary trees; Sanders, Speck and Träff,
  "Two-tree algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing
  2009; NCCL's double binary trees):
      T_tree = 2 G / bw + 2 ceil(log2 n) lat
  and a level runs the faster of the two (`allreduce_s`): rings for large payloads on few
  members, trees for many members behind high latency (thousands of datacentres).
- hierarchical (Horovod's hierarchical all-reduce; Jia et al., "Highly scalable deep learning
  training system with mixed-precision", 2018): a group whose members sit n0 to a node, in n1
  nodes per domain, in n2 domains all-reduces inside each node (G bytes), then across the nodes
  of a domain (the G / n0 shard each member holds after the node's reduce-scatter, n0 shards in
  parallel), then across domains (G / (n0 n1)):
      T = A(n0, G, level 0) + A(n1, G / n0, level 1) + A(n2, G / (n0 n1), level 2)
  with A = `allreduce_s` at the level's bandwidth: inside a node each member's own link share
  (`Link.per_device_bw_Bps`); above, the `flows` members of a node that send across at once
  (every group with members in the node times its n0 shards) share the node's link:
  bw / min(shared_by, flows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poise.core.cluster import LEVELS, Cluster
from poise.core.errors import ConfigError

COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
ROUNDS = {"all_to_all": 1, "all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


# --------------------------------------------------------------------- alpha-beta collectives
@dataclass(frozen=True)
class AlphaBeta:
    """Per-step parameters: `alpha_s` seconds per message, `beta_s_per_byte` seconds per byte."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        if not (np.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ConfigError(f"must be finite and >= 0, got {self.alpha_s}", field="alpha_s")
        if not (np.isfinite(self.beta_s_per_byte) and self.beta_s_per_byte >= 0):
            raise ConfigError(
                f"must be finite and >= 0, got {self.beta_s_per_byte}", field="beta_s_per_byte"
            )


def check_collective(collective: str) -> str:
    if collective not in COLLECTIVES:
        raise ConfigError(
            f"unknown collective {collective!r} (known: {', '.join(COLLECTIVES)})",
            field="collective",
        )
    return collective


def collective_time(
    collective: str,
    n: int | np.ndarray,
    nbytes: float | np.ndarray,
    ab: AlphaBeta,
) -> np.ndarray:
    """Seconds of `collective` on `n` ranks with message size `nbytes` (module docstring).
    Broadcasts over `n` and `nbytes`."""
    rounds = ROUNDS[check_collective(collective)]
    n = np.asarray(n, dtype=np.float64)
    m = np.asarray(nbytes, dtype=np.float64)
    if np.any(n < 1) or np.any(m < 0):
        raise ConfigError("group size must be >= 1 and bytes >= 0", field="collective")
    steps = rounds * (n - 1.0)
    return steps * (ab.alpha_s + ab.beta_s_per_byte * m / n)


def span_level(devices_per_node: int, devices_per_domain: int, size: int, stride: int = 1) -> int:
    """The slowest link level a group of `size` ranks `stride` apart (from rank 0) crosses:
    -1 (one rank, no link), 0 intra-node, 1 inter-node, 2 inter-domain."""
    if size < 1 or stride < 1:
        raise ConfigError(f"size and stride must be >= 1, got {size}, {stride}", field="group")
    if size == 1:
        return -1
    last = (size - 1) * stride
    if last // devices_per_domain > 0:
        return 2
    if last // devices_per_node > 0:
        return 1
    return 0


def level_alpha_beta(cluster: Cluster, level: int) -> AlphaBeta:
    """alpha = the level's latency, beta = 1 / (its bandwidth per device when all send)."""
    link = cluster.links()[level]
    return AlphaBeta(link.lat_s, 1.0 / link.per_device_bw_Bps)


@dataclass(frozen=True)
class CollectiveFit:
    """Fitted alpha-beta parameters per (collective, link level name), for the formulas of the
    module docstring, and the node and domain sizes that tell a group's level.

    `params[(collective, level)]`, level one of `poise.core.cluster.LEVELS`. `source` says where the
    numbers come from (a cluster preset, a calibration)."""

    params: Mapping[tuple[str, str], AlphaBeta]
    devices_per_node: int
    devices_per_domain: int
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for collective, level in self.params:
            check_collective(collective)
            if level not in LEVELS:
                raise ConfigError(
                    f"unknown link level {level!r} (known: {', '.join(LEVELS)})",
                    source=self.source or None,
                    field="level",
                )
        if self.devices_per_node < 1 or self.devices_per_domain < self.devices_per_node:
            raise ConfigError(
                "need devices_per_node >= 1 and devices_per_domain >= devices_per_node",
                source=self.source or None,
                field="devices_per_node",
            )

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> CollectiveFit:
        """Every collective at every level from the cluster's links (`level_alpha_beta`)."""
        params = {
            (c, LEVELS[lv]): level_alpha_beta(cluster, lv)
            for c in COLLECTIVES
            for lv in range(len(LEVELS))
        }
        return cls(params, cluster.devices_per_node, cluster.devices_per_domain, cluster.name)

    def filled_from(self, cluster: Cluster) -> CollectiveFit:
        """This fit with the (collective, level) pairs it lacks taken from `cluster` (a fit
        measured on one node has no inter-node figures), on the cluster's node and domain
        sizes."""
        params = dict(CollectiveFit.from_cluster(cluster).params)
        params.update(self.params)
        return CollectiveFit(
            params,
            cluster.devices_per_node,
            cluster.devices_per_domain,
            f"{self.source or 'fit'} + {cluster.name}",
            self.notes,
        )

    def level_of(self, size: int, stride: int = 1) -> int:
        return span_level(self.devices_per_node, self.devices_per_domain, size, stride)

    def alpha_beta(self, collective: str, level: int) -> AlphaBeta:
        key = (check_collective(collective), LEVELS[level])
        if key not in self.params:
            raise ConfigError(
                f"no fitted parameters for {collective} at the {LEVELS[level]} level "
                "(fill them from a cluster: CollectiveFit.filled_from)",
                source=self.source or None,
                field=f"{collective}.{LEVELS[level]}",
            )
        return self.params[key]

    def time(self, collective: str, size: int, nbytes: float, stride: int = 1) -> float:
        """Seconds of `collective` on a group of `size` ranks `stride` apart, `nbytes` as in the
        module docstring, with the parameters of the slowest level the group spans."""
        level = self.level_of(size, stride)
        if level < 0:
            return 0.0
        return float(collective_time(collective, size, nbytes, self.alpha_beta(collective, level)))

    def to_dict(self) -> dict[str, Any]:
        params: dict[str, dict[str, dict[str, float]]] = {}
        for (collective, level), ab in sorted(self.params.items()):
            params.setdefault(collective, {})[level] = {
                "alpha_s": ab.alpha_s,
                "beta_s_per_byte": ab.beta_s_per_byte,
            }
        return {
            "source": self.source,
            "devices_per_node": self.devices_per_node,
            "devices_per_domain": self.devices_per_domain,
            "params": params,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "collective fit") -> CollectiveFit:
        try:
            params = {
                (collective, level): AlphaBeta(float(v["alpha_s"]), float(v["beta_s_per_byte"]))
                for collective, levels in data["params"].items()
                for level, v in levels.items()
            }
            return cls(
                params,
                int(data["devices_per_node"]),
                int(data["devices_per_domain"]),
                str(data.get("source", source)),
                tuple(data.get("notes", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"malformed collective fit: {exc!r}", source=source) from None


def alpha_beta_from_link_fit(collective: str, lat_s: float, bw_Bps: float, world: int) -> AlphaBeta:
    """Per-step parameters from a measured `time = lat_s + bytes / bw_Bps` on `world` ranks.

    `bytes` is what `poise calibrate` records: for `all_to_all` the bytes a rank sends to the
    others, m (world - 1) / world; for `all_reduce`, `all_gather` and `reduce_scatter` the
    message size m of the module docstring. Matching the formula of each collective on n =
    `world` ranks term by term gives

        all_to_all      alpha = lat / (n - 1),        beta = 1 / bw
        all_gather      alpha = lat / (n - 1),        beta = n / ((n - 1) bw)
        reduce_scatter  alpha = lat / (n - 1),        beta = n / ((n - 1) bw)
        all_reduce      alpha = lat / (2 (n - 1)),    beta = n / (2 (n - 1) bw)
    """
    check_collective(collective)
    if world < 2:
        raise ConfigError(f"need >= 2 ranks, got {world}", field="world")
    if not bw_Bps > 0 or lat_s < 0:
        raise ConfigError("need bw_Bps > 0 and lat_s >= 0", field=collective)
    w = float(world)
    if collective == "all_to_all":
        return AlphaBeta(lat_s / (w - 1), 1.0 / bw_Bps)
    steps = ROUNDS[collective] * (w - 1)
    return AlphaBeta(lat_s / steps, w / (steps * bw_Bps))


# ---------------------------------------------------------- collectives by their algorithms
BUS_FACTOR = {
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def bus_bandwidth(collective: str, n: int, nbytes: float, seconds: float) -> float:
    """nccl-tests' bus bandwidth (module docstring): busBw = algBw * f(n), algBw = `nbytes` /
    `seconds`, `nbytes` the collective's size S as nccl-tests counts it (m above)."""
    if collective not in BUS_FACTOR:
        raise ConfigError(
            f"unknown collective {collective!r} (known: {', '.join(BUS_FACTOR)})",
            field="collective",
        )
    if n < 1 or not seconds > 0:
        raise ConfigError(f"need n >= 1 and seconds > 0, got {n}, {seconds}", field=collective)
    return float(nbytes) / float(seconds) * BUS_FACTOR[collective](n)


def _none(n: int, nbytes: float) -> bool:
    """One member or nothing to send: the collective costs nothing."""
    return n <= 1 or nbytes <= 0


def p2p_s(nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """One message from one device to another: m / bw + lat; 0 for nothing to send."""
    if nbytes <= 0:
        return 0.0
    return nbytes / bw_Bps + lat_s


def chain_broadcast_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """Pipelined chain (ring) broadcast from a root to n - 1 others: m / bw + (n - 1) lat."""
    if _none(n, nbytes):
        return 0.0
    return nbytes / bw_Bps + (n - 1) * lat_s


def tree_broadcast_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """Pipelined double-binary-tree broadcast: m / bw + ceil(log2 n) lat."""
    if _none(n, nbytes):
        return 0.0
    return nbytes / bw_Bps + math.ceil(math.log2(n)) * lat_s


def broadcast_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """The faster of the chain and the tree: one root sends m bytes to n - 1 others (n members
    in all, the root included). About one message's time for large m, whatever n."""
    return min(
        chain_broadcast_s(n, nbytes, bw_Bps, lat_s), tree_broadcast_s(n, nbytes, bw_Bps, lat_s)
    )


def chain_reduce_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """Pipelined chain reduce of n buffers of m bytes to a root: the broadcast run backwards,
    m / bw + (n - 1) lat (the additions are not charged)."""
    return chain_broadcast_s(n, nbytes, bw_Bps, lat_s)


def tree_reduce_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """Pipelined double-binary-tree reduce: m / bw + ceil(log2 n) lat."""
    return tree_broadcast_s(n, nbytes, bw_Bps, lat_s)


def reduce_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """The faster of the chain and the tree: n members' m-byte buffers summed on one root."""
    return min(chain_reduce_s(n, nbytes, bw_Bps, lat_s), tree_reduce_s(n, nbytes, bw_Bps, lat_s))


def all_gather_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """Ring all-gather of an m-byte output (m / n from each member): (n - 1) / n m / bw +
    (n - 1) lat."""
    if _none(n, nbytes):
        return 0.0
    return (n - 1) / n * nbytes / bw_Bps + (n - 1) * lat_s


def reduce_scatter_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """Ring reduce-scatter of an m-byte input (each member keeps m / n of the sum): (n - 1) / n
    m / bw + (n - 1) lat."""
    return all_gather_s(n, nbytes, bw_Bps, lat_s)


def all_to_all_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """Flat pairwise all-to-all, m = a member's send buffer (m / n to each member, its own
    chunk included): n - 1 rounds of lat + m / (n bw)."""
    if _none(n, nbytes):
        return 0.0
    return (n - 1) * (lat_s + nbytes / (n * bw_Bps))


def two_level_all_to_all_s(
    per_node: int,
    nodes: int,
    nbytes: float,
    intra: tuple[float, float],
    inter: tuple[float, float],
) -> float:
    """Flat pairwise all-to-all of n = `per_node` * `nodes` members on two levels, `intra` and
    `inter` each `(bw_Bps, lat_s)`: the g - 1 rounds with members of the same node at the intra
    level, the n - g others across (T_flat, module docstring)."""
    n = per_node * nodes
    if _none(n, nbytes):
        return 0.0
    (bw0, lat0), (bw1, lat1) = intra, inter
    chunk = nbytes / n
    return (per_node - 1) * (lat0 + chunk / bw0) + (n - per_node) * (lat1 + chunk / bw1)


def hierarchical_all_to_all_s(
    per_node: int,
    nodes: int,
    nbytes: float,
    intra: tuple[float, float],
    inter: tuple[float, float],
) -> float:
    """Two-phase (2DH) all-to-all of n = `per_node` * `nodes` members, m = a member's send
    buffer: an all-to-all inside the node, then one among the members of the same local index
    across the nodes (T_2DH, module docstring); `intra`, `inter`: `(bw_Bps, lat_s)`."""
    if _none(per_node * nodes, nbytes):
        return 0.0
    return all_to_all_s(per_node, nbytes, *intra) + all_to_all_s(nodes, nbytes, *inter)


# ----------------------------------------------------------------- hierarchical all-reduce
def ring_allreduce_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """T_ring (module docstring); 0 for one member or nothing to reduce."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bw_Bps + 2.0 * (n - 1) * lat_s


def tree_allreduce_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """T_tree (module docstring); 0 for one member or nothing to reduce."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * nbytes / bw_Bps + 2.0 * math.ceil(math.log2(n)) * lat_s


def allreduce_s(n: int, nbytes: float, bw_Bps: float, lat_s: float) -> float:
    """The faster of the ring and the tree on one level."""
    return min(
        ring_allreduce_s(n, nbytes, bw_Bps, lat_s), tree_allreduce_s(n, nbytes, bw_Bps, lat_s)
    )


def fan_outs(cluster: Cluster, members: np.ndarray) -> tuple[int, int, int]:
    """`(n0, n1, n2)`: members per node, nodes per domain and domains of a group of devices
    spread evenly (e.g. contiguous, or at a fixed stride)."""
    members = np.asarray(members, dtype=np.int64)
    nodes = len(np.unique(cluster.node_of()[members]))
    domains = len(np.unique(cluster.domain_of()[members]))
    return len(members) // nodes, nodes // domains, domains


def hierarchical_allreduce_s(
    cluster: Cluster, members: np.ndarray, nbytes: float, groups_per_node: int = 1
) -> float:
    """Seconds for one group of devices `members` to all-reduce `nbytes` while
    `groups_per_node` such groups with members in each node run at once (module docstring)."""
    if len(members) <= 1 or nbytes <= 0:
        return 0.0
    n0, n1, n2 = fan_outs(cluster, members)
    flows = max(1, groups_per_node * n0)
    total = 0.0
    shard = float(nbytes)
    for level, n in enumerate((n0, n1, n2)):
        link = cluster.links()[level]
        bw = link.per_device_bw_Bps if level == 0 else link.bw_Bps / min(link.shared_by, flows)
        total += allreduce_s(n, shard, bw, link.lat_s)
        shard /= n
    return total


__all__ = [
    "BUS_FACTOR",
    "COLLECTIVES",
    "AlphaBeta",
    "CollectiveFit",
    "all_gather_s",
    "all_to_all_s",
    "allreduce_s",
    "alpha_beta_from_link_fit",
    "broadcast_s",
    "bus_bandwidth",
    "chain_broadcast_s",
    "chain_reduce_s",
    "check_collective",
    "collective_time",
    "fan_outs",
    "hierarchical_all_to_all_s",
    "hierarchical_allreduce_s",
    "level_alpha_beta",
    "p2p_s",
    "reduce_s",
    "reduce_scatter_s",
    "ring_allreduce_s",
    "span_level",
    "tree_allreduce_s",
    "tree_broadcast_s",
    "tree_reduce_s",
    "two_level_all_to_all_s",
]
