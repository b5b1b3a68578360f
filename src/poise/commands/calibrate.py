"""`poise calibrate`: measure this machine into a cluster file the simulator accepts.

poise calibrate [--out FILE.yaml] [--quick] [--d-model N] [--d-expert N] [--threads N]
                [--model PRESET] [--no-host]

Times expert-shaped GEMMs (forward and backward) with torch on the CPU and the all-to-all and
all-reduce between 2 local gloo ranks, then the host costs on the 2 ranks (the non-MoE block of
the GPT-MoE preset `--model`, the token dispatcher, AdamW and clipping), fits the cluster
model's curves (`poise.calibrate`), and writes `FILE.yaml` (a 2-device cluster: `--cluster
FILE.yaml` anywhere a preset is accepted) and `FILE.measurements.json` (raw timings and fits)
beside it.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from poise.util.argparsing import int_in

if TYPE_CHECKING:
    from poise.calibrate import Calibration

DEFAULT_OUT = "poise-out/calibrated.yaml"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure this machine's GEMM rate and collective bandwidths into a cluster file",
        description="Time expert GEMMs (torch, CPU) and all-to-all / all-reduce between 2 "
        "local gloo ranks; fit the simulator's curves; write a cluster YAML and a JSON of the "
        "measurements beside it.",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="FILE.yaml",
        help=f"cluster YAML to write (default {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few repeats (a few seconds)"
    )
    parser.add_argument(
        "--d-model",
        type=int_in(1),
        default=None,
        metavar="N",
        help="expert input width (default 1024; quick 256)",
    )
    parser.add_argument(
        "--d-expert",
        type=int_in(1),
        default=None,
        metavar="N",
        help="expert hidden width (default 2048; quick 512)",
    )
    parser.add_argument(
        "--threads",
        type=int_in(1),
        default=None,
        metavar="N",
        help="torch threads for the GEMMs (default: torch's) and each rank's host costs "
        "(default: the cores shared among the 2 ranks)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PRESET",
        help="GPT-MoE preset (tiny, small, medium) whose non-MoE block, dispatcher and optimizer "
        "are timed; its widths become the defaults of --d-model/--d-expert (default: tiny's "
        "shapes at the given widths)",
    )
    parser.add_argument(
        "--no-host",
        action="store_true",
        help="skip the host costs (the cluster file prices GEMMs and links only)",
    )
    gpu = parser.add_argument_group(
        "on a GPU (--device cuda): the experts' rate, small-GEMM curve and per-call floor "
        "measured into a copy of --base (links, topology and host costs kept from it)"
    )
    gpu.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: GEMMs, gloo collectives and host costs (default); cuda: this GPU's experts",
    )
    gpu.add_argument(
        "--base",
        default="dgx-h100",
        metavar="PRESET",
        help="cluster preset the measured figures go into (default dgx-h100)",
    )
    gpu.add_argument(
        "--experts-of",
        default="gpt-m",
        metavar="SPEC",
        help="model spec whose expert widths and activation are timed (default gpt-m)",
    )
    gpu.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="the experts' compute dtype on the GPU, whose peak the rate replaces (default bf16)",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        return run_device(args)
    from poise import calibrate as cal

    config = cal.CalibrationConfig.preset(
        quick=args.quick,
        d_model=args.d_model,
        d_expert=args.d_expert,
        threads=args.threads,
        model=args.model,
        host=not args.no_host,
    )
    if config.host:
        from poise.calibrate.host import checked_model

        checked_model(config)  # widths that do not fit the model fail before any measuring
    out = cal.check_output(args.out)
    cal.check_memory(config)
    err = Console(stderr=True)
    warning = cal.busy_warning()
    if warning:
        err.print(f"[yellow]warning: {warning}[/yellow]")
    started = time.perf_counter()
    steps = 2 * len(config.rows) + len(cal.COLLECTIVES) * len(config.message_bytes)
    steps += cal.host_steps(config) if config.host else 0
    with Progress(
        TextColumn("[bold]calibrate[/bold] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        auto_refresh=False,  # no refresh thread: it would steal a core from the timed work
    ) as progress:
        task = progress.add_task("starting", total=steps)

        def step(message: str) -> None:
            progress.update(task, advance=1, description=message, refresh=True)

        progress.update(
            task,
            description=f"GEMM d_model={config.d_model} d_expert={config.d_expert}",
            refresh=True,
        )
        gemm_points = cal.measure_gemm(config, step)
        progress.update(task, description="spawning 2 gloo ranks", refresh=True)
        comm_points = cal.measure_collectives(config, step)
        host_points = []
        if config.host:
            model = config.model or "tiny"
            progress.update(task, description=f"host costs of {model}", refresh=True)
            host_points = cal.measure_host(config, step)
    calibration = cal.fit_all(
        config, gemm_points, comm_points, cal.host_info(config), host_points=host_points
    )
    cluster, json_path = cal.write_outputs(calibration, out)
    console = Console()
    console.print(gemm_table(calibration))
    console.print(comm_table(calibration))
    console.print(fit_table(calibration))
    if calibration.host_fit is not None:
        console.print(host_table(calibration))
    console.print(
        f"wrote {out} (cluster {cluster.name!r}) and {json_path} "
        f"in {time.perf_counter() - started:.1f} s",
        soft_wrap=True,
    )
    return 0


def run_device(args: argparse.Namespace) -> int:
    """`--device cuda`: `poise.calibrate.device_experts` into a copy of `--base`; writes the
    cluster YAML and the measurements JSON beside it, both atomically."""
    import json

    import torch

    from poise import calibrate as cal
    from poise.calibrate.device_experts import QUICK_ROWS, ROWS, calibrate_device
    from poise.core.errors import ConfigError
    from poise.core.presets import get_cluster
    from poise.core.spec import get_model
    from poise.util.atomic import atomic_write_text

    base = get_cluster(args.base)
    get_model(args.experts_of)  # an unknown spec fails before any measuring
    out = cal.check_output(args.out)
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device on this machine", source="calibrate", field="--device")
    started = time.perf_counter()
    err = Console(stderr=True)
    cluster, measured = calibrate_device(
        base,
        args.experts_of,
        torch.device("cuda", torch.cuda.current_device()),
        dtype_name=args.dtype,
        rows=QUICK_ROWS if args.quick else ROWS,
        repeats=3 if args.quick else 5,
        progress=lambda message: err.print(f"calibrate: {message}"),
    )
    cluster.save(out)
    json_path = cal.measurements_path(out)
    measured["cluster"] = cluster.to_dict()
    atomic_write_text(json_path, json.dumps(measured, indent=2) + "\n")
    table = Table(title=f"experts of {args.experts_of} on {measured['gpu']} ({args.dtype})")
    for col in ("rows a slot", "fwd+bwd ms"):
        table.add_column(col, justify="right", overflow="fold")
    for n, s in zip(measured["rows"], measured["seconds"], strict=True):
        table.add_row(str(n), f"{s * 1e3:.3f}")
    console = Console()
    console.print(table)
    console.print(
        f"rate {measured['gemm_flops'] / 1e12:.1f} TFLOP/s, half rows "
        f"{measured['half_rows']:.0f}, floor {measured['floor_s'] * 1e3:.3f} ms a call; "
        f"links and topology kept from {base.name}",
        soft_wrap=True,
    )
    console.print(
        f"wrote {out} (cluster {cluster.name!r}) and {json_path} "
        f"in {time.perf_counter() - started:.1f} s",
        soft_wrap=True,
    )
    return 0


# Every column folds (overflow="fold"): on a narrow terminal a number wraps onto the next line
# instead of being cut with '…', as `poise simulate`'s table does.


def gemm_table(c: Calibration) -> Table:
    """Measured forward / backward rates per row count beside the forward+backward fit."""
    cfg = c.config
    table = Table(title=f"expert FFN GEMMs, d_model={cfg.d_model}, d_expert={cfg.d_expert} (fp32)")
    for col in ("rows", "fwd ms", "fwd GFLOP/s", "bwd ms", "bwd GFLOP/s", "fit GFLOP/s"):
        table.add_column(col, justify="right", overflow="fold")
    by = {(p.phase, p.rows): p for p in c.gemm_points}
    for n in cfg.rows:
        f, b = by[("forward", n)], by[("backward", n)]
        table.add_row(
            str(n),
            f"{f.seconds * 1e3:.3f}",
            f"{f.rate / 1e9:.1f}",
            f"{b.seconds * 1e3:.3f}",
            f"{b.rate / 1e9:.1f}",
            f"{float(c.gemm.rate(n)) / 1e9:.1f}",
        )
    return table


def comm_table(c: Calibration) -> Table:
    """Measured collective times and bandwidths per message size."""
    table = Table(title="collectives, 2 gloo ranks (all-to-all: bytes each rank sends)")
    for col in ("bytes", "all-to-all ms", "a2a GB/s", "all-reduce ms", "ar GB/s"):
        table.add_column(col, justify="right", overflow="fold")
    by = {(p.collective, p.nbytes): p for p in c.comm_points}
    for size in c.config.message_bytes:
        a, r = by[("all_to_all", size)], by[("all_reduce", size)]
        table.add_row(
            _bytes(size),
            f"{a.seconds * 1e3:.3f}",
            f"{a.bw_Bps / 1e9:.3f}",
            f"{r.seconds * 1e3:.3f}",
            f"{r.bw_Bps / 1e9:.3f}",
        )
    return table


def fit_table(c: Calibration) -> Table:
    """Fitted F, h per GEMM phase and lat, bw per collective; * marks what the cluster uses."""
    table = Table(title="fits (* = written to the cluster file)")
    for col in ("model", "rate / bandwidth", "half rows / latency", "note"):
        table.add_column(
            col, justify="left" if col in ("model", "note") else "right", overflow="fold"
        )
    for phase, g in c.gemm_fits.items():
        mark = " *" if g is c.gemm else ""
        table.add_row(
            f"GEMM {phase}{mark}", f"{g.gemm_flops / 1e9:.1f} GFLOP/s", f"{g.half_rows:.1f}", g.note
        )
    for collective, f in c.link_fits.items():
        mark = " *" if collective == "all_to_all" else ""
        table.add_row(
            f"{collective}{mark}", f"{f.bw_Bps / 1e9:.3f} GB/s", f"{f.lat_s * 1e6:.1f} µs", f.note
        )
    return table


def host_table(c: Calibration) -> Table:
    """The host costs' fits (`HostCosts` fields) with the measured time at the largest size."""
    fit = c.host_fit
    assert fit is not None
    cfg = c.config
    table = Table(
        title=f"host costs on 2 ranks, model {cfg.model or 'tiny'} (d_model={cfg.d_model}), "
        "written to the cluster file"
    )
    for col in ("model", "fit", "note"):
        table.add_column(col, justify="left", overflow="fold")
    for name, g in (("non-MoE forward", fit.dense_fwd), ("non-MoE backward", fit.dense_bwd)):
        table.add_row(
            name, f"{g.gemm_flops / 1e9:.1f} GFLOP/s, half tokens {g.half_rows:.1f}", g.note
        )
    for name, line, unit in (
        ("dispatcher forward", fit.dispatch_fwd, "row"),
        ("dispatcher backward", fit.dispatch_bwd, "row"),
        ("optimizer (AdamW)", fit.optimizer, "param"),
        ("gradient clipping", fit.clip, "param"),
    ):
        table.add_row(
            name,
            f"{line.intercept_s * 1e6:.1f} µs + {line.slope_s * 1e9:.3f} ns/{unit}",
            line.note,
        )
    ar = fit.allreduce
    table.add_row(
        "dense gradient all-reduce",
        f"{ar.lat_s * 1e6:.1f} µs + bytes / {ar.bw_Bps / 1e9:.3f} GB/s",
        "",
    )
    return table


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"
