"""Least-squares fits of the GEMM efficiency curve and of latency + bytes / bandwidth."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poise.calibrate.config import CalibrationError
from poise.core.cluster import Link

KIB = 1024
MIB = 1024 * KIB


# ------------------------------------------------------------------------------------------ fits
@dataclass(frozen=True)
class GemmFit:
    """rate(n) = gemm_flops * n / (n + half_rows) FLOP/s for a GEMM over n rows. `note` says
    when a bound was applied (the unconstrained fit had a negative h or no finite peak)."""

    gemm_flops: float
    half_rows: float
    note: str = ""

    def rate(self, rows: np.ndarray | float) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.float64)
        return self.gemm_flops * rows / (rows + self.half_rows)

    def seconds(self, rows: np.ndarray | float, flops: np.ndarray | float) -> np.ndarray:
        """time(n) = flops(n) * (n + h) / (F * n)."""
        return np.asarray(flops, dtype=np.float64) / self.rate(rows)


@dataclass(frozen=True)
class LinkFit:
    """time(bytes) = lat_s + bytes / bw_Bps."""

    lat_s: float
    bw_Bps: float
    note: str = ""

    def seconds(self, nbytes: np.ndarray | float) -> np.ndarray:
        return self.lat_s + np.asarray(nbytes, dtype=np.float64) / self.bw_Bps

    def link(self) -> Link:
        return Link(bw_Bps=self.bw_Bps, lat_s=self.lat_s)


def _as_samples(what: str, **columns: Sequence[float] | np.ndarray) -> dict[str, np.ndarray]:
    """1-D float arrays of one length, all finite and > 0; else `CalibrationError`."""
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in columns.items()}
    lengths = {a.shape for a in arrays.values()}
    if len(lengths) != 1 or any(a.ndim != 1 for a in arrays.values()):
        shapes = ", ".join(f"{k}{list(a.shape)}" for k, a in arrays.items())
        raise CalibrationError(f"need 1-D columns of one length, got {shapes}", source=what)
    for k, a in arrays.items():
        if not np.all(np.isfinite(a)) or (a.size and a.min() <= 0):
            raise CalibrationError(f"{k} must be finite and > 0", source=what, field=k)
    return arrays


def _weighted_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of y ~ c + s x minimising sum(((c + s x - y) / y)^2)."""
    w = 1.0 / y
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (c, s), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    return float(c), float(s)


def _weighted_slope(x: np.ndarray, target: np.ndarray, scale: np.ndarray) -> float:
    """s of target ~ s x (no intercept) minimising sum(((s x - target) / scale)^2)."""
    xw = x / scale
    return float(np.dot(xw, target / scale) / np.dot(xw, xw))


def fit_gemm_curve(
    rows: Sequence[float] | np.ndarray,
    seconds: Sequence[float] | np.ndarray,
    flops: Sequence[float] | np.ndarray,
) -> GemmFit:
    """Fit rate(n) = F n / (n + h) to GEMM timings.

    `rows[P]` token rows n, `seconds[P]` measured times, `flops[P]` FLOPs of each timed
    operation. With u = 1/F and v = h/F the model is linear:

        seconds / flops = 1 / rate(n) = u + v / n,

    solved by least squares on relative residuals. Bounds: a negative v (rate falling with n)
    gives h = 0 and F the fitted mean rate; a non-positive u (no finite peak: the rate still
    grows at the largest n) gives F = the highest measured rate and h >= 0 fitted given F.
    Needs >= 2 distinct row counts; raises `CalibrationError` on degenerate input.
    """
    s = _as_samples("gemm fit", rows=rows, seconds=seconds, flops=flops)
    if np.unique(s["rows"]).size < 2:
        raise CalibrationError("need at least 2 distinct row counts", source="gemm fit")
    x = 1.0 / s["rows"]
    y = s["seconds"] / s["flops"]
    u, v = _weighted_line(x, y)
    note = ""
    if v < 0:  # then u is the (relative) mean of y, always > 0
        u, v = _weighted_slope(np.ones_like(y), y, y), 0.0
        note = "h < 0 fitted; bounded to 0"
    elif u <= 0:
        u = float(y.min())
        v = max(0.0, _weighted_slope(x, y - u, y))
        note = "no finite peak fitted; F bounded to the highest measured rate"
    return GemmFit(gemm_flops=1.0 / u, half_rows=v / u, note=note)


def fit_latency_bandwidth(
    nbytes: Sequence[float] | np.ndarray,
    seconds: Sequence[float] | np.ndarray,
    what: str = "link fit",
) -> LinkFit:
    """Fit time(bytes) = lat + bytes / bw to collective timings.

    `nbytes[P]` message sizes, `seconds[P]` measured times; least squares on relative residuals
    of seconds ~ lat + (1/bw) bytes. A negative fitted latency is bounded to 0 (and bw refitted
    through the origin). Needs >= 2 distinct sizes and times that grow with size; raises
    `CalibrationError` otherwise, naming `what` (e.g. the collective) as its source.
    """
    s = _as_samples(what, bytes=nbytes, seconds=seconds)
    x, y = s["bytes"], s["seconds"]
    if np.unique(x).size < 2:
        raise CalibrationError("need at least 2 distinct message sizes", source=what)
    lat, inv_bw = _weighted_line(x, y)
    note = ""
    if lat < 0:
        lat, inv_bw, note = 0.0, _weighted_slope(x, y, y), "latency < 0 fitted; bounded to 0"
    if inv_bw * x.max() <= 1e-9 * y.max():  # the bytes term is not even float noise
        raise CalibrationError(
            "time does not grow with message size: no bandwidth can be fitted "
            "(measure larger messages)",
            source=what,
        )
    return LinkFit(lat_s=lat, bw_Bps=1.0 / inv_bw, note=note)


@dataclass(frozen=True)
class LineFit:
    """time(x) = intercept_s + slope_s * x: a start-up cost and a cost per unit (row, token,
    parameter). `note` says when a bound was applied."""

    intercept_s: float
    slope_s: float
    note: str = ""

    def seconds(self, x: np.ndarray | float) -> np.ndarray:
        return self.intercept_s + self.slope_s * np.asarray(x, dtype=np.float64)


def fit_line(x: Sequence[float] | np.ndarray, seconds: Sequence[float] | np.ndarray) -> LineFit:
    """Fit time(x) = a + b x (Hockney's start-up + per-unit form) to host timings.

    `x[P]` sizes (rows, tokens, parameters), `seconds[P]` measured times beyond any part priced
    elsewhere; least squares on relative residuals. Bounds: a negative a is set to 0 and b
    refitted through the origin; a negative b (time falling with size: noise) is set to 0 and a
    to the (relative) mean time. Needs >= 2 distinct sizes, all > 0; times > 0 (a caller that
    subtracts a modelled part clips at a small positive floor first)."""
    s = _as_samples("line fit", x=x, seconds=seconds)
    xs, y = s["x"], s["seconds"]
    if np.unique(xs).size < 2:
        raise CalibrationError("need at least 2 distinct sizes", source="line fit")
    a, b = _weighted_line(xs, y)
    note = ""
    if b < 0:
        a, b, note = _weighted_slope(np.ones_like(y), y, y), 0.0, "slope < 0 fitted; bounded to 0"
    elif a < 0:
        a, b, note = 0.0, _weighted_slope(xs, y, y), "intercept < 0 fitted; bounded to 0"
    return LineFit(intercept_s=a, slope_s=b, note=note)
