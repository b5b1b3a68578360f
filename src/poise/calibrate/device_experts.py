"""A GPU's expert rate, small-GEMM curve and per-call floor, written into a cluster preset.

    cluster, measured = calibrate_device(get_cluster("dgx-h100"), "gpt-m", torch.device("cuda"))

`poise calibrate --device cuda` times `poise.nn.Experts` (the model preset's widths and
activation, `slots` experts each given n rows; the grouped GEMM on CUDA) forward + backward at
each row count of `rows`, by CUDA events over `inner` back-to-back calls (by the host clock on a
CPU), the row counts swept `repeats` times in alternating order, medians kept. Then:

- **floor** phi (`Cluster.expert_call_floor_s`): the fastest forward + backward call of the
  device's `slots` experts. Below some rows the host issuing kernels, not the GEMMs, sets the
  time (`poise.cost.model.expert_call_floor`).
- **curve** rate(n) = F n / (n + h) (`calibrate.fit.fit_gemm_curve`) on the per-slot seconds of
  the row counts the floor does not set (calls at least twice the floor; all of them if fewer
  than two are), forward + backward priced as three forwards (`ModelSpec.flops_per_token_fwd`).

The cluster written is `base` with this device's figures in place of the data sheet's: the
measured dtype's peak set to F / `base.gemm_efficiency` (so `gemm_flops(dtype)` = F), the other
dtypes' peaks, the links, the topology and the host costs kept from `base` (one GPU cannot
measure its links; say so where the file is used), `gemm_half_rows` = h, the floor, and the
device's memory where CUDA reports it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from poise.calibrate.fit import fit_gemm_curve
from poise.core.cluster import Cluster, PeakFlops
from poise.core.errors import ConfigError
from poise.core.spec import get_model

ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_ROWS = (16, 64, 256, 1024)
FLOOR_MULTIPLE = 2.0  # the curve's points: calls at least this many floors long
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def event_timer(device: Any, inner: int) -> Callable[[Callable[[], Any]], float]:
    """`timed(op)`: seconds per call of `op()` over `inner` back-to-back calls, by CUDA events
    on the current stream (by the host clock on the CPU)."""
    import torch

    def timed(op: Callable[[], Any]) -> float:
        if device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(inner):
                op()
            return (time.perf_counter() - t0) / inner
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            op()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner

    return timed


def expert_run(
    model: str, slots: int, rows: Sequence[int], device: Any, dtype: Any, inner: int
) -> tuple[str, Callable[[int], float]]:
    """`(impl, run)`: `run(n)` -> seconds per forward + backward of `slots` experts of `model`'s
    shape, `n` rows each (inputs `[n * slots, d_model]` made once per n; weight gradients dropped
    after each call); `impl` the experts' resolved implementation (grouped or loop)."""
    import torch

    from poise.nn.experts import Experts

    spec = get_model(model)
    experts = Experts(
        slots, spec.d_model, spec.d_expert, spec.activation, device=device, dtype=dtype
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {}
    for n in rows:
        x = torch.randn(n * slots, spec.d_model, generator=gen).to(device, dtype)
        gy = torch.randn(n * slots, spec.d_model, generator=gen).to(device, dtype)
        counts = torch.full((slots,), n, dtype=torch.long, device=device)
        inputs[n] = (x.requires_grad_(True), gy, counts)
    timed = event_timer(device, inner)

    def step(n: int) -> None:
        x, gy, counts = inputs[n]
        experts(x, counts).backward(gy)
        experts.zero_grad(set_to_none=True)
        x.grad = None

    return experts.resolved_impl(inputs[rows[0]][0]), lambda n: timed(lambda: step(n))


def sweep_medians(
    run: Callable[[int], float], rows: Sequence[int], repeats: int, warmup: int = 2
) -> list[float]:
    """The median of `run(n)`'s own timings (seconds) per n in `rows`, over `repeats` sweeps in
    alternating order after `warmup` untimed ones."""
    samples: dict[int, list[float]] = {n: [] for n in rows}
    for sweep in range(warmup + repeats):
        for n in rows if sweep % 2 == 0 else list(rows)[::-1]:
            seconds = run(n)
            if sweep >= warmup:
                samples[n].append(seconds)
    return [float(np.median(samples[n])) for n in rows]


def fit_device(
    rows: Sequence[int], seconds: Sequence[float], slots: int, fwd_flops_per_row: float
) -> dict[str, Any]:
    """The floor, the rows the curve is fitted on and the fit (module docstring) from
    `seconds[P]` per forward + backward of `slots` experts at `rows[P]` rows each."""
    r = np.asarray(rows, dtype=np.float64)
    s = np.asarray(seconds, dtype=np.float64)
    floor = float(s.min())
    keep = s >= FLOOR_MULTIPLE * floor
    if keep.sum() < 2:
        keep = np.ones_like(keep)
    fit = fit_gemm_curve(r[keep], s[keep] / slots, 3.0 * fwd_flops_per_row * r[keep])
    return {
        "floor_s": floor,
        "fit_rows": r[keep].astype(int).tolist(),
        "gemm_flops": fit.gemm_flops,
        "half_rows": fit.half_rows,
        "fit_note": fit.note,
    }


def device_cluster(
    base: Cluster,
    dtype_name: str,
    gemm_flops: float,
    half_rows: float,
    floor_s: float,
    name: str,
    memory_bytes: float | None = None,
) -> Cluster:
    """`base` with the measured figures in place (module docstring)."""
    peaks = dataclasses.asdict(base.peak_flops)
    peaks[dtype_name] = gemm_flops / base.gemm_efficiency
    return dataclasses.replace(
        base,
        name=name,
        peak_flops=PeakFlops(**peaks),
        gemm_half_rows=half_rows,
        expert_call_floor_s=floor_s,
        memory_bytes=base.memory_bytes if memory_bytes is None else memory_bytes,
    )


def calibrate_device(
    base: Cluster,
    model: str,
    device: Any,
    *,
    dtype_name: str = "bf16",
    slots: int = 8,
    rows: Sequence[int] = ROWS,
    repeats: int = 5,
    inner: int = 5,
    progress: Callable[[str], None] | None = None,
) -> tuple[Cluster, dict[str, Any]]:
    """Measure `model`'s experts on `device` and return `(cluster, measurements)` (module
    docstring). `dtype_name`: bf16, fp16 or fp32."""
    import torch

    if dtype_name not in DTYPE_NAMES:
        raise ConfigError(
            f"unknown dtype {dtype_name!r} (known: {', '.join(DTYPE_NAMES)})",
            source="calibrate",
            field="dtype",
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device on this machine", source="calibrate", field="device")
    spec = get_model(model)
    dtype = getattr(torch, DTYPE_NAMES[dtype_name])
    if progress is not None:
        progress(f"experts of {model} on {device}, {len(rows)} row counts x {repeats}")
    impl, run = expert_run(model, slots, rows, device, dtype, inner)
    seconds = sweep_medians(run, rows, repeats)
    fitted = fit_device(rows, seconds, slots, spec.flops_per_token_fwd)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    memory = (
        float(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cuda"
        else None
    )
    cluster = device_cluster(
        base,
        dtype_name,
        fitted["gemm_flops"],
        fitted["half_rows"],
        fitted["floor_s"],
        f"calibrated-{gpu.replace(' ', '-').lower()}-on-{base.name}",
        memory,
    )
    measured = {
        "device": device.type,
        "gpu": gpu,
        "torch": torch.__version__,
        "base": base.name,
        "model": model,
        "d_model": spec.d_model,
        "d_expert": spec.d_expert,
        "activation": spec.activation,
        "dtype": dtype_name,
        "impl": impl,
        "slots": slots,
        "rows": list(rows),
        "seconds": seconds,
        **fitted,
        "kept_from_base": "links, topology, host costs and the other dtypes' peaks",
    }
    return cluster, measured


__all__ = [
    "QUICK_ROWS",
    "ROWS",
    "calibrate_device",
    "device_cluster",
    "event_timer",
    "expert_run",
    "fit_device",
    "sweep_medians",
]
