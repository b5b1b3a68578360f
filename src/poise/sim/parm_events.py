"""A finer model of Parm's schedules than the alpha-beta one that chooses between them: the
"truth" the Parm grid (`poise.sim.parm_grid`) measures speedups and the choice against.

The operations are those of `poise.layouts.parm.schedule_ops`; only their pricing differs from
`poise.layouts.parm.layer_time`:

- **All-to-all on the cluster's hierarchy.** A rank's peers in the group are split by the link
  level between them (`Cluster.level_between`); the c_l peers on level l get their share of the
  message, bytes_l = m c_l / n, over that level's link, one message each, while the other
  levels' messages travel at the same time:

      t = max_l ( c_l lat_l + bytes_l / bw_l ),   bw_l = the level's bandwidth per device when
                                                  every device sends at once (`per_device_bw_Bps`)

  so the intra-node part of a unified all-to-all overlaps its inter-node part (an explicit max
  of concurrent streams), where the alpha-beta model charges every peer at the slowest level.
- **Rings on the hierarchy.** All-gather and reduce-scatter run as rings over the group's ranks
  in rank order: n - 1 steps, each moving m / n over every hop at once, so a step lasts as long
  as the slowest hop, lat + (m / n) / bw_hop. An inter-node hop's bandwidth is the NIC's
  divided among the rings of concurrent groups that leave the node through it (one flow per
  group and node, `Link.shared_by` devices per NIC), not always the all-to-all share:

      t = (n - 1) max_hop ( lat_hop + (m / n) / bw_hop ),     all-reduce: twice that.
- **GEMMs** from `Cluster.gemm_rate` (in the layer's compute dtype) over each GEMM's rows
  (local experts one after another), as in the alpha-beta model.

Every group of a kind runs its collective at the same time as the others (all EP groups
dispatch together), which is what the shared NIC bandwidth accounts for. Operations of a
schedule run one after another, as Parm places them; overlap happens inside the unified
all-to-all only. Not modelled: the gate's top-k and the reordering copies before and after the
all-to-alls, compute-communication overlap, stragglers.
"""

from __future__ import annotations

import math

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.layouts.parm import SCHEDULES, GemmModel, Op, ParmLayer, schedule_ops


def all_to_all_seconds(cluster: Cluster, size: int, nbytes: float, stride: int = 1) -> float:
    """All-to-all of `nbytes` per rank on `size` ranks `stride` apart (module docstring)."""
    if size <= 1:
        return 0.0
    peers = np.arange(1, size) * stride
    levels = cluster.level_between(0, peers)
    links = cluster.links()
    t = 0.0
    for level in np.unique(levels):
        count = int((levels == level).sum())
        link = links[int(level)]
        t = max(t, count * link.lat_s + nbytes * count / size / link.per_device_bw_Bps)
    return t


def ring_step_seconds(cluster: Cluster, size: int, chunk: float, stride: int = 1) -> float:
    """One step of a ring over `size` ranks `stride` apart moving `chunk` bytes on every hop:
    the slowest hop's latency plus transfer (module docstring)."""
    members = np.arange(size) * stride
    nxt = np.roll(members, -1)
    levels = cluster.level_between(members, nxt)
    links = cluster.links()
    dpn = cluster.devices_per_node
    # groups of this kind with members in one node: each sends one ring flow out of the node
    members_per_node = max(1, min(size, math.ceil(dpn / stride)))
    flows_per_node = max(1, dpn // members_per_node)
    t = 0.0
    for level in np.unique(levels):
        link = links[int(level)]
        if level == 0:
            bw = link.per_device_bw_Bps
        else:
            nics = max(1, dpn // link.shared_by)
            bw = link.bw_Bps / max(1, math.ceil(flows_per_node / nics))
        t = max(t, link.lat_s + chunk / bw)
    return t


def ring_seconds(
    cluster: Cluster, collective: str, size: int, nbytes: float, stride: int = 1
) -> float:
    """Ring all-gather / reduce-scatter (n - 1 steps) or all-reduce (2 (n - 1) steps)."""
    if size <= 1:
        return 0.0
    rounds = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[collective]
    return rounds * (size - 1) * ring_step_seconds(cluster, size, nbytes / size, stride)


def op_seconds(cluster: Cluster, layer: ParmLayer, op: Op) -> float:
    """Seconds of one operation under the event model."""
    if not op.is_collective:
        return GemmModel.from_cluster(cluster, layer.gemm_dtype).seconds(op.flops, op.rows)
    size, stride = layer.group(op.group)
    if op.kind == "all_to_all":
        return all_to_all_seconds(cluster, size, op.nbytes, stride)
    return ring_seconds(cluster, op.kind, size, op.nbytes, stride)


def event_layer_time(cluster: Cluster, layer: ParmLayer, schedule: str) -> float:
    """Seconds of one forward and backward pass of `layer` under `schedule`."""
    if layer.world > cluster.num_devices:
        raise ConfigError(
            f"the layer needs {layer.world} ranks, the cluster has {cluster.num_devices}",
            source=cluster.name,
            field="devices",
        )
    return float(sum(op_seconds(cluster, layer, op) for op in schedule_ops(layer, schedule)))


def event_times(cluster: Cluster, layer: ParmLayer) -> dict[str, float]:
    """`event_layer_time` of every schedule."""
    return {s: event_layer_time(cluster, layer, s) for s in SCHEDULES}
