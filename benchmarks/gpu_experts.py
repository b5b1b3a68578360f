"""Expert compute on this GPU against the cost model's GEMM curve for it.

    python3 benchmarks/gpu_experts.py                        # CUDA, bf16, ~1 min on an H100
    python3 benchmarks/gpu_experts.py --cluster dgx-h100 --models gpt-m zipf-256

The cost model prices one expert's forward over n routed tokens at

    seconds(n) = F_t / (peak[t] * efficiency) * (n + h)        (`poise.cost.model.expert_seconds`)

with F_t the expert's forward FLOPs per token (`ModelSpec.flops_per_token_fwd`), `peak` and
`efficiency` the cluster's data-sheet peak and the fraction large GEMMs reach, and h
(`gemm_half_rows`) the rows at which a GEMM reaches half of that rate; forward and backward
cost three forwards. For the H100 presets `efficiency` comes from a published matmul table and
h = 512 is assumed (`poise.core.presets`). This benchmark measures both on the GPU it runs on.

Per model preset (`--models`; its d_model, d_expert and activation) and per slot count
(`--slots`: experts on the device, each given the same rows): `poise.nn.Experts` in `--dtype`
(the grouped GEMM on CUDA), forward and backward over n rows per slot for n in `--rows`. Each
timing is `--inner` back-to-back calls between two CUDA events, divided by `--inner`; the row
counts are swept `--repeats` times in alternating order, and the median taken.
`calibrate.fit.fit_gemm_curve` fits rate(n) = F n / (n + h) per slot to them. One JSON line
per (model, slots): the fitted `tflops` and `half_rows`, `efficiency` (F over the data-sheet
peak the cluster file gives for the dtype), `floor_ms` (the fastest call: below some rows the
host's issuing of kernels, not the GEMMs, sets the time), `marginal_tflops` (the rate of the
rows between the two largest row counts, the floor taken out), the cluster's own figures, and
per row count the measured milliseconds and `measured_over_model`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from poise.calibrate.device_experts import expert_run, sweep_medians
from poise.calibrate.fit import fit_gemm_curve
from poise.core.presets import get_cluster
from poise.core.spec import get_model

DTYPES = {"bf16": (torch.bfloat16, "bf16"), "fp32": (torch.float32, "fp32")}
ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--cluster", default="dgx-h100", help="cluster preset whose curve is checked")
    p.add_argument(
        "--models", nargs="+", default=["gpt-s", "gpt-m", "gpt-l", "smartmoe-gpt", "zipf-256"]
    )
    p.add_argument("--slots", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=5, help="calls per CUDA-event timing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype, dtype_name = DTYPES[args.dtype]
    cluster = get_cluster(args.cluster)
    peak = cluster.peak_flops.of(dtype_name)
    for model in args.models:
        spec = get_model(model)
        fwd_flops = spec.flops_per_token_fwd
        for slots in args.slots:
            impl, run = expert_run(model, slots, args.rows, device, dtype, args.inner)
            seconds = sweep_medians(run, args.rows, args.repeats)
            rows = np.asarray(args.rows, dtype=np.float64)
            per_slot = np.asarray(seconds) / slots
            fit = fit_gemm_curve(rows, per_slot, 3.0 * fwd_flops * rows)
            model_s = (
                3.0 * fwd_flops / cluster.gemm_flops(dtype_name) * (rows + cluster.gemm_half_rows)
            )
            print(
                json.dumps(
                    {
                        "bench": "gpu_experts",
                        "device": torch.cuda.get_device_name(device)
                        if device.type == "cuda"
                        else "cpu",
                        "torch": torch.__version__,
                        "model": model,
                        "d_model": spec.d_model,
                        "d_expert": spec.d_expert,
                        "activation": spec.activation,
                        "dtype": args.dtype,
                        "impl": impl,
                        "slots": slots,
                        "tflops": round(fit.gemm_flops / 1e12, 1),
                        "efficiency": round(fit.gemm_flops / peak, 3),
                        "half_rows": round(fit.half_rows, 1),
                        "fit_note": fit.note,
                        "floor_ms": round(min(seconds) * 1e3, 4),
                        "marginal_tflops": round(
                            marginal_rate(args.rows, seconds, 3.0 * fwd_flops * slots) / 1e12, 1
                        ),
                        "cluster": args.cluster,
                        "cluster_tflops": round(cluster.gemm_flops(dtype_name) / 1e12, 1),
                        "cluster_efficiency": round(cluster.gemm_efficiency, 3),
                        "cluster_half_rows": cluster.gemm_half_rows,
                        "rows": args.rows,
                        "ms": [round(s * 1e3, 4) for s in seconds],
                        "measured_over_model": [round(float(m), 3) for m in per_slot / model_s],
                    }
                ),
                flush=True,
            )
    return 0


def marginal_rate(rows: list[int], seconds: list[float], flops_per_row: float) -> float:
    """FLOP/s the last rows add: `flops_per_row` x (the largest row count - the next largest)
    over the seconds between them; the large-GEMM rate with any per-call floor taken out."""
    order = np.argsort(rows)
    hi, lo = order[-1], order[-2]
    return flops_per_row * (rows[hi] - rows[lo]) / (seconds[hi] - seconds[lo])


if __name__ == "__main__":
    raise SystemExit(main())
