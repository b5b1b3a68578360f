"""Assembling a calibration: fits, host facts, checks, and the cluster YAML + JSON written."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from poise.calibrate.config import WORLD_SIZE, CalibrationConfig, CalibrationError
from poise.calibrate.fit import GemmFit, LinkFit, fit_gemm_curve, fit_latency_bandwidth
from poise.calibrate.host_fit import HostFit, HostPoint, fit_host, has_host_points
from poise.calibrate.measure import GROUP_COLLECTIVES, LINK_COLLECTIVES, CommPoint, GemmPoint
from poise.core.cluster import Cluster, HostCosts, PeakFlops
from poise.core.errors import ConfigError
from poise.core.fields import read_mapping_file
from poise.core.outputs import check_output_file
from poise.cost.collectives import CollectiveFit, alpha_beta_from_link_fit
from poise.util.atomic import atomic_write_text

KIB = 1024
MIB = 1024 * KIB


# ------------------------------------------------------------------------------------- assembling
@dataclass
class Calibration:
    """Measurements and fits of one run. `gemm` is the forward+backward fit the cluster uses
    (the cost model prices backward as twice forward, so one curve must serve both);
    `host_fit` the host costs' fits (`poise.calibrate.host`; None when not measured)."""

    config: CalibrationConfig
    gemm_points: list[GemmPoint]
    comm_points: list[CommPoint]
    gemm_fits: dict[str, GemmFit] = field(default_factory=dict)
    link_fits: dict[str, LinkFit] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)
    group_fits: dict[str, LinkFit] = field(default_factory=dict)  # all_gather, reduce_scatter
    host_points: list[HostPoint] = field(default_factory=list)
    host_fit: HostFit | None = None

    @property
    def gemm(self) -> GemmFit:
        """The GEMM curve the cluster file gets: the named model's own experts when measured
        (`gemm_fits["model_experts"]`), else the expert FFN's forward+backward fit."""
        return self.gemm_fits.get("model_experts", self.gemm_fits["forward+backward"])

    @property
    def intra_node(self) -> LinkFit:
        return self.link_fits["all_to_all"]

    def cluster(self, name: str | None = None, memory_bytes: float | None = None) -> Cluster:
        """2 devices on one node; GEMM curve from `gemm` (measured on the fp32 expert FFN and
        written as one rate for every dtype: this machine has no faster path for the others),
        intra-node link from the all-to-all,
        memory half of this machine's RAM, the host costs of `host_fit` (if measured)."""
        link = self.intra_node.link()
        return Cluster(
            name=name or f"calibrated-{self.host.get('hostname') or socket.gethostname()}",
            devices_per_node=WORLD_SIZE,
            nodes_per_domain=1,
            domains=1,
            peak_flops=PeakFlops.uniform(self.gemm.gemm_flops),
            memory_bytes=memory_bytes or machine_memory_bytes() / WORLD_SIZE,
            intra_node=link,
            inter_node=link,
            inter_domain=link,
            gemm_half_rows=self.gemm.half_rows,
            host=self.host_fit.costs() if self.host_fit is not None else HostCosts(),
        )

    def collective_fit(self) -> CollectiveFit:
        """Every fitted collective as alpha-beta parameters at the intra-node level of a
        `WORLD_SIZE`-rank node (`poise.cost.collectives.alpha_beta_from_link_fit`), the form Parm's
        schedule choice (`poise.layouts.parm.choose_schedule`) reads; fill the levels this machine
        cannot measure with `CollectiveFit.filled_from(cluster)`."""
        fits = {**self.link_fits, **self.group_fits}
        params = {
            (c, "intra_node"): alpha_beta_from_link_fit(c, f.lat_s, f.bw_Bps, WORLD_SIZE)
            for c, f in fits.items()
        }
        name = f"calibrated-{self.host.get('hostname') or socket.gethostname()}"
        return CollectiveFit(params, WORLD_SIZE, WORLD_SIZE, name)

    def to_dict(self) -> dict[str, Any]:
        link = [p for p in self.comm_points if p.collective in LINK_COLLECTIVES]
        group = [p for p in self.comm_points if p.collective not in LINK_COLLECTIVES]
        return {
            "host": self.host,
            "config": asdict(self.config),
            "gemm": [dict(asdict(p), rate_flops=p.rate) for p in self.gemm_points],
            "collectives": [dict(asdict(p), bw_Bps=p.bw_Bps) for p in link],
            "gemm_fits": {k: asdict(v) for k, v in self.gemm_fits.items()},
            "link_fits": {k: asdict(v) for k, v in self.link_fits.items()},
            "group_collectives": [dict(asdict(p), bw_Bps=p.bw_Bps) for p in group],
            "group_fits": {k: asdict(v) for k, v in self.group_fits.items()},
            "collective_fit": self.collective_fit().to_dict(),
            "host_costs": [asdict(p) for p in self.host_points],
            "host_fits": {}
            if self.host_fit is None
            else {
                k: asdict(getattr(self.host_fit, k))
                for k in (f.name for f in fields(self.host_fit))
            },
        }


def fit_all(
    config: CalibrationConfig,
    gemm_points: list[GemmPoint],
    comm_points: list[CommPoint],
    host: dict[str, Any] | None = None,
    host_points: list[HostPoint] | None = None,
) -> Calibration:
    """GEMM fits per phase and for forward+backward summed per row count; a link fit per
    collective (`link_fits`: all-to-all and all-reduce; `group_fits`: all-gather and
    reduce-scatter, those measured); the host costs' fits from `host_points` when given
    (`poise.calibrate.host_fit.fit_host`)."""
    gemm_fits = {}
    for phase in ("forward", "backward"):
        pts = [p for p in gemm_points if p.phase == phase]
        gemm_fits[phase] = fit_gemm_curve(
            [p.rows for p in pts], [p.seconds for p in pts], [p.flops for p in pts]
        )
    rows = sorted({p.rows for p in gemm_points})
    total_s = [sum(p.seconds for p in gemm_points if p.rows == n) for n in rows]
    total_flops = [sum(p.flops for p in gemm_points if p.rows == n) for n in rows]
    gemm_fits["forward+backward"] = fit_gemm_curve(rows, total_s, total_flops)
    link_fits = {}
    for collective in ("all_to_all", "all_reduce"):
        pts = [p for p in comm_points if p.collective == collective]
        link_fits[collective] = fit_latency_bandwidth(
            [p.nbytes for p in pts], [p.seconds for p in pts], f"{collective} link fit"
        )
    group_fits = {}
    for collective in GROUP_COLLECTIVES:
        pts = [p for p in comm_points if p.collective == collective]
        if pts:
            group_fits[collective] = fit_latency_bandwidth(
                [p.nbytes for p in pts], [p.seconds for p in pts], f"{collective} link fit"
            )
    host_fit = None
    if host_points and has_host_points(host_points):
        host_fit = fit_host(host_points, link_fits["all_to_all"], link_fits["all_reduce"])
        if config.model is not None and host_fit.experts is not None:
            gemm_fits["model_experts"] = host_fit.experts
    return Calibration(
        config,
        gemm_points,
        comm_points,
        gemm_fits,
        link_fits,
        host or {},
        group_fits,
        list(host_points or []),
        host_fit,
    )


def load_collective_fit(path: str | Path) -> CollectiveFit:
    """The `CollectiveFit` of a calibration: from its measurements JSON, or from the cluster
    YAML it sits beside (`measurements_path`)."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        path = measurements_path(path)
    data = read_mapping_file(path)
    if "collective_fit" not in data:
        raise ConfigError(
            "no collective fit (written by an older poise calibrate: run it again)",
            source=str(path),
            field="collective_fit",
        )
    return CollectiveFit.from_dict(data["collective_fit"], str(path))


def host_info(config: CalibrationConfig) -> dict[str, Any]:
    import torch

    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "gemm_threads": config.threads or torch.get_num_threads(),
        "memory_bytes": machine_memory_bytes(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "created_unix_s": time.time(),
    }


def busy_warning(interval_s: float = 0.3) -> str | None:
    """A warning when other work keeps this machine's cores busy (more than a quarter of all
    cores over `interval_s`, from /proc/stat): calibration would then measure a share of it."""
    busy = cpu_busy_fraction(interval_s)
    if busy is None or busy <= 0.25:
        return None
    return (
        f"{busy:.0%} of this machine's {os.cpu_count()} cores are busy with other work: "
        "measurements will be low; calibrate on an idle machine for figures the simulator can trust"
    )


def cpu_busy_fraction(interval_s: float) -> float | None:
    """Fraction of all cores' time not idle over `interval_s` (Linux /proc/stat; None
    elsewhere)."""

    def read() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return idle, sum(fields)

    try:
        idle0, total0 = read()
        time.sleep(interval_s)
        idle1, total1 = read()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return 1.0 - (idle1 - idle0) / (total1 - total0)


def machine_memory_bytes() -> float:
    """Physical RAM in bytes: sysconf, else /proc/meminfo's MemTotal."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page = os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page > 0:
            return float(pages * page)
    except (ValueError, OSError, AttributeError):
        pass
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    raise CalibrationError("cannot read this machine's memory size", source="calibrate")


def check_output(path: str | Path) -> Path:
    """The cluster YAML path: must end in .yaml/.yml (so `get_cluster` reads it as a file) and
    it and the measurements JSON beside it must be writable (`poise.core.outputs`); else
    `ConfigError` naming `--out`, before any measuring."""
    path = check_output_file(path, "--out", suffixes=(".yaml", ".yml"))
    check_output_file(measurements_path(path), "--out")
    return path


def check_memory(config: CalibrationConfig) -> None:
    """Refuse GEMM sizes whose buffers (`config.gemm_bytes()`) exceed half of this machine's
    RAM."""
    need, have = config.gemm_bytes(), machine_memory_bytes()
    if need > have / 2:
        raise ConfigError(
            f"the GEMM benchmark needs {need / 2**30:.1f} GiB, more than half of this "
            f"machine's {have / 2**30:.1f} GiB; use smaller --d-model / --d-expert",
            source="calibrate",
            field="d_model",
        )


def measurements_path(yaml_path: str | Path) -> Path:
    """`x/calibrated.yaml` -> `x/calibrated.measurements.json`."""
    p = Path(yaml_path)
    return p.with_name(f"{p.stem}.measurements.json")


def write_outputs(calibration: Calibration, yaml_path: str | Path) -> tuple[Cluster, Path]:
    """Save the cluster YAML and the measurements JSON next to it (both atomically)."""
    cluster = calibration.cluster()
    cluster.save(yaml_path)
    json_path = measurements_path(yaml_path)
    data = calibration.to_dict()
    data["cluster"] = cluster.to_dict()
    atomic_write_text(json_path, json.dumps(data, indent=2) + "\n")
    return cluster, json_path
