"""`poise demo`: the main job on a laptop-sized default.

1. Trains the `tiny` GPT-MoE (byte-level, on the Python standard library's source) on 2 local
   ranks without an auxiliary balance loss, twice from the same seed: static expert parallelism
   and `auto` balancing. Each run is `python -m poise.train` on 2 gloo ranks, started the way
   `poise train CONFIG --nproc 2` starts them, into `OUT/train-static` and `OUT/train-auto`
   (config, metrics, routing trace, summary).
2. Replays the recorded routing trace in the simulator under every registered policy with
   background planning, on `dgx-h100:8` (64 H100) and `cross-dc-1000` (8,000 H100 in 1,000
   datacentres); the 2-rank trace is resampled onto the modelled devices. Every step pays the
   all-reduce of the model's dense gradients, as `poise simulate` charges it (the simulator's
   default); the report breaks each policy's step time down by phase.
3. Replays the SmartMoE-AE sample (from ../shared/data or `--data`, when present) and a
   synthetic drifting Zipf trace on `v100-ib50`, as the replay-only demo did.
4. Writes `OUT/report.html` with PNG plots next to it, and prints a summary.

`--quick` trains 24 steps per run instead of 300 and replays fewer steps on `cross-dc-1000`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poise.core.errors import ConfigError, PoiseError


class DemoError(PoiseError):
    """A training run of the demo failed."""


@dataclass(frozen=True)
class DemoSize:
    """How much the demo does. `steps`: training steps per run; `cross_dc_steps`: trace steps
    replayed on `cross-dc-1000` (all of them on `dgx-h100:8`)."""

    steps: int
    warmup: int
    replan_every: int
    eval_batches: int
    cross_dc_steps: int
    drift_steps: int


FULL = DemoSize(
    steps=300, warmup=20, replan_every=10, eval_batches=4, cross_dc_steps=60, drift_steps=60
)
QUICK = DemoSize(
    steps=24, warmup=4, replan_every=4, eval_batches=2, cross_dc_steps=10, drift_steps=20
)
POLICIES = ("static", "auto")
WORLD = 2
CLUSTERS = ("dgx-h100:8", "cross-dc-1000")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: train static vs balanced EP on 2 ranks, simulate, write a report",
        description="Train the tiny GPT-MoE on 2 local ranks with static expert parallelism "
        "and with auto balancing from the same seed, replay the recorded routing in the "
        "simulator on large clusters, and write OUT/report.html.",
    )
    p.add_argument("--out", default="poise-out", help="output folder (default poise-out)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.steps} training steps per run, not {FULL.steps}, and shorter replays",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per run")
    p.add_argument(
        "--corpus",
        default=None,
        metavar="PATH",
        help="text file or folder to train on (default: the Python standard library)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="folder with smartmoe-ae-sample/ (default ../shared/data or $POISE_SHARED_DATA)",
    )
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


def check_output_folder(out: Path) -> None:
    """Create `out` if needed and prove it writable; else one `ConfigError` naming it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".poise-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"output folder is not writable ({reason})", source=str(out), field="--out"
        ) from None


def demo_config(policy: str, out: Path, size: DemoSize, *, steps: int, corpus: str | None):
    """The `TrainConfig` of one demo run (the `configs/tiny.yaml` settings, no aux loss)."""
    import torch

    from poise.train.config import TrainConfig

    # NCCL needs a GPU per rank: with fewer GPUs than ranks the demo trains on the CPU (gloo).
    device = "auto" if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD else "cpu"
    return TrainConfig(
        model="tiny",
        device=device,
        context=128,
        batch=16,
        steps=steps,
        lr=2e-3,
        warmup=min(size.warmup, max(1, steps // 5)),
        min_lr_ratio=0.1,
        aux_loss=0.0,
        policy=policy,
        replan_every=size.replan_every,
        spare_slots=1,
        seed=0,
        data=corpus,
        out=str(out / f"train-{policy}"),
        eval_every=steps,
        eval_batches=size.eval_batches,
        checkpoint_every=0,
        log_every=max(10, steps),
        progress=False,
        tensorboard=False,
    )


def train_run(cfg, console: Console) -> float:
    """Run `cfg` on `WORLD` local ranks (`poise train --nproc` 's launcher) with a progress bar
    read from its `metrics.jsonl`; returns the wall seconds. Raises `DemoError` on failure."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from poise.commands.train import launch
    from poise.train.config import save_config

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    config_path = out / "config.yaml"
    save_config(cfg, config_path)
    done = threading.Event()
    started = time.perf_counter()
    columns = (
        TextColumn(f"training {cfg.policy:>6} on {WORLD} ranks"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps {task.fields[info]}"),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("train", total=cfg.steps, info="")

        def watch() -> None:
            while not done.wait(0.5):
                try:
                    n = sum(1 for _ in metrics.open())
                except OSError:
                    continue
                bar.update(task, completed=n, info=f"({time.perf_counter() - started:.0f} s)")

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            code = launch(WORLD, config_path, quiet=True)
        finally:
            done.set()
            watcher.join()
    if code != 0:
        raise DemoError(
            f"training with policy {cfg.policy} failed (a rank exited with status {code}; "
            "its message is above)",
            source=str(out),
        )
    return time.perf_counter() - started


def simulate_clusters(trace, replan_every: int, cross_dc_steps: int, console: Console):
    """Replay `trace` on `CLUSTERS` under every registered policy, background planning on, each
    step charged the work outside the MoE layers of the model's dense parameters
    (`ModelSpec.dense_params`, the simulator's default, as `poise simulate`). Returns
    `SimSection`s."""
    from poise.core.presets import get_cluster
    from poise.core.spec import MODELS
    from poise.plan.policies import (
        REGISTRY,
        registry,  # noqa: F401  (fills the registry)
    )
    from poise.report.html import SimSection
    from poise.sim.simulator import simulate

    spec = MODELS["smartmoe-gpt"].with_(
        name="smartmoe-gpt widths",
        experts=trace.experts,
        top_k=trace.top_k,
        moe_layers=trace.layers,
    )
    names = sorted(REGISTRY)
    sections = []
    for cluster_name in CLUSTERS:
        cluster = get_cluster(cluster_name)
        steps = trace.steps if cluster_name.startswith("dgx") else min(cross_dc_steps, trace.steps)
        t0 = time.perf_counter()
        with console.status(
            f"simulating {steps} steps x {len(names)} policies on {cluster_name} "
            f"({cluster.num_devices:,} devices)"
        ):
            result = simulate(
                trace,
                cluster,
                spec,
                names,
                "sync",
                replan_every,
                "ema",
                steps=steps,
                background_planning=True,
            )
        seconds = time.perf_counter() - t0
        copies = cluster.num_devices // trace.experts
        note = (
            f"The trace's routing is priced at the widths of the SmartMoE GPT (d_model "
            f"{spec.d_model}, d_expert {spec.d_expert}, fp16, {spec.tokens_per_device:,} tokens "
            f"per device) with the trace's {trace.experts} experts: the tiny model's own widths "
            f"would take microseconds on an H100. With {trace.experts} experts on "
            f"{cluster.num_devices:,} devices the static placement already keeps {copies:,} "
            f"expert-data-parallel copies of each expert, so balancing has less to gain than on "
            f"the 2 measured ranks. Steps replayed: {steps}."
        )
        outside = result.runs["static"].outside_s if "static" in result.runs else {}
        if "grad_allreduce_s" in outside:
            grad_ms = 1e3 * float(outside["grad_allreduce_s"].mean())
            rest_ms = 1e3 * sum(
                float(v.mean()) for k, v in outside.items() if k != "grad_allreduce_s"
            )
            note += (
                f" Every step of every policy pays the all-reduce of the gradients of the "
                f"model's {spec.dense_params:,} replicated (dense) parameters across the "
                f"{cluster.num_devices:,} devices ({grad_ms:,.2f} ms), as poise simulate "
                f"charges it, and the routing counts' gather and the gradient norm's all-reduce "
                f"({rest_ms:,.2f} ms together)."
            )
        phases = result.runs["static"].phase_totals() if "static" in result.runs else {}
        work = sum(phases.values())
        copy_s = phases.get("trans_s", 0.0) + phases.get("agg_s", 0.0)
        if work > 0 and copy_s > 0.5 * work:
            note += (
                f" {100 * copy_s / work:.1f}% of static's simulated work per step is Trans and "
                "Agg of those copies: the cost model prices each copy's weights and gradients "
                "as a direct transfer from and to its home, which overstates a broadcast or "
                "reduction tree at this scale."
            )
        sections.append(
            SimSection(cluster_name, f"{cluster_name} (simulated)", result, seconds, note)
        )
    return sections


def replay_sections(data_dir: str | None, size: DemoSize, console: Console):
    """The replay-only demo's traces: the SmartMoE-AE sample (when present) and a synthetic
    drifting Zipf trace, every policy on `v100-ib50`. Returns `ReplaySection`s."""
    from poise.core.presets import get_cluster
    from poise.core.spec import MODELS
    from poise.cost.model import CostModel
    from poise.plan.policies import REGISTRY
    from poise.plan.policies.base import PlanContext
    from poise.plan.predict import Predictor
    from poise.report.html import ReplaySection
    from poise.sim.simulator import replay
    from poise.trace.generate import generate
    from poise.trace.importers import load_any

    cluster = get_cluster("v100-ib50")
    cases = []
    sample = find_smartmoe_sample(data_dir)
    if sample is not None:
        cases.append(("smartmoe-sample", "SmartMoE-AE sample", load_any(str(sample)), 1))
    else:
        console.print(
            "[yellow]SmartMoE-AE sample not found (looked in ../shared/data and "
            "$POISE_SHARED_DATA); replaying the synthetic trace only[/yellow]"
        )
    drift = generate(
        "drift",
        steps=size.drift_steps,
        layers=8,
        devices=cluster.num_devices,
        experts=32,
        top_k=2,
        tokens_per_device=8192,
        seed=7,
        s=1.2,
        rate=0.08,
    )
    cases.append(("zipf-drift", "synthetic drifting Zipf trace", drift, 5))
    out = []
    for key, label, trace, replan_every in cases:
        spec = MODELS["smartmoe-gpt"].with_(
            experts=trace.experts, top_k=trace.top_k, moe_layers=trace.layers
        )
        ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=CostModel(cluster, spec))
        with console.status(f"replaying {label} through {len(REGISTRY)} policies"):
            runs = replay(
                trace.counts,
                ctx,
                sorted(REGISTRY),
                replan_every=replan_every,
                predictor=Predictor("ema", alpha=0.5),
            )
        note = (
            f"{trace.steps} steps, {trace.layers} layers, {trace.devices} devices, "
            f"{trace.experts} experts, top-{trace.top_k} on {cluster.name}; re-plan every "
            f"{replan_every} step(s) from EMA-predicted loads, priced on each step's actual loads."
        )
        out.append(ReplaySection(key, f"{label} on {cluster.name}", runs, note))
    return out


def compare_traces(a, b) -> str:
    """How the two runs' recorded routing compares (it should not depend on the policy)."""
    if a.counts.shape != b.counts.shape:
        return f"The recorded traces differ in shape ({a.counts.shape} vs {b.counts.shape})."
    differ = int(np.count_nonzero(a.counts != b.counts))
    total = a.counts.size
    if differ == 0:
        return (
            f"Both runs recorded the same routing trace ({a.steps} steps x {a.layers} layers x "
            f"{a.devices} ranks x {a.experts} experts): routing does not depend on the policy."
        )
    steps_differ = np.flatnonzero((a.counts != b.counts).any(axis=(1, 2, 3)))
    first = int(a.step_ids[steps_differ[0]]) + 1
    return (
        f"The two runs recorded the same routing up to step {first - 1}; from step {first} on, "
        f"rounding differences (see the loss curves) flip near-tied router choices, and "
        f"{differ:,} of {total:,} counts differ by the end (by at most "
        f"{int(np.abs(a.counts - b.counts).max())} tokens). The static run's trace is replayed."
    )


def run(args: argparse.Namespace) -> int:
    from poise.report.html import (
        MEASURED_COLUMNS,
        SIM_COLUMNS,
        DemoData,
        MeasuredRun,
        agreement_sentence,
        breakdown_by_phase,
        loss_agreement,
        measured_rows,
        sim_rows,
        write_demo_report,
    )
    from poise.trace.trace import Trace
    from poise.train.data import build_corpus

    console = Console()
    size = QUICK if args.quick else FULL
    steps = args.steps if args.steps is not None else size.steps
    if steps < 2:
        raise ConfigError(f"must be >= 2, got {steps}", source=str(steps), field="--steps")
    out = Path(args.out)
    check_output_folder(out)
    started = time.perf_counter()
    wall: dict[str, float] = {}

    cfgs = {p: demo_config(p, out, size, steps=steps, corpus=args.corpus) for p in POLICIES}
    first = cfgs[POLICIES[0]]
    with console.status("reading the corpus"):
        corpus = build_corpus(
            first.data,
            glob=first.data_glob,
            cache_dir=first.cache_dir,
            val_fraction=first.val_fraction,
        )
    mcfg = first.model_config()
    console.print(
        f"poise demo: {first.model} GPT-MoE ({mcfg.layers} layers, d_model {mcfg.d_model}, "
        f"{mcfg.num_experts} experts top-{mcfg.top_k}, no aux loss) on {WORLD} ranks, "
        f"{steps} steps per run, seed {first.seed}; corpus {corpus.source} "
        f"({len(corpus.tokens):,} bytes)"
    )
    for policy in POLICIES:
        wall[f"train {policy} ({steps} steps, {WORLD} ranks)"] = train_run(cfgs[policy], console)
    runs = {p: MeasuredRun.load(cfgs[p].out) for p in POLICIES}
    traces = {}
    for p, r in runs.items():
        if r.trace_path is None:
            raise DemoError("the run recorded no routing trace", source=str(r.path))
        traces[p] = Trace.load(r.trace_path)
    trace_note = compare_traces(traces["static"], traces["auto"])

    sims = simulate_clusters(traces["static"], size.replan_every, size.cross_dc_steps, console)
    for sec in sims:
        wall[f"simulate {sec.key} ({sec.result.steps} steps)"] = sec.seconds
    t0 = time.perf_counter()
    replays = replay_sections(args.data, size, console)
    wall["trace replays"] = time.perf_counter() - t0

    settings = {
        "model": f"{first.model}: {mcfg.layers} layers, d_model {mcfg.d_model}, "
        f"{mcfg.num_experts} experts (d_expert {mcfg.d_expert}) top-{mcfg.top_k} in every layer, "
        f"context {mcfg.context}, byte-level",
        "corpus": f"{corpus.source} ({len(corpus.tokens):,} bytes, {corpus.files} files)",
        "training": f"{WORLD} local ranks (gloo, CPU), global batch {first.batch} sequences, "
        f"{steps} steps, AdamW lr {first.lr:g}, seed {first.seed}, no auxiliary loss",
        "policies": f"static EP ({mcfg.num_experts // WORLD} slots per rank) and auto "
        f"(re-plan every {first.replan_every} steps, {first.spare_slots} spare slot per rank)",
        "simulated": ", ".join(CLUSTERS) + ", every registered policy, background planning, "
        "the dense gradients' all-reduce in every step",
    }
    data = DemoData(
        runs=runs, sims=sims, replays=replays, settings=settings, notes=[trace_note], wall_s=wall
    )
    wall["total before the report"] = time.perf_counter() - started
    with console.status("writing the report"):
        report = write_demo_report(data, out)
    total = time.perf_counter() - started

    table = Table(title=f"measured on this machine: {WORLD} ranks, {steps} steps per run")
    shown = [0, 2, 4, 5, 6, 7, 8]  # policy, final loss, step, tokens/s, vs static, load, plans
    for i in shown:
        col = MEASURED_COLUMNS[i]
        table.add_column(col, justify="left" if col == "policy" else "right")
    for row in measured_rows(runs):
        table.add_row(*(row[i] for i in shown))
    console.print(table)
    agreement = loss_agreement(runs["static"], runs["auto"])
    console.print(agreement_sentence(agreement, "static", "auto"))
    for sec in sims:
        t = Table(
            title=f"{sec.title}: {sec.result.cluster.num_devices:,} devices, "
            f"{sec.result.steps} steps"
        )
        for col in SIM_COLUMNS:
            t.add_column(col, justify="left" if col == "policy" else "right")
        for row in sim_rows(sec.result):
            t.add_row(*row)
        console.print(t)
        fastest = sec.result.summary_rows()[0]["policy"]
        columns, rows = breakdown_by_phase(sec.result, ["static", fastest, "auto"])
        t = Table(title=f"{sec.title}: step time by phase (the report has every policy)")
        for i, col in enumerate(columns):
            t.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
    console.print(f"demo finished in {total:.1f} s")
    console.print(f"report: {report}")
    return 0
