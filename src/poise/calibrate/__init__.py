"""Measure this machine and fit the cluster model's figures (`poise calibrate`).

Modules: `config` (sizes and errors), `fit` (least squares), `measure` (torch GEMMs, gloo
collectives), `host` (the host costs: non-MoE compute, the token dispatcher, optimizer and
clipping), `outputs` (assembling, checks, the YAML and JSON written).

Three measurements, each followed by a least-squares fit of the model the simulator uses
(the third, described in `poise.calibrate.host`, fills the cluster's `HostCosts`; `--no-host`
skips it):

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

   (`Cluster.gemm_rate`: F = peak_flops[dtype] * gemm_efficiency). The cluster file gets the
   measured F as the peak of every dtype (the expert FFN runs in fp32 here; a CPU has no faster
   path for the others) and efficiency 1.

   so that 1 / rate(n) = 1/F + (h/F) * (1/n) is linear in 1/n. `fit_gemm_curve` fits it.

2. **Collectives** between 2 local gloo ranks (`torch.distributed`, spawned processes):
   `all_to_all_single`, `all_reduce`, `all_gather` and `reduce_scatter` at several message
   sizes, each fitted by `fit_latency_bandwidth` to

       time(bytes) = lat_s + bytes / bw_Bps.

   For the all-to-all, `bytes` counts what each rank sends to the other ranks (its input buffer
   times (W-1)/W), which is what `poise.cost.model.link_time` charges a link with. For the
   all-reduce,
   `bytes` is the size of the reduced buffer on each rank (algorithm bandwidth); for the
   all-gather the gathered output on each rank, for the reduce-scatter the reduced input.
   The all-to-all's fit is the cluster file's link; all four, as the per-step alpha and beta of
   `poise.cost.collectives`, make `Calibration.collective_fit()`, which Parm's schedule choice
   (`poise.layouts.parm.choose_schedule`) can run from, as Parm does from measured alpha and beta
   (`load_collective_fit` reads it back from the measurements JSON).

3. **Host costs** on 2 gloo ranks running at once (`poise.calibrate.host`): the non-MoE
   block of the GPT-MoE preset `--model` (rate curve as for the GEMMs), the token dispatcher
   (time beyond its all-to-alls' modelled links, t = a + b rows) and AdamW and the clipping
   (t = a + b parameters), plus the all-reduce fit above for the dense gradients.

All fits minimise relative residuals (each equation divided by its measured value), so a
16 MiB message does not drown a 4 KiB one and a 2048-row GEMM does not drown an 8-row one. Times
are medians of single calls after warm-up, over at least `repeats` calls and enough of them to
last `min_time_s` per point.

torch is imported inside the functions that measure, so the fits (NumPy only) and the CLI's
argument parsing stay light.
"""

from poise.calibrate.config import (
    FULL_MESSAGE_BYTES,
    FULL_ROWS,
    QUICK_MESSAGE_BYTES,
    QUICK_ROWS,
    CalibrationConfig,
    CalibrationError,
)
from poise.calibrate.fit import (
    GemmFit,
    LineFit,
    LinkFit,
    fit_gemm_curve,
    fit_latency_bandwidth,
    fit_line,
)
from poise.calibrate.host import host_steps, measure_host
from poise.calibrate.host_fit import HostFit, HostPoint, fit_host
from poise.calibrate.measure import (
    COLLECTIVES,
    GROUP_COLLECTIVES,
    LINK_COLLECTIVES,
    CommPoint,
    GemmPoint,
    expert_ffn_ops,
    expert_ffn_tensors,
    measure_collectives,
    measure_gemm,
    median_seconds,
)
from poise.calibrate.outputs import (
    Calibration,
    busy_warning,
    check_memory,
    check_output,
    fit_all,
    host_info,
    load_collective_fit,
    machine_memory_bytes,
    measurements_path,
    write_outputs,
)

__all__ = [
    "COLLECTIVES",
    "FULL_MESSAGE_BYTES",
    "FULL_ROWS",
    "GROUP_COLLECTIVES",
    "LINK_COLLECTIVES",
    "QUICK_MESSAGE_BYTES",
    "QUICK_ROWS",
    "Calibration",
    "CalibrationConfig",
    "CalibrationError",
    "CommPoint",
    "GemmFit",
    "GemmPoint",
    "HostFit",
    "HostPoint",
    "LineFit",
    "LinkFit",
    "busy_warning",
    "check_memory",
    "check_output",
    "expert_ffn_ops",
    "expert_ffn_tensors",
    "fit_all",
    "fit_gemm_curve",
    "fit_host",
    "fit_latency_bandwidth",
    "fit_line",
    "host_info",
    "host_steps",
    "load_collective_fit",
    "machine_memory_bytes",
    "measure_collectives",
    "measure_gemm",
    "measure_host",
    "measurements_path",
    "median_seconds",
    "write_outputs",
]
