"""Measure this machine and fit the cluster model's figures (`poise calibrate`).

Two measurements, each followed by a least-squares fit of the model the simulator uses:

1. **Expert GEMMs** (torch on the CPU). One expert is a two-matrix FFN; for `n` routed tokens

       forward   (2 GEMMs, 4 n d_model d_expert FLOPs)
           h = x @ W1            x[n, d_model], W1[d_model, d_expert]
           a = gelu(h)
           y = a @ W2            W2[d_expert, d_model], y[n, d_model]
       backward  (4 GEMMs, 8 n d_model d_expert FLOPs), given dY[n, d_model]
           dW2 = a.T @ dY        dH = (dY @ W2.T) * gelu'(h)
           dX  = dH @ W1.T       dW1 = x.T @ dH

   The simulator (`Cluster.gemm_rate`) prices a GEMM over `n` rows at

       rate(n) = F * n / (n + h)          F = gemm_flops, h = gemm_half_rows

   so that 1 / rate(n) = 1/F + (h/F) * (1/n) is linear in 1/n. `fit_gemm_curve` fits it.

2. **Collectives** between 2 local gloo ranks (`torch.distributed`, spawned processes):
   `all_to_all_single` and `all_reduce` at several message sizes, fitted by
   `fit_latency_bandwidth` to

       time(bytes) = lat_s + bytes / bw_Bps.

   For the all-to-all, `bytes` counts what each rank sends to the other ranks (its input buffer
   times (W-1)/W), which is what `poise.cost.link_time` charges a link with. For the all-reduce,
   `bytes` is the size of the reduced buffer on each rank (algorithm bandwidth).

Both fits minimise relative residuals (each equation divided by its measured value), so a
16 MiB message does not drown a 4 KiB one and a 2048-row GEMM does not drown an 8-row one. Times
are medians of single calls after warm-up, over at least `repeats` calls and enough of them to
last `min_time_s` per point.

torch is imported inside the functions that measure, so the fits (NumPy only) and the CLI's
argument parsing stay light.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from poise.atomic import atomic_write_text
from poise.errors import ConfigError, PoiseError
from poise.topology import Cluster, Link

KIB = 1024
MIB = 1024 * KIB
WORLD_SIZE = 2
MAX_CALLS = 1000  # timed calls per measured point, at most
DIST_TIMEOUT_S = 120.0  # the gloo ranks must finish within this (warm-up and spawn included)

FULL_ROWS = (8, 32, 128, 512, 2048)
QUICK_ROWS = (8, 64, 512)
FULL_MESSAGE_BYTES = tuple(4 * KIB * 4**i for i in range(7))  # 4 KiB .. 16 MiB
QUICK_MESSAGE_BYTES = (4 * KIB, 64 * KIB, MIB)


class CalibrationError(PoiseError):
    """Measurements that cannot be fitted, or ranks that did not finish."""


# --------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class CalibrationConfig:
    """What to measure. `rows`: token counts n of the expert GEMMs; `message_bytes`: sizes of
    the collectives (bytes each rank sends for the all-to-all, buffer bytes for the all-reduce).
    Each point is the median of at least `gemm_repeats` / `comm_repeats` timed calls, and of
    enough calls to last `min_time_s`, after `warmup` untimed calls. `threads`: torch intra-op
    threads for the GEMMs (None: torch's default). Invalid values raise `ConfigError`."""

    d_model: int = 1024
    d_expert: int = 2048
    rows: tuple[int, ...] = FULL_ROWS
    message_bytes: tuple[int, ...] = FULL_MESSAGE_BYTES
    gemm_repeats: int = 5
    comm_repeats: int = 10
    warmup: int = 2
    min_time_s: float = 0.2
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("d_model", "d_expert", "gemm_repeats", "comm_repeats"):
            _check_positive(getattr(self, name), name)
        if self.warmup < 0:
            raise ConfigError(
                f"must be >= 0, got {self.warmup}", source="calibrate", field="warmup"
            )
        if not 0 <= self.min_time_s <= 60:
            raise ConfigError(
                f"must be in [0, 60], got {self.min_time_s}", source="calibrate", field="min_time_s"
            )
        if self.threads is not None:
            _check_positive(self.threads, "threads")
        for name in ("rows", "message_bytes"):
            values = getattr(self, name)
            if len(set(values)) < 2:
                raise ConfigError(
                    f"need at least 2 distinct sizes, got {list(values)}",
                    source="calibrate",
                    field=name,
                )
            for v in values:
                _check_positive(v, name)
            if name == "message_bytes" and any(v % 4 for v in values):
                raise ConfigError(
                    "message sizes must be multiples of 4 bytes (float32)",
                    source="calibrate",
                    field=name,
                )

    @classmethod
    def preset(
        cls,
        *,
        quick: bool,
        d_model: int | None = None,
        d_expert: int | None = None,
        threads: int | None = None,
    ) -> CalibrationConfig:
        """The full or `quick` sizes, with explicit widths and threads taking precedence."""
        if quick:
            base = cls(
                d_model=256,
                d_expert=512,
                rows=QUICK_ROWS,
                message_bytes=QUICK_MESSAGE_BYTES,
                gemm_repeats=3,
                comm_repeats=5,
                warmup=1,
                min_time_s=0.03,
            )
        else:
            base = cls()
        return replace(
            base,
            d_model=base.d_model if d_model is None else d_model,
            d_expert=base.d_expert if d_expert is None else d_expert,
            threads=threads,
        )

    def gemm_bytes(self) -> int:
        """float32 bytes the GEMM benchmark holds at its largest row count: weights and their
        gradients (4 d_model d_expert) and activations (x, y, dY, dX: 4 n d_model; h, a, gelu'(h),
        dA, dH: 5 n d_expert)."""
        n = max(self.rows)
        return 4 * (4 * self.d_model * self.d_expert + n * (4 * self.d_model + 5 * self.d_expert))


def _check_positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"must be a positive integer, got {value!r}", source="calibrate", field=name
        )


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
    nbytes: Sequence[float] | np.ndarray, seconds: Sequence[float] | np.ndarray
) -> LinkFit:
    """Fit time(bytes) = lat + bytes / bw to collective timings.

    `nbytes[P]` message sizes, `seconds[P]` measured times; least squares on relative residuals
    of seconds ~ lat + (1/bw) bytes. A negative fitted latency is bounded to 0 (and bw refitted
    through the origin). Needs >= 2 distinct sizes and times that grow with size; raises
    `CalibrationError` otherwise.
    """
    s = _as_samples("link fit", bytes=nbytes, seconds=seconds)
    x, y = s["bytes"], s["seconds"]
    if np.unique(x).size < 2:
        raise CalibrationError("need at least 2 distinct message sizes", source="link fit")
    lat, inv_bw = _weighted_line(x, y)
    note = ""
    if lat < 0:
        lat, inv_bw, note = 0.0, _weighted_slope(x, y, y), "latency < 0 fitted; bounded to 0"
    if inv_bw * x.max() <= 1e-9 * y.max():  # the bytes term is not even float noise
        raise CalibrationError(
            "time does not grow with message size: no bandwidth can be fitted "
            "(measure larger messages)",
            source="link fit",
        )
    return LinkFit(lat_s=lat, bw_Bps=1.0 / inv_bw, note=note)


# ----------------------------------------------------------------------------------- measurement
@dataclass(frozen=True)
class GemmPoint:
    """One expert-FFN timing: `phase` forward or backward over `rows` tokens."""

    phase: str
    rows: int
    seconds: float
    flops: float

    @property
    def rate(self) -> float:
        return self.flops / self.seconds


@dataclass(frozen=True)
class CommPoint:
    """One collective timing: `nbytes` as defined in the module docstring."""

    collective: str
    nbytes: int
    seconds: float

    @property
    def bw_Bps(self) -> float:
        return self.nbytes / self.seconds


Progress = Callable[[str], None]


def _no_progress(_: str) -> None:
    pass


def median_seconds(op: Callable[[], Any], repeats: int, warmup: int, min_time_s: float) -> float:
    """Median seconds of one `op()` call after `warmup` calls, over at least `repeats` calls
    and enough calls to take about `min_time_s` (at most `MAX_CALLS`). Medians of single calls,
    not means of loops: a descheduled call on a busy machine is one outlier, not a shifted mean."""
    calls = _call_count(_warm(op, warmup), repeats, min_time_s)
    return statistics.median(_call_times(op, calls))


def _warm(op: Callable[[], Any], warmup: int) -> float:
    """Call `op` max(1, warmup) times; seconds of the fastest call."""
    return min(_call_times(op, max(1, warmup)))


def _call_count(estimate_s: float, repeats: int, min_time_s: float) -> int:
    """max(repeats, min_time_s / estimate_s) calls, capped at `MAX_CALLS` (never below
    `repeats`)."""
    wanted = math.ceil(min_time_s / max(estimate_s, 1e-9))
    return max(repeats, min(MAX_CALLS, wanted))


def _call_times(op: Callable[[], Any], calls: int) -> list[float]:
    """Seconds of each of `calls` back-to-back calls of `op`."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return times


def expert_ffn_tensors(d_model: int, d_expert: int, rows: int, seed: int = 0) -> dict[str, Any]:
    """Random float32 operands of one GELU expert over `rows` tokens: x[n, d_model],
    W1[d_model, d_expert], W2[d_expert, d_model], dY[n, d_model] (the output's gradient)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, d_model, generator=gen),
        "W1": torch.randn(d_model, d_expert, generator=gen) / math.sqrt(d_model),
        "W2": torch.randn(d_expert, d_model, generator=gen) / math.sqrt(d_expert),
        "dY": torch.randn(rows, d_model, generator=gen),
    }


def expert_ffn_ops(t: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward, backward) closures over `expert_ffn_tensors` with the GEMMs of the module
    docstring. forward() returns y[n, d_model]; backward() returns (dX, dW1, dW2), reusing the
    forward's activations h, a and gelu'(h), which are computed once here, untimed."""
    import torch

    x, W1, W2, dY = t["x"], t["W1"], t["W2"], t["dY"]
    h = x @ W1
    a = torch.nn.functional.gelu(h)
    # gelu'(h) = Phi(h) + h phi(h) for the exact (erf) GELU
    dgelu = 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0))) + h * torch.exp(-0.5 * h * h) / math.sqrt(
        2.0 * math.pi
    )

    def forward() -> Any:
        return torch.nn.functional.gelu(x @ W1) @ W2

    def backward() -> Any:
        dW2 = a.T @ dY
        dH = (dY @ W2.T) * dgelu
        return dH @ W1.T, x.T @ dH, dW2

    return forward, backward


def measure_gemm(config: CalibrationConfig, progress: Progress = _no_progress) -> list[GemmPoint]:
    """Forward and backward timings of the expert FFN at each of `config.rows`."""
    import torch

    previous = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    points: list[GemmPoint] = []
    unit = 2.0 * config.d_model * config.d_expert  # FLOPs of one row through one matrix
    try:
        with torch.no_grad():
            for n in config.rows:
                forward, backward = expert_ffn_ops(
                    expert_ffn_tensors(config.d_model, config.d_expert, n)
                )
                for phase, op, gemms in (("forward", forward, 2), ("backward", backward, 4)):
                    t = median_seconds(op, config.gemm_repeats, config.warmup, config.min_time_s)
                    points.append(GemmPoint(phase, n, t, gemms * unit * n))
                    progress(f"GEMM {phase} n={n}")
    finally:
        torch.set_num_threads(previous)
    return points


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_worker(
    rank: int,
    port: int,
    sizes: tuple[int, ...],
    repeats: int,
    warmup: int,
    min_time_s: float,
    result_path: str,
    queue: Any,
) -> None:
    """One gloo rank: time all_to_all_single and all_reduce at each size; rank 0 writes the
    medians (each repeat's time is the slowest rank's) as JSON to `result_path` and reports
    progress on `queue`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=DIST_TIMEOUT_S),
    )
    try:
        _warm_up_ranks(sizes)
        results = []
        for collective in ("all_to_all", "all_reduce"):
            for nbytes in sizes:
                op = _collective_op(collective, nbytes)
                t = _dist_median_seconds(op, repeats, warmup, min_time_s)
                results.append({"collective": collective, "nbytes": nbytes, "seconds": t})
                if rank == 0:
                    queue.put(f"{collective} {nbytes} B")
        if rank == 0:
            atomic_write_text(result_path, json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _collective_op(collective: str, nbytes: int) -> Callable[[], Any]:
    """all_to_all: each rank sends `nbytes` to the others, so its buffer holds nbytes * W / (W-1);
    all_reduce: a buffer of `nbytes` (sum)."""
    import torch
    import torch.distributed as dist

    if collective == "all_to_all":
        elems = nbytes * WORLD_SIZE // (WORLD_SIZE - 1) // 4
        send = torch.ones(elems)
        recv = torch.empty(elems)
        return lambda: dist.all_to_all_single(recv, send)
    buf = torch.ones(nbytes // 4)
    return lambda: dist.all_reduce(buf)


def _dist_median_seconds(
    op: Callable[[], Any], repeats: int, warmup: int, min_time_s: float
) -> float:
    """Like `median_seconds`, on every rank at once: the call count is agreed (from the slowest
    rank's warm-up), ranks start together after a barrier and run back to back (so they stay in
    step), and the result is the slowest rank's median."""
    dist = _dist()
    dist.barrier()
    calls = _call_count(_slowest(_warm(op, warmup)), repeats, min_time_s)
    dist.barrier()
    return _slowest(statistics.median(_call_times(op, calls)))


def _slowest(value: float) -> float:
    """The largest `value` over all ranks."""
    import torch

    dist = _dist()
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _warm_up_ranks(sizes: tuple[int, ...]) -> None:
    """Open gloo's connections and fault in buffers before timing: the first collectives of a
    fresh group run several times slower than later ones. Fixed call counts keep ranks in step."""
    for collective in ("all_to_all", "all_reduce"):
        for nbytes, calls in ((min(sizes), 50), (max(sizes), 2)):
            op = _collective_op(collective, nbytes)
            for _ in range(calls):
                op()


def measure_collectives(
    config: CalibrationConfig, progress: Progress = _no_progress
) -> list[CommPoint]:
    """Spawn `WORLD_SIZE` gloo ranks on 127.0.0.1 and time both collectives at each size."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="poise-calibrate-") as tmp:
        result_path = os.path.join(tmp, "collectives.json")
        args = (
            free_port(),
            tuple(config.message_bytes),
            config.comm_repeats,
            config.warmup,
            config.min_time_s,
            result_path,
            queue,
        )
        procs = mp.start_processes(
            _collective_worker, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn"
        )
        _wait(procs, queue, progress)
        rows = json.loads(Path(result_path).read_text(encoding="utf-8"))
    return [CommPoint(r["collective"], int(r["nbytes"]), float(r["seconds"])) for r in rows]


def _wait(procs: Any, queue: Any, progress: Progress) -> None:
    """Join the ranks, forwarding progress messages; end them (by their own handles) if they run
    past `DIST_TIMEOUT_S` plus spawn time."""
    import queue as queue_mod

    deadline = time.monotonic() + DIST_TIMEOUT_S + 60.0
    done = False
    while not done:
        done = procs.join(timeout=0.2)
        while True:
            try:
                progress(queue.get_nowait())
            except queue_mod.Empty:
                break
        if not done and time.monotonic() > deadline:
            for p in procs.processes:
                if p.is_alive():
                    p.terminate()
            raise CalibrationError(
                f"gloo ranks did not finish within {DIST_TIMEOUT_S + 60:.0f} s", source="calibrate"
            )


# ------------------------------------------------------------------------------------- assembling
@dataclass
class Calibration:
    """Measurements and fits of one run. `gemm` is the forward+backward fit the cluster uses
    (the cost model prices backward as twice forward, so one curve must serve both)."""

    config: CalibrationConfig
    gemm_points: list[GemmPoint]
    comm_points: list[CommPoint]
    gemm_fits: dict[str, GemmFit] = field(default_factory=dict)
    link_fits: dict[str, LinkFit] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)

    @property
    def gemm(self) -> GemmFit:
        return self.gemm_fits["forward+backward"]

    @property
    def intra_node(self) -> LinkFit:
        return self.link_fits["all_to_all"]

    def cluster(self, name: str | None = None, memory_bytes: float | None = None) -> Cluster:
        """2 devices on one node; GEMM curve from `gemm`, intra-node link from the all-to-all,
        memory half of this machine's RAM."""
        link = self.intra_node.link()
        return Cluster(
            name=name or f"calibrated-{self.host.get('hostname') or socket.gethostname()}",
            devices_per_node=WORLD_SIZE,
            nodes_per_domain=1,
            domains=1,
            gemm_flops=self.gemm.gemm_flops,
            memory_bytes=memory_bytes or machine_memory_bytes() / WORLD_SIZE,
            intra_node=link,
            inter_node=link,
            inter_domain=link,
            gemm_half_rows=self.gemm.half_rows,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "config": asdict(self.config),
            "gemm": [dict(asdict(p), rate_flops=p.rate) for p in self.gemm_points],
            "collectives": [dict(asdict(p), bw_Bps=p.bw_Bps) for p in self.comm_points],
            "gemm_fits": {k: asdict(v) for k, v in self.gemm_fits.items()},
            "link_fits": {k: asdict(v) for k, v in self.link_fits.items()},
        }


def fit_all(
    config: CalibrationConfig,
    gemm_points: list[GemmPoint],
    comm_points: list[CommPoint],
    host: dict[str, Any] | None = None,
) -> Calibration:
    """GEMM fits per phase and for forward+backward summed per row count; a link fit per
    collective."""
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
            [p.nbytes for p in pts], [p.seconds for p in pts]
        )
    return Calibration(config, gemm_points, comm_points, gemm_fits, link_fits, host or {})


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
    its folder must be creatable and writable; else `ConfigError` naming `--out`."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError("must end in .yaml or .yml", source=str(path), field="--out")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create output folder: {exc.strerror or exc}", source=str(path), field="--out"
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError("output folder is not writable", source=str(path), field="--out")
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
