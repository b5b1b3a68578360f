"""Timing expert GEMMs with torch and collectives between 2 spawned gloo ranks."""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poise.calibrate.config import (
    DIST_TIMEOUT_S,
    MAX_CALLS,
    WORLD_SIZE,
    CalibrationConfig,
    CalibrationError,
)
from poise.runtime.launch import destroy_process_group, free_port, join_local_gloo
from poise.util.atomic import atomic_write_text

KIB = 1024
MIB = 1024 * KIB

# the collectives timed, in order: the cluster file's two, then the ESP / MP pair Parm's schedule
# choice needs (`poise.layouts.parm`); `nbytes` as `_collective_op` defines it
LINK_COLLECTIVES = ("all_to_all", "all_reduce")
GROUP_COLLECTIVES = ("all_gather", "reduce_scatter")
COLLECTIVES = LINK_COLLECTIVES + GROUP_COLLECTIVES


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


def init_local_gloo(rank: int, port: int, threads: int) -> None:
    """Join the `WORLD_SIZE`-rank gloo group of a calibration on 127.0.0.1:`port`, with
    `threads` intra-op threads and the calibration's collective timeout."""
    join_local_gloo(rank, WORLD_SIZE, port, threads, DIST_TIMEOUT_S)


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
    """One gloo rank: time each of `COLLECTIVES` at each size; rank 0 writes the
    medians (each repeat's time is the slowest rank's) as JSON to `result_path` and reports
    progress on `queue`."""
    from poise.nn import comm

    init_local_gloo(rank, port, threads=1)
    try:
        _warm_up_ranks(sizes)
        results = []
        for collective in COLLECTIVES:
            for nbytes in sizes:
                op = _collective_op(collective, nbytes)
                t = _dist_median_seconds(op, repeats, warmup, min_time_s)
                results.append({"collective": collective, "nbytes": nbytes, "seconds": t})
                if rank == 0:
                    queue.put(f"{collective} {nbytes} B")
        if rank == 0:
            atomic_write_text(result_path, json.dumps(results))
        comm.barrier()
    finally:
        destroy_process_group()


def _collective_op(collective: str, nbytes: int) -> Callable[[], Any]:
    """all_to_all: each rank sends `nbytes` to the others, so its buffer holds nbytes * W / (W-1);
    all_reduce: a buffer of `nbytes` (sum); all_gather: `nbytes` gathered on each rank (each
    contributes nbytes / W); reduce_scatter: `nbytes` reduced, each rank keeping nbytes / W
    (sum). The last two round nbytes / W down to whole float32 elements (at least one)."""
    import torch

    from poise.nn import comm

    if collective == "all_to_all":
        elems = nbytes * WORLD_SIZE // (WORLD_SIZE - 1) // 4
        send = torch.ones(elems)
        recv = torch.empty(elems)
        return lambda: comm.all_to_all_single(recv, send)
    if collective in GROUP_COLLECTIVES:
        chunk = max(1, nbytes // 4 // WORLD_SIZE)
        piece = torch.ones(chunk)
        pieces = [torch.ones(chunk) for _ in range(WORLD_SIZE)]
        if collective == "all_gather":
            return lambda: comm.all_gather(pieces, piece)
        return lambda: comm.reduce_scatter(piece, pieces)
    buf = torch.ones(nbytes // 4)
    return lambda: comm.all_reduce(buf)


def _dist_median_seconds(
    op: Callable[[], Any], repeats: int, warmup: int, min_time_s: float
) -> float:
    """Like `median_seconds`, on every rank at once: the call count is agreed (from the slowest
    rank's warm-up), ranks start together after a barrier and run back to back (so they stay in
    step), and the result is the slowest rank's median."""
    comm = _comm()
    comm.barrier()
    calls = _call_count(_slowest(_warm(op, warmup)), repeats, min_time_s)
    comm.barrier()
    return _slowest(statistics.median(_call_times(op, calls)))


def _slowest(value: float) -> float:
    """The largest `value` over all ranks."""
    import torch

    comm = _comm()
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    return float(t.item())


def _comm() -> Any:
    from poise.nn import comm

    return comm


def _warm_up_ranks(sizes: tuple[int, ...]) -> None:
    """Open gloo's connections and fault in buffers before timing: the first collectives of a
    fresh group run several times slower than later ones. Fixed call counts keep ranks in step."""
    for collective in COLLECTIVES:
        for nbytes, calls in ((min(sizes), 50), (max(sizes), 2)):
            op = _collective_op(collective, nbytes)
            for _ in range(calls):
                op()


def measure_collectives(
    config: CalibrationConfig, progress: Progress = _no_progress
) -> list[CommPoint]:
    """Spawn `WORLD_SIZE` gloo ranks on 127.0.0.1 and time every one of `COLLECTIVES` at each
    size."""
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
