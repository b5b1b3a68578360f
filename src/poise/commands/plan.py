"""`poise plan LOADS`: one-shot placement from load statistics, EPLB-compatible output."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poise.commands.options import add_planning_args, planning_context
from poise.core.outputs import check_output_dir, check_output_file
from poise.plan.files import write_plan_json
from poise.plan.policies.registry import make_plan
from poise.trace.loads import fit_devices
from poise.util.argparsing import int_in
from poise.util.atomic import atomic_write_bytes, atomic_write_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a placement from load statistics",
        description="Plan expert placement from a trace (.npz), a SmartMoE-AE "
        "folder, an EPLB weight matrix (.npy/.json) or expert-count "
        "JSON; loads are averaged over the trace's last --steps steps.",
    )
    p.add_argument("loads", help="trace or load statistics file")
    p.add_argument(
        "--policy",
        default="auto",
        help="balancing policy: static, shadow, prophet, vexpert, permute, eplb, hybrid or "
        "auto (default auto)",
    )
    add_planning_args(p)
    p.add_argument(
        "--steps", type=int_in(1), default=None, help="average the last N steps (default all)"
    )
    p.add_argument("--out", default="plan.json", help="plan JSON to write (default plan.json)")
    p.add_argument(
        "--eplb",
        metavar="DIR",
        default=None,
        help="also write phy2log/log2phy/logcnt (.npy and eplb.json) to DIR",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poise.plan.eplb_format import placement_to_eplb
    from poise.trace.importers import load_any

    check_output_file(args.out, "--out")
    if args.eplb:
        check_output_dir(args.eplb, "--eplb")
    trace = load_any(args.loads)
    cluster, spec, ctx = planning_context(args, trace, args.loads)
    counts = trace.counts if args.steps is None else trace.counts[-args.steps :]
    loads = fit_devices(counts, cluster.num_devices, args.loads).mean(axis=0).astype(np.float64)
    baseline = make_plan("static", loads, None, ctx)
    plan = make_plan(args.policy, loads, None, ctx)
    write_plan_json(plan, args.out, cluster=cluster.name, model=spec.name)
    if args.eplb:  # every file before the console: a reader that closes early loses nothing
        out = Path(args.eplb)
        phy2log, log2phy, logcnt = placement_to_eplb(plan.placement)
        for name, arr in (("phy2log", phy2log), ("log2phy", log2phy), ("logcnt", logcnt)):
            buf = io.BytesIO()
            np.save(buf, arr)
            atomic_write_bytes(out / f"{name}.npy", buf.getvalue())
        atomic_write_text(
            out / "eplb.json",
            json.dumps(
                {
                    "phy2log": phy2log.tolist(),
                    "log2phy": log2phy.tolist(),
                    "logcnt": logcnt.tolist(),
                }
            )
            + "\n",
        )
    _print_summary(plan, baseline, args, cluster.name)
    if args.eplb:
        Console().print(f"EPLB arrays written to {Path(args.eplb)}/")
    Console().print(f"plan written to {args.out}")
    return 0


def _print_summary(plan, baseline, args: argparse.Namespace, cluster: str) -> None:
    console = Console()
    table = Table(
        title=f"poise plan: {args.policy} on {cluster} ({plan.placement.devices} "
        f"devices, {plan.placement.slots_per_device} slots each)"
    )
    for col in (
        "layer",
        "replicas",
        "migrations",
        "max/mean static",
        "max/mean plan",
        "static ms",
        "plan ms",
    ):
        table.add_column(col, justify="right", overflow="fold")
    chosen = plan.notes.get("chosen")
    if chosen:
        table.add_column("chosen", justify="left")
    reps = plan.placement.replicas().sum(axis=(1, 2))
    moved = (
        np.bincount(plan.transfers.migrations[:, 0], minlength=plan.placement.layers)
        if len(plan.transfers.migrations)
        else np.zeros(plan.placement.layers, dtype=int)
    )

    def ratio(load: np.ndarray) -> float:
        mean = load.mean()
        return float(load.max() / mean) if mean > 0 else 1.0

    for layer in range(plan.placement.layers):
        row = [
            str(layer),
            str(int(reps[layer])),
            str(int(moved[layer])),
            f"{ratio(baseline.cost.device_load[layer]):.2f}",
            f"{ratio(plan.cost.device_load[layer]):.2f}",
            f"{baseline.cost.layer_s[layer] * 1e3:.2f}",
            f"{plan.cost.layer_s[layer] * 1e3:.2f}",
        ]
        if chosen:
            row.append(chosen[layer])
        table.add_row(*row)
    console.print(table)
    console.print(
        f"predicted step time: static {baseline.cost.step_s * 1e3:.1f} ms -> "
        f"{args.policy} {plan.cost.step_s * 1e3:.1f} ms "
        f"({baseline.cost.step_s / plan.cost.step_s:.2f}x); device max/mean "
        f"{baseline.cost.max_over_mean:.2f} -> {plan.cost.max_over_mean:.2f}"
    )
