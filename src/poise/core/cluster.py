"""Clusters: devices grouped into nodes, nodes into domains (datacentres).

Each of the three link levels has a bandwidth and a latency:

- `intra_node`: between devices of one node (NVLink, PCIe);
- `inter_node`: between nodes of one domain (InfiniBand, RoCE, Ethernet);
- `inter_domain`: between domains (a wide-area link between datacentres).

A link is a capacity shared by the devices behind it (one NIC per node of eight GPUs:
`shared_by=8`): what one device gets follows from the traffic (`poise.cost.network`), a lone
sender the whole link, eight senders at once an eighth each. Devices have a dense GEMM rate and
memory. Presets carry the numbers the papers report for their clusters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from poise.core.errors import ConfigError
from poise.core.fields import (
    get_int,
    get_mapping,
    get_number,
    get_str,
    read_mapping_file,
    reject_unknown,
)
from poise.util.atomic import atomic_write_text

GBIT = 1e9 / 8  # bytes per second in one Gb/s
GIB = 2**30

LEVELS = ("intra_node", "inter_node", "inter_domain")


@dataclass(frozen=True)
class Link:
    """One level of the network. `bw_Bps`: bytes/s of one link per direction (its capacity);
    `lat_s`: seconds per message; `shared_by`: how many consecutive devices sit behind one such
    link (it must divide the devices of a node for the device and node levels, of a domain for
    the domain level)."""

    bw_Bps: float
    lat_s: float
    shared_by: int = 1

    @property
    def per_device_bw_Bps(self) -> float:
        """The share of the link each device gets when every device behind it sends at once (a
        collective in which all members move data together); the cost model's phases price the
        link as a capacity under their actual traffic instead (`poise.cost.network`)."""
        return self.bw_Bps / self.shared_by


HOST_FIELDS = (
    "dense_fwd_flops",
    "dense_fwd_half_tokens",
    "dense_bwd_flops",
    "dense_bwd_half_tokens",
    "dispatch_fwd_s",
    "dispatch_fwd_s_per_row",
    "dispatch_bwd_s",
    "dispatch_bwd_s_per_row",
    "optimizer_s",
    "optimizer_s_per_param",
    "clip_s",
    "clip_s_per_param",
    "allreduce_lat_s",
    "allreduce_bw_Bps",
)
# fields that may be left out (None): the rate or link the cost model used before
OPTIONAL_HOST_FIELDS = ("dense_fwd_flops", "dense_bwd_flops", "allreduce_lat_s", "allreduce_bw_Bps")


@dataclass(frozen=True)
class HostCosts:
    """A device's measured costs beyond its expert GEMMs and the token all-to-all's links
    (`poise calibrate` fits them; the formulas are in `poise.cost.host` and
    `poise.cost.step_overheads`). The defaults price nothing new, so a cluster without them (every
    preset) prices exactly as before.

    - non-MoE compute (attention, norms, router, the head's share) over n tokens runs at
      `dense_*_flops * n / (n + dense_*_half_tokens)` FLOP/s, forward and backward;
      `dense_fwd_flops=None`: the GEMM peak `Cluster.gemm_flops` with no small-batch loss (the
      cost model's FNEC); `dense_bwd_flops=None`: the forward's rate and half tokens (BNEC =
      2 FNEC);
    - the token dispatcher's host work per MoE layer (sorting, permuting and packing rows,
      the counts exchange) beyond its all-to-alls' link time: `dispatch_fwd_s +
      dispatch_fwd_s_per_row * rows` forward and likewise backward, rows = rows a device sends
      plus rows it receives;
    - per step: the optimizer step `optimizer_s + optimizer_s_per_param * params` and the
      gradient norm and clipping `clip_s + clip_s_per_param * params` over a device's
      parameters; the dense gradients' all-reduce `allreduce_lat_s + bytes /
      allreduce_bw_Bps` (measured between the devices), or with None the hierarchical
      all-reduce on the cluster's links (`poise.cost.collectives.hierarchical_allreduce_s`)."""

    dense_fwd_flops: float | None = None
    dense_fwd_half_tokens: float = 0.0
    dense_bwd_flops: float | None = None
    dense_bwd_half_tokens: float = 0.0
    dispatch_fwd_s: float = 0.0
    dispatch_fwd_s_per_row: float = 0.0
    dispatch_bwd_s: float = 0.0
    dispatch_bwd_s_per_row: float = 0.0
    optimizer_s: float = 0.0
    optimizer_s_per_param: float = 0.0
    clip_s: float = 0.0
    clip_s_per_param: float = 0.0
    allreduce_lat_s: float | None = None
    allreduce_bw_Bps: float | None = None

    def __post_init__(self) -> None:
        for name in HOST_FIELDS:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_HOST_FIELDS:
                continue
            positive = name.endswith("flops") or name.endswith("Bps")
            if value is None or not np.isfinite(value) or (value <= 0 if positive else value < 0):
                raise ConfigError(
                    f"must be {'> 0' if positive else '>= 0'}, got {value!r}",
                    source="host",
                    field=f"host.{name}",
                )
        if (self.allreduce_lat_s is None) != (self.allreduce_bw_Bps is None):
            raise ConfigError(
                "give both allreduce_lat_s and allreduce_bw_Bps, or neither",
                source="host",
                field="host.allreduce_bw_Bps",
            )

    @property
    def is_default(self) -> bool:
        """True when nothing beyond the GEMM and link model is priced."""
        return self == HostCosts()

    def to_dict(self) -> dict[str, float]:
        """The fields that are set (None left out)."""
        return {k: getattr(self, k) for k in HOST_FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> HostCosts:
        reject_unknown(data, set(HOST_FIELDS), source, "host.")
        kwargs: dict[str, Any] = {}
        for name in HOST_FIELDS:
            positive = name.endswith("flops") or name.endswith("Bps")
            default = None if name in OPTIONAL_HOST_FIELDS else 0.0
            kwargs[name] = get_number(
                data,
                name,
                source,
                default=default,
                positive=positive,
                non_negative=not positive,
                prefix="host.",
            )
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(exc.message, source=source, field=exc.field) from None


@dataclass(frozen=True)
class Cluster:
    """`devices_per_node` x `nodes_per_domain` x `domains` devices, numbered node-major:
    device d sits in node d // devices_per_node and domain d // (devices_per_node *
    nodes_per_domain).

    `gemm_flops` is the dense rate (FLOP/s) a device reaches on large expert GEMMs;
    `gemm_half_rows` the row count at which a GEMM reaches half of it (0: no small-batch loss),
    so a GEMM over n rows runs at gemm_flops * n / (n + gemm_half_rows).
    `host`: the measured host-side costs (`HostCosts`; default: none).
    """

    name: str
    devices_per_node: int
    nodes_per_domain: int
    domains: int
    gemm_flops: float
    memory_bytes: float
    intra_node: Link
    inter_node: Link
    inter_domain: Link
    gemm_half_rows: float = 0.0
    host: HostCosts = HostCosts()

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "nodes_per_domain", "domains"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"must be >= 1, got {getattr(self, name)}", source=self.name, field=name
                )
        if self.gemm_flops <= 0 or self.memory_bytes <= 0:
            raise ConfigError(
                "device gemm_flops and memory_bytes must be > 0", source=self.name, field="device"
            )
        for level in LEVELS:
            link: Link = getattr(self, level)
            if link.bw_Bps <= 0 or link.lat_s < 0 or link.shared_by < 1:
                raise ConfigError(
                    "bw_Bps must be > 0, lat_s >= 0, shared_by >= 1",
                    source=self.name,
                    field=f"links.{level}",
                )
            behind = self.devices_per_domain if level == "inter_domain" else self.devices_per_node
            if link.shared_by < behind and behind % link.shared_by:
                where = "domain" if level == "inter_domain" else "node"
                raise ConfigError(
                    f"shared_by {link.shared_by} does not divide the {behind} devices of a {where}",
                    source=self.name,
                    field=f"links.{level}.shared_by",
                )

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes_per_domain * self.domains

    @property
    def num_nodes(self) -> int:
        return self.nodes_per_domain * self.domains

    @property
    def devices_per_domain(self) -> int:
        return self.devices_per_node * self.nodes_per_domain

    def node_of(self) -> np.ndarray:
        """`[D]` node index of each device."""
        return np.arange(self.num_devices) // self.devices_per_node

    def domain_of(self) -> np.ndarray:
        """`[D]` domain index of each device."""
        return np.arange(self.num_devices) // self.devices_per_domain

    def links(self) -> tuple[Link, Link, Link]:
        return (self.intra_node, self.inter_node, self.inter_domain)

    def level_between(self, src: np.ndarray | int, dst: np.ndarray | int) -> np.ndarray:
        """Link level used from `src` to `dst`: -1 same device, 0 intra-node, 1 inter-node,
        2 inter-domain. Broadcasts like NumPy."""
        src = np.asarray(src)
        dst = np.asarray(dst)
        same_node = src // self.devices_per_node == dst // self.devices_per_node
        same_domain = src // self.devices_per_domain == dst // self.devices_per_domain
        level = np.where(same_domain, np.where(same_node, 0, 1), 2)
        return np.where(src == dst, -1, level)

    def gemm_rate(self, rows: np.ndarray | float) -> np.ndarray:
        """Achieved FLOP/s for a GEMM over `rows` token rows (small-batch efficiency curve)."""
        rows = np.asarray(rows, dtype=np.float64)
        if self.gemm_half_rows <= 0:
            return np.full_like(rows, self.gemm_flops)
        return self.gemm_flops * rows / (rows + self.gemm_half_rows)

    def resized(
        self,
        *,
        nodes_per_domain: int | None = None,
        domains: int | None = None,
        name: str | None = None,
    ) -> Cluster:
        return dataclasses.replace(
            self,
            name=name or self.name,
            nodes_per_domain=nodes_per_domain or self.nodes_per_domain,
            domains=domains or self.domains,
        )

    # ---------------------------------------------------------------- YAML
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "devices_per_node": self.devices_per_node,
            "nodes_per_domain": self.nodes_per_domain,
            "domains": self.domains,
            "device": {
                "gemm_flops": self.gemm_flops,
                "memory_bytes": self.memory_bytes,
                "gemm_half_rows": self.gemm_half_rows,
            },
            "links": {level: dataclasses.asdict(getattr(self, level)) for level in LEVELS},
            **({} if self.host.is_default else {"host": self.host.to_dict()}),
        }

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> Cluster:
        reject_unknown(
            data,
            {"name", "devices_per_node", "nodes_per_domain", "domains", "device", "links", "host"},
            source,
        )
        dpn = get_int(data, "devices_per_node", source, minimum=1)
        npd = get_int(data, "nodes_per_domain", source, default=1, minimum=1)
        domains = get_int(data, "domains", source, default=1, minimum=1)
        if dpn * npd * domains > 10_000_000:
            raise ConfigError("more than 10 million devices", source=source, field="domains")
        device = get_mapping(data, "device", source)
        reject_unknown(device, {"gemm_flops", "memory_bytes", "gemm_half_rows"}, source, "device.")
        links_raw = get_mapping(data, "links", source)
        reject_unknown(links_raw, set(LEVELS), source, "links.")
        links: dict[str, Link] = {}
        previous: Link | None = None
        for level in LEVELS:
            needed = (
                level == "intra_node"
                or (level == "inter_node" and npd > 1)
                or (level == "inter_domain" and domains > 1)
            )
            if level not in links_raw:
                if needed or previous is None:
                    raise ConfigError("missing link level", source=source, field=f"links.{level}")
                links[level] = previous
                continue
            raw = get_mapping(links_raw, level, source, prefix="links.")
            prefix = f"links.{level}."
            reject_unknown(raw, {"bw_Bps", "lat_s", "shared_by"}, source, prefix)
            links[level] = Link(
                bw_Bps=get_number(raw, "bw_Bps", source, positive=True, prefix=prefix),
                lat_s=get_number(raw, "lat_s", source, non_negative=True, prefix=prefix),
                shared_by=get_int(raw, "shared_by", source, default=1, minimum=1, prefix=prefix),
            )
            previous = links[level]
        host = HostCosts()
        if "host" in data:
            host = HostCosts.from_dict(get_mapping(data, "host", source), source)
        return cls(
            name=get_str(data, "name", source, default=Path(source).stem),
            devices_per_node=dpn,
            nodes_per_domain=npd,
            domains=domains,
            gemm_flops=get_number(device, "gemm_flops", source, positive=True, prefix="device."),
            memory_bytes=get_number(
                device, "memory_bytes", source, positive=True, prefix="device."
            ),
            gemm_half_rows=get_number(
                device, "gemm_half_rows", source, default=0.0, non_negative=True, prefix="device."
            ),
            host=host,
            **links,
        )

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        return cls.from_dict(read_mapping_file(path), str(path))


def _uniform(
    name: str,
    dpn: int,
    npd: int,
    domains: int,
    flops: float,
    mem: float,
    intra: Link,
    inter: Link,
    wan: Link | None = None,
    half_rows: float = 0.0,
) -> Cluster:
    return Cluster(
        name=name,
        devices_per_node=dpn,
        nodes_per_domain=npd,
        domains=domains,
        gemm_flops=flops,
        memory_bytes=mem,
        intra_node=intra,
        inter_node=inter,
        inter_domain=wan or inter,
        gemm_half_rows=half_rows,
    )


def _presets() -> dict[str, Cluster]:
    # GEMM rates are dense half-precision tensor-core peaks from the vendors' data sheets, scaled by
    # 0.7 for what large GEMMs reach; half-efficiency rows model small-batch GEMMs.
    v100 = 125e12 * 0.7
    rtx3090 = 71e12 * 0.7  # fp16 tensor with fp32 accumulate, dense
    a800 = 312e12 * 0.7
    h100 = 989e12 * 0.7
    return {
        # Two local processes on this kind of machine; `poise calibrate` measures the real figures.
        "cpu-2": _uniform(
            "cpu-2", 2, 1, 1, 5e10, 8 * GIB, Link(4e9, 30e-6), Link(4e9, 30e-6), half_rows=16
        ),
        # FasterMoE "johnny": 2 nodes x 8 V100 on PCIe 3.0, one 50 Gb/s InfiniBand NIC per node.
        "v100-ib50": _uniform(
            "v100-ib50",
            8,
            2,
            1,
            v100,
            32 * GIB,
            Link(12e9, 10e-6),
            Link(50 * GBIT, 5e-6, shared_by=8),
            half_rows=256,
        ),
        # FasterMoE "trevor": 16 nodes x 4 V100 with NVLink, one 100 Gb/s InfiniBand NIC per node.
        "v100-nvlink-ib100": _uniform(
            "v100-nvlink-ib100",
            4,
            16,
            1,
            v100,
            32 * GIB,
            Link(50e9, 5e-6),
            Link(100 * GBIT, 5e-6, shared_by=4),
            half_rows=256,
        ),
        # Pro-Prophet: nodes of 4 RTX 3090 on PCIe, 100 Gb/s InfiniBand; 4 nodes (also :8).
        "rtx3090-ib100": _uniform(
            "rtx3090-ib100",
            4,
            4,
            1,
            rtx3090,
            24 * GIB,
            Link(16e9, 10e-6),
            Link(100 * GBIT, 5e-6, shared_by=4),
            half_rows=256,
        ),
        # HybridEP: nodes of 8 A800 at 128 Gb/s inside, 10 Gb/s Ethernet between; each node is a
        # domain (the low-bandwidth boundary HybridEP partitions on); 2 nodes (also :4).
        "a800-eth10": _uniform(
            "a800-eth10",
            8,
            1,
            2,
            a800,
            80 * GIB,
            Link(128 * GBIT, 10e-6),
            Link(128 * GBIT, 10e-6),
            Link(10 * GBIT, 100e-6, shared_by=8),
            half_rows=256,
        ),
        # DGX H100: 8 GPUs on NVLink 4 (450 GB/s per direction), 400 Gb/s InfiniBand per GPU.
        "dgx-h100": _uniform(
            "dgx-h100",
            8,
            8,
            1,
            h100,
            80 * GIB,
            Link(450e9, 3e-6),
            Link(400 * GBIT, 5e-6),
            half_rows=512,
        ),
        # 1,000 datacentres of one 8-GPU node each, joined by 10 Gb/s wide-area links, 20 ms away.
        "cross-dc-1000": _uniform(
            "cross-dc-1000",
            8,
            1,
            1000,
            h100,
            80 * GIB,
            Link(450e9, 3e-6),
            Link(400 * GBIT, 5e-6),
            Link(10 * GBIT, 20e-3, shared_by=8),
            half_rows=512,
        ),
    }


PRESETS: dict[str, Cluster] = _presets()


def get_cluster(spec: str) -> Cluster:
    """A preset name, `preset:N` (N nodes; N domains for multi-domain presets) or a YAML path."""
    name, _, count = spec.partition(":")
    if name in PRESETS:
        cluster = PRESETS[name]
        if not count:
            return cluster
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(
                f"size after ':' must be a positive integer, got {count!r}",
                source=spec,
                field="cluster",
            )
        n = int(count)
        if cluster.domains > 1:
            return cluster.resized(domains=n, name=spec)
        return cluster.resized(nodes_per_domain=n, name=spec)
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return Cluster.load(path)
    raise ConfigError(
        f"unknown cluster preset (known: {', '.join(PRESETS)}) and no such file",
        source=spec,
        field="cluster",
    )
