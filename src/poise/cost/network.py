"""Links as capacities: the seconds a phase's bytes take on the cluster's links.

The cluster has three link levels (`poise.core.cluster`): each device's port into its node's
fabric (level 0: NVLink, PCIe), the node's network interfaces (level 1: InfiniBand, RoCE,
Ethernet) and each domain's wide-area uplinks (level 2). A level's `Link` is one physical link
of `bw_Bps` bytes/s per direction, shared by the `shared_by` consecutive devices behind it
(numbered node-major): a node of 8 GPUs with one NIC has `shared_by=8` at level 1, eight NICs
`shared_by=1`. What crosses which link:

- a level-0 link carries the intra-node bytes of its devices;
- a level-1 link (NIC) carries the bytes its devices send out of, or receive into, their node
  (inter-node and inter-domain traffic);
- a level-2 link (uplink) carries the bytes its devices send out of, or receive into, their
  domain.

For one phase with per-device bytes `send[v, d]`, `recv[v, d]` by the level they cross (the
traffic of `poise.cost.traffic`), the load of link k at level v is

    load_k = max( sum_{d behind k} out_v[d],  sum_{d behind k} in_v[d] )
    out_0 = send_0,  out_1 = send_1 + send_2,  out_2 = send_2   (likewise `in` from `recv`)

and, with `m_out[v, d]`, `m_in[v, d]` the peers device d sends to and receives from over level
v in the phase (the level between the two devices; `poise.cost.messages`), the phase takes (the
alpha-beta model per link; all links work at once)

    T = max_{v, k} load_k / bw_v  +  max_d sum_v lat_v * m_v[d],
    m_v[d] = max(m_out[v, d], m_in[v, d])

a latency per message: a device exchanging with p peers over a level pays p of that level's
latencies (its sends and receives overlap, as a link's two directions do). This is the
pairwise-exchange all-to-all of the alpha-beta model, (p - 1) alpha + bytes beta over p
devices (Thakur, Rabenseifner & Gropp, IJHPCA 2005), so that an all-to-all among G devices
costs G - 1 latencies and one confined to domains of S devices plus S - 1 gathers fewer
(HybridEP, Yang et al. arXiv 2510.19470, Table VII).

A lone device behind a shared NIC thus gets the whole NIC, and a NIC shared by eight devices
that all send at once gives each an eighth: what one device may use follows from the traffic,
not from a fixed share. Adding bandwidth never slows a phase (T is non-increasing in every
`bw_v`). Sources: the alpha-beta (Hockney) model per link as in FasterMoE eq. 7-8 and
HybridEP eq. 10-11; the bottleneck-link (max over links) form of a concurrent transfer as in
NCCL's and SimAI's network models of a fabric of independent links.

Levels that cannot carry traffic on a cluster (one device per node, one node per domain, one
domain) carry nothing and cost nothing. A link carrying less than `MIN_TRAFFIC_BYTES` is float
residue, not traffic, and costs nothing; the message counts apply the same floor per source
and expert (`poise.cost.traffic.sends`).
"""

from __future__ import annotations

import numpy as np

from poise.core.cluster import Cluster

MIN_TRAFFIC_BYTES = 1.0  # less than one byte on a level is float residue, not a message


def group_sizes(cluster: Cluster) -> tuple[int, int, int]:
    """Devices behind one link of each level: `shared_by`, at most the devices of the node
    (levels 0 and 1) or of the domain (level 2)."""
    dpn, dpd = cluster.devices_per_node, cluster.devices_per_domain
    links = cluster.links()
    return (
        min(links[0].shared_by, dpn),
        min(links[1].shared_by, dpn),
        min(links[2].shared_by, dpd),
    )


def carrying_levels(cluster: Cluster) -> tuple[int, ...]:
    """The levels that can carry traffic on `cluster`: 0 with several devices per node, 1 with
    several nodes (a NIC also carries what crosses domains), 2 with several domains."""
    has = (cluster.devices_per_node > 1, cluster.num_nodes > 1, cluster.domains > 1)
    return tuple(v for v in range(3) if has[v])


def _group_max(x: np.ndarray, size: int) -> np.ndarray:
    """`[..., D]` per-device bytes -> `[...]` the largest sum over consecutive runs of `size`
    devices (the most loaded link of a level)."""
    if size == 1:
        return x.max(axis=-1)
    D = x.shape[-1]
    return x.reshape(*x.shape[:-1], D // size, size).sum(axis=-1).max(axis=-1)


def latency_s(cluster: Cluster, out: np.ndarray, into: np.ndarray, axis: int = 0) -> np.ndarray:
    """Per device, sum_v lat_v * max(out_v, into_v): the latency of the messages a device sends
    to and receives from its peers, `out`, `into` with the level on `axis` (length 3)."""
    lat = np.array([k.lat_s for k in cluster.links()])
    shape = [1] * np.ndim(out)
    shape[axis] = 3
    return (lat.reshape(shape) * np.maximum(out, into)).sum(axis=axis)


def bandwidth_s(cluster: Cluster, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
    """`[...]` seconds the most loaded link takes for the bytes each device sends and receives
    over each level, `send[3, ..., D]`, `recv[3, ..., D]`: the bandwidth part of `link_seconds`."""
    send = np.asarray(send, dtype=np.float64)
    recv = np.asarray(recv, dtype=np.float64)
    sizes = group_sizes(cluster)
    links = cluster.links()
    bandwidth = np.zeros(send.shape[1:-1])
    for v in carrying_levels(cluster):
        if v == 1:  # a NIC also carries what leaves or enters the domain
            out, into = send[1] + send[2], recv[1] + recv[2]
            load = np.maximum(_group_max(out, sizes[1]), _group_max(into, sizes[1]))
        elif sizes[v] == 1:
            load = np.maximum(send[v], recv[v]).max(axis=-1)
        else:
            load = np.maximum(_group_max(send[v], sizes[v]), _group_max(recv[v], sizes[v]))
        busy = np.where(load >= MIN_TRAFFIC_BYTES, load, 0.0)
        bandwidth = np.maximum(bandwidth, busy / links[v].bw_Bps)
    return bandwidth


def link_seconds(
    cluster: Cluster,
    send: np.ndarray,
    recv: np.ndarray,
    messages: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """`[...]` seconds of a phase from the bytes each device sends and receives over each level,
    `send[3, ..., D]`, `recv[3, ..., D]`, and the peers it sends to and receives from there,
    `messages = (m_out[3, ..., D], m_in[3, ..., D])` (the module docstring's T): `bandwidth_s`
    plus the largest latency of one device's messages (`latency_s`)."""
    m_out, m_in = messages
    latency = latency_s(cluster, np.asarray(m_out), np.asarray(m_in))  # [..., D]
    return bandwidth_s(cluster, send, recv) + latency.max(axis=-1, initial=0.0)


def one_message_per_level(send: np.ndarray, recv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(m_out, m_in)` for a phase in which each device exchanges with at most one peer per
    level and direction: one message wherever it sends (receives) at least `MIN_TRAFFIC_BYTES`
    over a level (`send`, `recv` bytes by level, any layout)."""
    return (
        (np.asarray(send) >= MIN_TRAFFIC_BYTES).astype(np.float64),
        (np.asarray(recv) >= MIN_TRAFFIC_BYTES).astype(np.float64),
    )


def link_split(cluster: Cluster) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """`(port_levels, shared)`: the carrying levels whose links serve one device each (priced
    per device) and `(level, devices behind one link)` of those whose links several devices
    share (priced per group of consecutive devices). Together they are `carrying_levels`."""
    sizes = group_sizes(cluster)
    levels = carrying_levels(cluster)
    return (
        tuple(v for v in levels if sizes[v] == 1),
        tuple((v, sizes[v]) for v in levels if sizes[v] > 1),
    )


def link_bytes(send: np.ndarray, recv: np.ndarray, level: int) -> tuple[np.ndarray, np.ndarray]:
    """`(out, into)` `[..., X]`: the bytes each device puts on its level-`level` link in each
    direction, from `send[..., 3, X]`, `recv[..., 3, X]` by level (a NIC also carries what
    leaves or enters the domain: out_1 = send_1 + send_2)."""
    if level == 1:
        return send[..., 1, :] + send[..., 2, :], recv[..., 1, :] + recv[..., 2, :]
    return send[..., level, :], recv[..., level, :]


def busy_s(load: np.ndarray, bw: float) -> np.ndarray:
    """Seconds of `load` bytes on a link of `bw` bytes/s; less than `MIN_TRAFFIC_BYTES` is
    float residue and costs nothing."""
    return np.where(load >= MIN_TRAFFIC_BYTES, load, 0.0) / bw


def device_seconds(
    cluster: Cluster,
    send: np.ndarray,
    recv: np.ndarray,
    m_out: np.ndarray,
    m_in: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The per-device parts of `link_seconds`: `(port_s, latency_s)`, each `[..., X]`, from
    `send[..., 3, X]`, `recv[..., 3, X]` bytes by level and the peers sent to and received from
    by level, `m_out[..., 3, X]`, `m_in[..., 3, X]`:

        port_s[d]    = max_{v unshared} max(out_v[d], in_v[d]) / bw_v
        latency_s[d] = sum_v lat_v * max(m_out[v, d], m_in[v, d])

    With `group_seconds` (the links several devices share) a phase takes

        T = max( max_d port_s[d], group_seconds ) + max_d latency_s[d]  =  link_seconds

    so planners that change a few devices at a time keep these per device and the shared links'
    loads per group (`poise.cost.incremental.LayerState`)."""
    ports, _ = link_split(cluster)
    links = cluster.links()
    lead = send.shape[:-2] + send.shape[-1:]
    port = np.zeros(lead)
    for v in ports:
        out, into = link_bytes(send, recv, v)
        np.maximum(port, busy_s(np.maximum(out, into), links[v].bw_Bps), out=port)
    return port, latency_s(cluster, m_out, m_in, axis=-2)


def group_seconds(cluster: Cluster, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
    """`[...]` the busiest shared link's seconds (0 without shared links) for full states
    `send[..., 3, D]`, `recv[..., 3, D]`: max over shared levels v and their links k of
    max(sum_{d behind k} out_v[d], sum_{d behind k} in_v[d]) / bw_v."""
    _, shared = link_split(cluster)
    links = cluster.links()
    out_s = np.zeros(send.shape[:-2])
    for v, size in shared:
        out, into = link_bytes(send, recv, v)
        load = np.maximum(_group_max(out, size), _group_max(into, size))
        np.maximum(out_s, busy_s(load, links[v].bw_Bps), out=out_s)
    return out_s


def fair_share_links(cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """`(bw_Bps[3], lat_s[3])`: each level's bandwidth per device when every device behind a
    link sends at once (`Link.per_device_bw_Bps`: a pipeline's stage-to-stage sends), and its
    latency."""
    links = cluster.links()
    return (
        np.array([k.per_device_bw_Bps for k in links]),
        np.array([k.lat_s for k in links]),
    )


__all__ = [
    "MIN_TRAFFIC_BYTES",
    "busy_s",
    "device_seconds",
    "fair_share_links",
    "group_seconds",
    "group_sizes",
    "latency_s",
    "link_bytes",
    "link_seconds",
    "link_split",
    "one_message_per_level",
]
