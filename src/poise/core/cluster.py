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
that (`Cluster.gemm_rate`). Every figure of the presets (`PRESETS`) is cited beside it; where no
source was found the comment says what was assumed.
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
            "fp32": get_number(data, "fp32", source, positive=True, prefix=prefix)
        }
        for name in DTYPES[1:]:  # absent or null: no tensor-core path, the fp32 rate
            values[name] = (
                None
                if data.get(name) is None
                else get_number(data, name, source, positive=True, prefix=prefix)
            )
        return cls(**values)  # type: ignore[arg-type]


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

    A device's GEMM over n rows in compute dtype t (`DTYPES`) runs at

        rate(n, t) = peak_flops[t] * gemm_efficiency * n / (n + gemm_half_rows)   FLOP/s

    `peak_flops`: the dense peak per dtype (`PeakFlops`; a plain number means that rate for
    every dtype, e.g. one measured by `poise calibrate`); `gemm_efficiency`: the fraction of the
    peak large GEMMs reach (in (0, 1]); `gemm_half_rows`: the row count at which a GEMM reaches
    half of that (0: no small-batch loss). `host`: the measured host-side costs (`HostCosts`;
    default: none).
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
            {"peak_flops", "gemm_efficiency", "gemm_flops", "memory_bytes", "gemm_half_rows"},
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
            peak_flops=peaks,
            gemm_efficiency=_efficiency(device, source),
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
            get_number(device, "gemm_flops", source, positive=True, prefix="device.")
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


def _uniform(
    name: str,
    dpn: int,
    npd: int,
    domains: int,
    peaks: PeakFlops,
    efficiency: float,
    half_rows: float,
    mem: float,
    intra: Link,
    inter: Link,
    wan: Link | None = None,
) -> Cluster:
    return Cluster(
        name=name,
        devices_per_node=dpn,
        nodes_per_domain=npd,
        domains=domains,
        peak_flops=peaks,
        memory_bytes=mem,
        intra_node=intra,
        inter_node=inter,
        inter_domain=wan or inter,
        gemm_half_rows=half_rows,
        gemm_efficiency=efficiency,
    )


TFLOPS = 1e12
GB = 1e9

# Dense peaks per dtype (TFLOP/s, no sparsity), each from the source named beside it. None: no
# tensor-core path, the fp32 rate applies (`PeakFlops`).
# V100-PCIe: NVIDIA V100 data sheet, PCIe column (FP32 14, Tensor 112). Volta's tensor cores
# take fp16 only: no tf32 or bf16 rate (the A100 whitepaper's comparison table lists none).
V100_PCIE = PeakFlops(fp32=14.0 * TFLOPS, fp16=112.0 * TFLOPS)
# V100-SXM2: NVIDIA A100 whitepaper, comparison table, V100 SXM2 column at 1530 MHz boost
# (FP32 15.7, FP16 tensor 125 with fp16 or fp32 accumulate).
V100_SXM2 = PeakFlops(fp32=15.7 * TFLOPS, fp16=125.0 * TFLOPS)
# RTX 3090: NVIDIA GA102 whitepaper v1, Appendix A (FP32 35.6; "Peak FP16 Tensor TFLOPS with
# FP32 Accumulate" 71, the rate mixed-precision training uses). bf16 is assumed at that fp16
# rate (the quotes we read name fp16 only). The tf32
# tensor rate was not found in our sources: assumed no faster than fp32 (None).
RTX3090 = PeakFlops(fp32=35.6 * TFLOPS, bf16=71.0 * TFLOPS, fp16=71.0 * TFLOPS)
# A100 SXM 80 GB: NVIDIA A100 data sheet (FP32 19.5, TF32 156, BF16 and FP16 312, dense). The
# A800 differs from the A100 only in NVLink (400 instead of 600 GB/s; Reuters, Nov 2022).
A100 = PeakFlops(fp32=19.5 * TFLOPS, tf32=156.0 * TFLOPS, bf16=312.0 * TFLOPS, fp16=312.0 * TFLOPS)
# H100 SXM: NVIDIA H100 data sheet and whitepaper (FP32 66.9, TF32 494.7, BF16 and FP16 989.4
# dense; the data sheet's 989 and 1979 are with sparsity), as tabulated on
# glennklockwood.com/garden/processors/h100.
H100_SXM = PeakFlops(
    fp32=66.9 * TFLOPS, tf32=494.7 * TFLOPS, bf16=989.4 * TFLOPS, fp16=989.4 * TFLOPS
)

# The fraction of the peak large GEMMs reach (one figure per GPU, applied to every dtype):
# V100, fp32: FasterMoE (He et al., PPoPP'22) §3.1 and §5.3: GEMMs at transformer sizes reach
# "more than 90% of its peak throughput"; its predictor uses 90%.
V100_EFF = 0.90
# A100 SXM, bf16: stas00/ml-engineering, compute/accelerator/README.md, maximum achievable matmul
# FLOPS table: 271.2 of 312 TFLOP/s (best shape 1024x10240x5120, torch 2.6.0+cu126).
A100_EFF = 271.2 / 312.0
# H100 SXM, bf16: the same table: 794.5 of 989 TFLOP/s (best shape 2048x2048x13312, torch 2.7.0).
H100_EFF = 794.5 / 989.0
# RTX 3090: no published fraction found. Assumed FasterMoE's 90% for V100 fp32 GEMMs, since
# Pro-Prophet trains in fp32 on FasterMoE's code (its own planner assumes 100%: Comp_tp =
# 35.7e12 in king0722/Pro-Prophet load-balancing/search_algorithm.py).
RTX3090_EFF = 0.90

# The small-GEMM curve (`gemm_half_rows`): no published figure was found for any of these GPUs.
# Assumed 256 rows (V100, RTX 3090, A800) and 512 (H100, whose higher peak needs bigger tiles to
# fill), the values this project has used throughout; `poise calibrate` fits it on this machine.
HALF_ROWS = 256.0
HALF_ROWS_H100 = 512.0

# Link latencies: none of the papers gives one. Assumed: 10 us per message over PCIe and
# Ethernet within a datacentre, 5 us over InfiniBand, 3 us over NVLink, and 20 ms between
# datacentres (see cross-dc-1000).
LAT_PCIE = 10e-6
LAT_IB = 5e-6
LAT_NVLINK = 3e-6


def _presets() -> dict[str, Cluster]:
    return {
        # Two local processes on this kind of machine. These round figures are not a
        # measurement: `poise calibrate` on 2026-11-22, idle, gave 206.2 GFLOP/s (fp32, half rows
        # 39.6) and an all-to-all of 1.68 GB/s, 145 us (docs/benchmarks.md, "Calibration"). They
        # are kept because the 2-rank training tests (tests/test_train_faults.py) need plans with
        # replicas on the tiny model, which the measured figures no longer give; priced at one
        # rate for every dtype, as a calibrated file is. Memory: 8 GiB per process, assumed.
        "cpu-2": _uniform(
            "cpu-2",
            2,
            1,
            1,
            PeakFlops.uniform(5e10),
            1.0,
            16.0,
            8 * GIB,
            Link(4e9, 30e-6),
            Link(4e9, 30e-6),
        ),
        # FasterMoE "johnny" (§5.1): 2 nodes x 8 V100-PCIe (32 GB, the larger of the data
        # sheet's two sizes: the paper does not say which). Intra-node PCIe 3.0: 11 GB/s per
        # direction, the rate FasterMoE's artifact measured and its predictor uses (fastermoe-ae
        # toposim/devices.py bw_pcie = 88e9/8; the x16 theoretical is 15.75 GB/s). One IB EDR
        # NIC per node, run at only 50 Gb/s for lack of a x16 slot (§5.1; also the default
        # FMOE_FASTER_GLBPLC_NETBW of fastmoe's shadow_policy.py), shared by the node's 8 GPUs.
        "v100-ib50": _uniform(
            "v100-ib50",
            8,
            2,
            1,
            V100_PCIE,
            V100_EFF,
            HALF_ROWS,
            32 * GIB,
            Link(88 * GBIT, LAT_PCIE),
            Link(50 * GBIT, LAT_IB, shared_by=8),
        ),
        # FasterMoE "trevor" (§5.1): 16 nodes x 4 V100-SXM2 (memory assumed 32 GB as above) in an
        # NVLink ring, half the edges double links; one IB EDR NIC per node at 100 Gb/s (the
        # artifact's predictor measured 62 Gb/s: bw_net = 62e9/8), shared by 4 GPUs. The link
        # model has one intra-node rate per device; derived from the artifact's measured pair
        # rates (toposim/devices.py create_nvlink_cluster: single link 171, double 317, other
        # pairs 88 Gb/s): in an all-to-all a GPU sends a third of its bytes to each of its 3
        # peers at once and the slowest pair (88 Gb/s, 11 GB/s: the diagonal, no NVLink)
        # bounds it, so 3 x 11 = 33 GB/s per device.
        "v100-nvlink-ib100": _uniform(
            "v100-nvlink-ib100",
            4,
            16,
            1,
            V100_SXM2,
            V100_EFF,
            HALF_ROWS,
            32 * GIB,
            Link(3 * 88 * GBIT, LAT_NVLINK),
            Link(100 * GBIT, LAT_IB, shared_by=4),
        ),
        # Pro-Prophet (arXiv 2411.10003 §VI Testbed) HPWNV/HPNV: nodes of 4 RTX 3090 24 GB on
        # PCIe 3.0 (each CPU attached to 2 GPUs), 100 Gb/s InfiniBand; 4 nodes (also :8). One NIC
        # per node is assumed (the count is not stated). Intra-node: the PCIe 3.0 rate measured
        # on FasterMoE's johnny (11 GB/s, above), assumed the same here. Table IV's HPNV nodes
        # also join GPU pairs by an NVLink bridge (GA102: 56.25 GB/s per direction); the link
        # model has one intra-node rate per device, so the pairs are not modelled: all
        # intra-node traffic is priced at the PCIe rate (2 of each GPU's 3 peers are on PCIe).
        "rtx3090-ib100": _uniform(
            "rtx3090-ib100",
            4,
            4,
            1,
            RTX3090,
            RTX3090_EFF,
            HALF_ROWS,
            24 * GIB,
            Link(88 * GBIT, LAT_PCIE),
            Link(100 * GBIT, LAT_IB, shared_by=4),
        ),
        # HybridEP (arXiv 2510.19470 §V-A): nodes of 8 A800 (80 GB assumed: the variant is not
        # stated), PCIe 3.0 x16 inside at 128 Gb/s as the paper quotes it, 10 Gb/s Ethernet
        # between; one node stands in for one datacentre, so each node is a domain (the
        # low-bandwidth boundary HybridEP partitions on); 2 nodes (also :4). One Ethernet link
        # per node, shared by its 8 GPUs, and 100 us per message between them: assumed.
        "a800-eth10": _uniform(
            "a800-eth10",
            8,
            1,
            2,
            A100,
            A100_EFF,
            HALF_ROWS,
            80 * GIB,
            Link(128 * GBIT, LAT_PCIE),
            Link(128 * GBIT, LAT_PCIE),
            Link(10 * GBIT, 100e-6, shared_by=8),
        ),
        # DGX H100: 8 H100 SXM 80 GB on NVLink 4 (900 GB/s bidirectional, 450 per direction: H100
        # data sheet); 8 ConnectX-7 NICs, one per GPU (NVIDIA DGX H100 User Guide §1.2.3, Table
        # 6), each InfiniBand NDR 400 Gb/s (4 lanes x 100 Gb/s).
        "dgx-h100": _uniform(
            "dgx-h100",
            8,
            8,
            1,
            H100_SXM,
            H100_EFF,
            HALF_ROWS_H100,
            80 * GIB,
            Link(450 * GB, LAT_NVLINK),
            Link(400 * GBIT, LAT_IB),
        ),
        # HybridEP's large-scale setting (§V-G): 1,000 datacentres simulated with SimAI. The
        # GPUs, the wide-area bandwidths (only in Fig. 17) and latency are not in the paper's
        # text. Assumed: one DGX H100 node per datacentre (as above); 10 Gb/s per node between
        # datacentres, the inter-DC rate of HybridEP's own testbed (§V-A), shared by its 8 GPUs;
        # 20 ms per message (no source; the value this preset has always had).
        "cross-dc-1000": _uniform(
            "cross-dc-1000",
            8,
            1,
            1000,
            H100_SXM,
            H100_EFF,
            HALF_ROWS_H100,
            80 * GIB,
            Link(450 * GB, LAT_NVLINK),
            Link(400 * GBIT, LAT_IB),
            Link(10 * GBIT, 20e-3, shared_by=8),
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
