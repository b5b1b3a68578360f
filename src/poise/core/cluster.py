"""Clusters: devices grouped into nodes, nodes into domains (datacentres).

Each of the three link levels has a bandwidth and a latency:

- `intra_node`: between devices of one node (NVLink, PCIe);
- `inter_node`: between nodes of one domain (InfiniBand, RoCE, Ethernet);
- `inter_domain`: between domains (a wide-area link between datacentres).

A link is a capacity shared by the devices behind it (one NIC per node of eight GPUs:
`shared_by=8`): what one device gets follows from the traffic (`poise.cost.network`), a lone
sender the whole link, eight senders at once an eighth each.

A device has memory and a GEMM rate per compute dtype (`DTYPES`): a GEMM of F FLOPs over n token
rows in dtype t takes

    seconds = F / rate(n, t),   rate(n, t) = peak[t] * efficiency * n / (n + half_rows)

with `peak_flops` the data sheet's dense peak per dtype (`PeakFlops`), `gemm_efficiency` the
fraction of it large GEMMs reach and `gemm_half_rows` the rows at which a GEMM reaches half of
that (`Cluster.gemm_rate`). A device's expert forward + backward in one MoE layer takes at
least `expert_call_floor_s` once it computes a row (the host issuing the kernels of one grouped
call while the GPU waits; `poise.cost.model.expert_call_floor`). The named presets, every figure
cited beside it, are in `poise.core.presets`.
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

DTYPES = ("fp32", "tf32", "bf16", "fp16")
"""Compute dtypes a GEMM is priced in: fp32 on the plain (non-tensor-core) units, tf32, bf16
and fp16 on the tensor cores (fp32 accumulate)."""


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s of one device per compute dtype (`DTYPES`), as data sheets give them
    (no sparsity). `fp32` is the plain rate; `tf32`, `bf16`, `fp16` the tensor-core rates.
    None: the device has no tensor-core path for that dtype and, as the hardware does, runs such
    a GEMM at its fp32 rate (V100: Volta's tensor cores take fp16 only, so tf32 and bf16 are
    priced at the fp32 peak)."""

    fp32: float
    tf32: float | None = None
    bf16: float | None = None
    fp16: float | None = None

    def __post_init__(self) -> None:
        for name in DTYPES:
            value = getattr(self, name)
            if value is None and name != "fp32":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(
                    f"must be a number, got {value!r}", source="device", field=f"peak_flops.{name}"
                )
            if not np.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"must be > 0, got {value!r}", source="device", field=f"peak_flops.{name}"
                )

    @classmethod
    def uniform(cls, flops: float) -> PeakFlops:
        """One rate for every dtype (a measured rate, as `poise calibrate` writes)."""
        return cls(flops, flops, flops, flops)

    def of(self, dtype: str) -> float:
        """The peak for `dtype`; the fp32 peak where the device has no tensor-core path."""
        if dtype not in DTYPES:
            raise ConfigError(
                f"unknown compute dtype {dtype!r} (known: {', '.join(DTYPES)})",
                field="compute_dtype",
            )
        value = getattr(self, dtype)
        return float(self.fp32 if value is None else value)

    def to_dict(self) -> dict[str, float]:
        """The dtypes that are set (None left out)."""
        return {k: float(getattr(self, k)) for k in DTYPES if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, data: Any, source: str, prefix: str) -> PeakFlops:
        if not isinstance(data, dict):
            raise ConfigError(
                f"must be a mapping of {', '.join(DTYPES)} to FLOP/s, got {type(data).__name__}",
                source=source,
                field=prefix.rstrip("."),
            )
        reject_unknown(data, set(DTYPES), source, prefix)
        values: dict[str, float | None] = {
            "fp32": get_number(data, "fp32", source, within=PEAK_FLOPS, prefix=prefix)
        }
        for name in DTYPES[1:]:  # absent or null: no tensor-core path, the fp32 rate
            values[name] = (
                None
                if data.get(name) is None
                else get_number(data, name, source, within=PEAK_FLOPS, prefix=prefix)
            )
        return cls(**values)  # type: ignore[arg-type]


# What a cluster file's physical figures can mean; a value outside passes as a positive number
# but overflows the step times later (1e-300 B/s gives infinite tables).
# 1 kB/s (a 1 MB expert would take 1,000 s to move) to 1 PB/s (over 500x NVLink 5's 1.8 TB/s
# per GPU, NVIDIA's Blackwell data sheet):
LINK_BW_BPS = (1e3, 1e15)
# 0 to 10 s a message (a geostationary satellite hop is about 0.25 s one way):
LINK_LAT_S = (0.0, 10.0)
# 1 MFLOP/s to 10 EFLOP/s per device (over 4,000x a B200's 2.25 PFLOP/s dense bf16):
PEAK_FLOPS = (1e6, 1e19)


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
    "transfer_scale",
    "shared_cores",
)
# fields that must be > 0 (the others >= 0), and those whose default is not 0
_POSITIVE_HOST = ("dense_fwd_flops", "dense_bwd_flops", "allreduce_bw_Bps", "transfer_scale")
_HOST_DEFAULTS = {"transfer_scale": 1.0}
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
      `dense_fwd_flops=None`: the large-GEMM rate in the model's compute dtype
      (`Cluster.gemm_flops`) with no small-batch loss (the cost model's FNEC);
      `dense_bwd_flops=None`: the forward's rate and half tokens (BNEC = 2 FNEC);
    - the token dispatcher's host work per MoE layer (sorting, permuting and packing rows,
      the counts exchange) beyond its all-to-alls' link time: `dispatch_fwd_s +
      dispatch_fwd_s_per_row * rows` forward and likewise backward, rows = rows a device sends
      plus rows it receives;
    - per step: the optimizer step `optimizer_s + optimizer_s_per_param * params` and the
      gradient norm and clipping `clip_s + clip_s_per_param * params` over a device's
      parameters; the dense gradients' all-reduce `allreduce_lat_s + bytes /
      allreduce_bw_Bps` (measured between the devices), or with None the hierarchical
      all-reduce on the cluster's links (`poise.cost.collectives.hierarchical_allreduce_s`);
    - bulk expert transfers (Trans, Agg, migration) take `transfer_scale` times their link
      time: the packing and copying of expert rows beyond the wire, which on CPU ranks over
      gloo dominates (the live Balancer fits it, `poise.runtime.selfcal.fit`); the token
      all-to-all's extra is `dispatch_*` instead;
    - `shared_cores` (0: off): the devices are processes that share this many cores' worth of
      compute (CPU ranks on one host, more ranks x threads than cores). A rank that waits then
      leaves its core to the others, so a layer's expert compute takes the slowest device's
      seconds or the devices' total over `shared_cores`, whichever is longer, instead of the
      slowest device's alone (`poise.cost.model.PlanPricer.phases`); the dispatcher's host
      work likewise (`poise.cost.host.busiest_sharing`)."""

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
    transfer_scale: float = 1.0
    shared_cores: float = 0.0

    def __post_init__(self) -> None:
        for name in HOST_FIELDS:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_HOST_FIELDS:
                continue
            positive = name in _POSITIVE_HOST
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
        return self == NO_HOST_COSTS

    def to_dict(self) -> dict[str, float]:
        """The fields that are set (None left out)."""
        return {k: getattr(self, k) for k in HOST_FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> HostCosts:
        reject_unknown(data, set(HOST_FIELDS), source, "host.")
        kwargs: dict[str, Any] = {}
        for name in HOST_FIELDS:
            positive = name in _POSITIVE_HOST
            default = None if name in OPTIONAL_HOST_FIELDS else _HOST_DEFAULTS.get(name, 0.0)
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


NO_HOST_COSTS = HostCosts()  # a cluster without measured host costs (`is_default`)


@dataclass(frozen=True)
class Cluster:
    """`devices_per_node` x `nodes_per_domain` x `domains` devices, numbered node-major:
    device d sits in node d // devices_per_node and domain d // (devices_per_node *
    nodes_per_domain).

    A device's GEMM over n rows in compute dtype t (`DTYPES`) runs at

        rate(n, t) = peak_flops[t] * gemm_efficiency * n / (n + gemm_half_rows)   FLOP/s

    `peak_flops`: the dense peak per dtype (`PeakFlops`; a plain number means that rate for
    every dtype, e.g. one measured by `poise calibrate`); `gemm_efficiency`: the fraction of the
    peak large GEMMs reach (in (0, 1]); `gemm_half_rows`: the row count at which a GEMM reaches
    half of that (0: no small-batch loss). `host`: the measured host-side costs (`HostCosts`;
    default: none).

    `expert_call_floor_s` (seconds, >= 0; 0: none): the least time of one device's expert
    forward + backward call in one MoE layer once it computes at least one row, whatever its
    GEMMs' rate gives; the cost model splits it 1:2 between forward and backward, as it does
    the GEMMs (FEC_d >= floor / 3, BEC_d >= 2 floor / 3; `poise.cost.model.expert_call_floor`).
    Measured on an H100 as the flat time of `poise.nn.Experts` at few rows a slot
    (docs/benchmarks.md, "Expert compute on an H100": the GPU waits for the host issuing
    kernels).
    """

    name: str
    devices_per_node: int
    nodes_per_domain: int
    domains: int
    peak_flops: PeakFlops
    memory_bytes: float
    intra_node: Link
    inter_node: Link
    inter_domain: Link
    gemm_half_rows: float = 0.0
    host: HostCosts = HostCosts()
    gemm_efficiency: float = 1.0
    expert_call_floor_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "nodes_per_domain", "domains"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"must be >= 1, got {getattr(self, name)}", source=self.name, field=name
                )
        peaks = self.peak_flops
        if not isinstance(peaks, PeakFlops):
            if isinstance(peaks, bool) or not isinstance(peaks, (int, float)):
                raise ConfigError(
                    f"must be a PeakFlops or a number, got {peaks!r}",
                    source=self.name,
                    field="device.peak_flops",
                )
            if not np.isfinite(peaks) or peaks <= 0:
                raise ConfigError(
                    f"must be > 0, got {peaks!r}", source=self.name, field="device.peak_flops"
                )
            object.__setattr__(self, "peak_flops", PeakFlops.uniform(float(peaks)))
        if not np.isfinite(self.memory_bytes) or self.memory_bytes <= 0:
            raise ConfigError(
                f"must be > 0, got {self.memory_bytes!r}",
                source=self.name,
                field="device.memory_bytes",
            )
        eff = self.gemm_efficiency
        if not (np.isfinite(eff) and 0 < eff <= 1):
            raise ConfigError(
                f"must be in (0, 1], got {eff!r}", source=self.name, field="device.gemm_efficiency"
            )
        if not np.isfinite(self.gemm_half_rows) or self.gemm_half_rows < 0:
            raise ConfigError(
                f"must be >= 0, got {self.gemm_half_rows!r}",
                source=self.name,
                field="device.gemm_half_rows",
            )
        floor = self.expert_call_floor_s
        if isinstance(floor, bool) or not isinstance(floor, (int, float)):
            raise ConfigError(
                f"must be a number, got {floor!r}",
                source=self.name,
                field="device.expert_call_floor_s",
            )
        if not np.isfinite(floor) or floor < 0:
            raise ConfigError(
                f"must be finite and >= 0, got {floor!r}",
                source=self.name,
                field="device.expert_call_floor_s",
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

    def gemm_flops(self, dtype: str) -> float:
        """FLOP/s large GEMMs reach in compute dtype `dtype`: peak_flops[dtype] *
        gemm_efficiency (the fp32 peak where the device has no tensor-core path for it)."""
        return self.peak_flops.of(dtype) * self.gemm_efficiency

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

    def gemm_rate(self, rows: np.ndarray | float, dtype: str) -> np.ndarray:
        """Achieved FLOP/s for a GEMM over `rows` token rows in compute dtype `dtype`:
        peak_flops[dtype] * gemm_efficiency * rows / (rows + gemm_half_rows)."""
        rows = np.asarray(rows, dtype=np.float64)
        flops = self.gemm_flops(dtype)
        if self.gemm_half_rows <= 0:
            return np.full_like(rows, flops)
        return flops * rows / (rows + self.gemm_half_rows)

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
                "peak_flops": self.peak_flops.to_dict(),
                "gemm_efficiency": self.gemm_efficiency,
                "gemm_half_rows": self.gemm_half_rows,
                "memory_bytes": self.memory_bytes,
                # written where set: a file without it has no floor (nothing measured)
                **(
                    {"expert_call_floor_s": self.expert_call_floor_s}
                    if self.expert_call_floor_s
                    else {}
                ),
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
        reject_unknown(
            device,
            {
                "peak_flops",
                "gemm_efficiency",
                "gemm_flops",
                "memory_bytes",
                "gemm_half_rows",
                "expert_call_floor_s",
            },
            source,
            "device.",
        )
        peaks = _device_peaks(device, source)
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
                bw_Bps=get_number(raw, "bw_Bps", source, within=LINK_BW_BPS, prefix=prefix),
                lat_s=get_number(raw, "lat_s", source, within=LINK_LAT_S, prefix=prefix),
                shared_by=get_int(raw, "shared_by", source, default=1, minimum=1, prefix=prefix),
            )
            previous = links[level]
        host = HostCosts()
        if "host" in data:
            host = HostCosts.from_dict(get_mapping(data, "host", source), source)
        try:
            return cls._built(data, source, dpn, npd, domains, peaks, host, links)
        except ConfigError as exc:  # the whole-cluster checks name the file, not the cluster
            raise ConfigError(exc.message, source=source, field=exc.field) from None

    @classmethod
    def _built(
        cls,
        data: dict[str, Any],
        source: str,
        dpn: int,
        npd: int,
        domains: int,
        peaks: PeakFlops,
        host: HostCosts,
        links: dict[str, Link],
    ) -> Cluster:
        """`from_dict`'s cluster from its checked parts (`Cluster.__post_init__` checks the
        whole)."""
        device = get_mapping(data, "device", source)
        return cls(
            name=get_str(data, "name", source, default=Path(source).stem),
            devices_per_node=dpn,
            nodes_per_domain=npd,
            domains=domains,
            peak_flops=peaks,
            gemm_efficiency=_efficiency(device, source),
            memory_bytes=get_number(
                device, "memory_bytes", source, positive=True, prefix="device."
            ),
            gemm_half_rows=get_number(
                device, "gemm_half_rows", source, default=0.0, non_negative=True, prefix="device."
            ),
            expert_call_floor_s=get_number(
                device,
                "expert_call_floor_s",
                source,
                default=0.0,
                non_negative=True,
                prefix="device.",
            ),
            host=host,
            **links,
        )

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        return cls.from_dict(read_mapping_file(path), str(path))


def _device_peaks(device: Any, source: str) -> PeakFlops:
    """`device.peak_flops` (per dtype), or the older `device.gemm_flops`: one rate (what `poise
    calibrate` measured) for every dtype. Exactly one of the two."""
    if "peak_flops" in device and "gemm_flops" in device:
        raise ConfigError(
            "give peak_flops (per dtype) or gemm_flops (one rate for every dtype), not both",
            source=source,
            field="device.gemm_flops",
        )
    if "gemm_flops" in device:
        return PeakFlops.uniform(
            get_number(device, "gemm_flops", source, within=PEAK_FLOPS, prefix="device.")
        )
    if "peak_flops" not in device:
        raise ConfigError(
            "missing required field (or the older one-rate gemm_flops)",
            source=source,
            field="device.peak_flops",
        )
    return PeakFlops.from_dict(device["peak_flops"], source, "device.peak_flops.")


def _efficiency(device: Any, source: str) -> float:
    value = get_number(
        device, "gemm_efficiency", source, default=1.0, positive=True, prefix="device."
    )
    if value > 1:
        raise ConfigError(
            f"must be in (0, 1], got {value!r}", source=source, field="device.gemm_efficiency"
        )
    return value
