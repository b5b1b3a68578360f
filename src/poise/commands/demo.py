"""`poise demo`: the main job on a laptop-sized default.

Until live training lands, the demo replays routing traces through every policy on a modelled
cluster: the real SmartMoE-AE sample (16 ranks, 24 layers, 32 experts; from ../shared/data when
present) and a synthetic drifting Zipf trace. It prints one table per trace (device max/mean,
predicted step time, bytes moved, planner time) and writes PNG heatmaps of device load under
`static` and under `auto` to the output folder.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poise.cost import CostModel
from poise.policies import REGISTRY
from poise.policies.base import PlanContext
from poise.predict import Predictor
from poise.sim.simulator import PolicyRun, replay
from poise.spec import MODELS
from poise.topology import get_cluster
from poise.trace import Trace


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: replay traces through every policy, with plots")
    p.add_argument("--out", default="poise-out", help="output folder (default poise-out)")
    p.add_argument(
        "--data",
        default=None,
        help="folder with smartmoe-ae-sample/ (default ../shared/data or $POISE_SHARED_DATA)",
    )
    p.add_argument("--quick", action="store_true", help="a smaller synthetic trace")
    p.set_defaults(run=run)


def find_smartmoe_sample(explicit: str | None) -> Path | None:
    candidates = [
        explicit,
        os.environ.get("POISE_SHARED_DATA"),
        "../shared/data",
        str(Path(__file__).resolve().parents[3].parent / "shared" / "data"),
    ]
    for c in candidates:
        if c and (Path(c) / "smartmoe-ae-sample").is_dir():
            return Path(c) / "smartmoe-ae-sample"
    return None


def run(args: argparse.Namespace) -> int:
    from poise.report.plots import device_load_heatmaps
    from poise.trace_generate import generate
    from poise.trace_import import load_any

    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = get_cluster("v100-ib50")
    policies = sorted(REGISTRY)
    cases: list[tuple[str, Trace, int]] = []
    sample = find_smartmoe_sample(args.data)
    if sample is not None:
        cases.append(("smartmoe-sample", load_any(str(sample)), 1))
    else:
        console.print(
            "[yellow]SmartMoE-AE sample not found (looked in ../shared/data and "
            "$POISE_SHARED_DATA); replaying the synthetic trace only[/yellow]"
        )
    steps = 20 if args.quick else 60
    drift = generate(
        "drift",
        steps=steps,
        layers=8,
        devices=cluster.num_devices,
        experts=32,
        top_k=2,
        tokens_per_device=8192,
        seed=7,
        s=1.2,
        rate=0.08,
    )
    cases.append(("zipf-drift", drift, 5))
    started = time.perf_counter()
    for label, trace, every in cases:
        spec = MODELS["smartmoe-gpt"].with_(
            experts=trace.experts, top_k=trace.top_k, moe_layers=trace.layers
        )
        ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=CostModel(cluster, spec))
        with console.status(
            f"replaying {label} ({trace.steps} steps x {trace.layers} layers) "
            f"through {len(policies)} policies"
        ):
            runs = replay(
                trace.counts,
                ctx,
                policies,
                replan_every=every,
                predictor=Predictor("ema", alpha=0.5),
            )
        console.print(_table(label, trace, cluster.name, runs))
        png = out / f"device-load-{label}.png"
        assert runs["static"].device_load is not None and runs["auto"].device_load is not None
        device_load_heatmaps(
            {"static": runs["static"].device_load, "auto": runs["auto"].device_load},
            png,
            f"{label} on {cluster.name}: device load per step, all layers summed",
        )
        console.print(f"heatmap: {png}")
    console.print(f"demo finished in {time.perf_counter() - started:.1f} s")
    return 0


def _table(label: str, trace: Trace, cluster: str, runs: dict[str, PolicyRun]) -> Table:
    static = runs["static"].mean_step_s
    table = Table(
        title=f"{label}: {trace.steps} steps, {trace.layers} layers, "
        f"{trace.devices} devices, {trace.experts} experts, top-{trace.top_k} "
        f"on {cluster}"
    )
    for col in (
        "policy",
        "device max/mean",
        "step time (ms)",
        "speedup",
        "GB moved/step",
        "planner ms/layer",
    ):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for name, r in sorted(runs.items(), key=lambda kv: kv[1].mean_step_s):
        table.add_row(
            name,
            f"{r.max_over_mean.mean():.2f}",
            f"{r.mean_step_s * 1e3:.1f}",
            f"{static / r.mean_step_s:.2f}x",
            f"{np.mean(r.bytes_moved) / 1e9:.3f}",
            f"{r.plan_ms_per_layer:.2f}",
        )
    return table
