"""Fitting the host costs of `topology.HostCosts` from measured points (`HostPoint`): pure
Python and NumPy (`calibrate.fit`), no torch. The measurements and what each fit means are
described in `poise.calibrate.host`, which takes the points."""

from __future__ import annotations

from dataclasses import dataclass

from poise.calibrate.fit import GemmFit, LineFit, LinkFit, fit_gemm_curve, fit_line
from poise.core.cluster import HostCosts

KINDS_LOCAL = ("dense_fwd", "dense_bwd", "block_fwd", "block_bwd", "head_fwd", "head_bwd")
KINDS_STEP = ("optimizer", "clip")
KINDS_DISPATCH = ("dispatch_fwd", "dispatch_bwd")
KINDS_EXPERTS = ("experts_fwd", "experts_bwd")
HOST_FLOOR = 0.01  # dispatcher time beyond the modelled links is kept >= 1% of the measured


@dataclass(frozen=True)
class HostPoint:
    """One host timing (median seconds): `kind` one of `KINDS_*`, `size` tokens (dense, block,
    head), rows a rank routes, T k (dispatch) or parameters (optimizer, clip); `flops` of the timed
    work (dense points); `nbytes` each rank sent to the other rank in each token all-to-all
    (dispatch points)."""

    kind: str
    size: int
    seconds: float
    flops: float = 0.0
    nbytes: float = 0.0


@dataclass(frozen=True)
class HostFit:
    """The fits of the module docstring; `costs()` the cluster's `HostCosts`, `experts` the
    model's experts' GEMM curve (forward + backward; None when not measured)."""

    dense_fwd: GemmFit
    dense_bwd: GemmFit
    dispatch_fwd: LineFit
    dispatch_bwd: LineFit
    optimizer: LineFit
    clip: LineFit
    allreduce: LinkFit
    experts: GemmFit | None = None

    def costs(self) -> HostCosts:
        return HostCosts(
            dense_fwd_flops=self.dense_fwd.gemm_flops,
            dense_fwd_half_tokens=self.dense_fwd.half_rows,
            dense_bwd_flops=self.dense_bwd.gemm_flops,
            dense_bwd_half_tokens=self.dense_bwd.half_rows,
            dispatch_fwd_s=self.dispatch_fwd.intercept_s,
            dispatch_fwd_s_per_row=self.dispatch_fwd.slope_s,
            dispatch_bwd_s=self.dispatch_bwd.intercept_s,
            dispatch_bwd_s_per_row=self.dispatch_bwd.slope_s,
            optimizer_s=self.optimizer.intercept_s,
            optimizer_s_per_param=self.optimizer.slope_s,
            clip_s=self.clip.intercept_s,
            clip_s_per_param=self.clip.slope_s,
            allreduce_lat_s=self.allreduce.lat_s,
            allreduce_bw_Bps=self.allreduce.bw_Bps,
        )


def dispatcher_host_seconds(point: HostPoint, a2a: LinkFit) -> float:
    """A dispatcher point's seconds beyond the cost model's link time of its two token
    all-to-alls (`lat + nbytes / bw` each), at least `HOST_FLOOR` of the measured time."""
    links = 2.0 * float(a2a.seconds(point.nbytes)) if point.nbytes > 0 else 0.0
    return max(point.seconds - links, HOST_FLOOR * point.seconds)


def fit_host(points: list[HostPoint], a2a: LinkFit, allreduce: LinkFit) -> HostFit:
    """Fit every host model from `points` (module docstring); `a2a` is the measured all-to-all
    (subtracted from the dispatcher's times), `allreduce` the back-to-back all-reduce, used
    when `points` hold no all-reduce after compute. A rank's dispatcher handles s + r = 2 T k
    rows (its T k routed rows, as many received)."""

    def of(kind: str) -> list[HostPoint]:
        return [p for p in points if p.kind == kind]

    dense = {}
    for kind in ("dense_fwd", "dense_bwd"):
        pts = of(kind)
        dense[kind] = fit_gemm_curve(
            [p.size for p in pts], [p.seconds for p in pts], [p.flops for p in pts]
        )
    lines = {}
    for kind in KINDS_DISPATCH:
        pts = of(kind)
        lines[kind] = fit_line(
            [2.0 * p.size for p in pts], [dispatcher_host_seconds(p, a2a) for p in pts]
        )
    for kind in KINDS_STEP:
        pts = of(kind)
        lines[kind] = fit_line([p.size for p in pts], [p.seconds for p in pts])
    experts = None
    if of("experts_fwd") and of("experts_bwd"):
        rows = sorted({p.size for p in of("experts_fwd")})
        both = [p for p in points if p.kind in KINDS_EXPERTS]
        experts = fit_gemm_curve(
            rows,
            [sum(p.seconds for p in both if p.size == n) for n in rows],
            [sum(p.flops for p in both if p.size == n) for n in rows],
        )
    if of("allreduce"):
        allreduce = allreduce_after_compute(of("allreduce"), allreduce)
    return HostFit(
        dense_fwd=dense["dense_fwd"],
        dense_bwd=dense["dense_bwd"],
        dispatch_fwd=lines["dispatch_fwd"],
        dispatch_bwd=lines["dispatch_bwd"],
        optimizer=lines["optimizer"],
        clip=lines["clip"],
        allreduce=allreduce,
        experts=experts,
    )


def allreduce_after_compute(points: list[HostPoint], back_to_back: LinkFit) -> LinkFit:
    """lat + m / bw fitted to the all-reduce after compute (item 5). Where the sizes do not
    resolve a bandwidth (the arrival skew can drown it at small sizes), the fitted intercept
    is kept as the latency and the back-to-back fit's bandwidth is used."""
    sizes, seconds = [p.size for p in points], [p.seconds for p in points]
    line = fit_line(sizes, seconds)
    if line.slope_s > 0:
        return LinkFit(line.intercept_s, 1.0 / line.slope_s, line.note)
    note = "no bandwidth resolved after compute; back-to-back bandwidth kept"
    return LinkFit(line.intercept_s, back_to_back.bw_Bps, note)


def has_host_points(points: list[HostPoint]) -> bool:
    """Every kind a `fit_host` needs is present."""
    kinds = {p.kind for p in points}
    return {"dense_fwd", "dense_bwd", *KINDS_DISPATCH, *KINDS_STEP} <= kinds


__all__ = [
    "HOST_FLOOR",
    "KINDS_DISPATCH",
    "KINDS_EXPERTS",
    "KINDS_LOCAL",
    "KINDS_STEP",
    "HostFit",
    "HostPoint",
    "allreduce_after_compute",
    "dispatcher_host_seconds",
    "fit_host",
    "has_host_points",
]
