"""`poise demo`: the main job on a laptop-sized default.

1. Measured: trains the `tiny` GPT-MoE with larger, fewer-per-token experts (16 experts top-1,
   d_expert 1024: the router's skew then costs real time on CPU ranks) on 2 local ranks without
   an auxiliary balance loss, from the same seed: static expert parallelism and `auto`
   balancing, both at once, taking their steps in turns (`poise.train.turns`: static's step k,
   then auto's step k, ...; the waiting run's ranks sleep), so that a machine whose speed
   drifts moves both sides of the ratio alike. Each run is `python -m poise.train` on 2 gloo
   ranks, started the way `poise train CONFIG --nproc 2` starts them, into `OUT/train-static`
   and `OUT/train-auto`.
   Beside them, the ideal: the static run's steps with its experts perfectly balanced for free
   (`poise.report.ideal`, the expert cost timed in the runs' own turns by
   `poise.commands.expert_clock`, so that it meets the machine the steps meet), and the
   verdict of `poise.report.ideal.judge`.
2. Simulated: real routing on clusters with at least as many experts as devices
   (`poise.commands.demo_sims`): the run's own trace, the SmartMoE-AE sample, OLMoE's routing
   (64 experts top-8 on 64 H100) and the same split to 256 experts top-8 at DeepSeek-V3's widths
   on 64 (and, in the full demo, 256) H100; every registered policy, background planning (as
   the runtime plans), the dense gradients' all-reduce in every step. The real data comes from
   `--data`, `$POISE_SHARED_DATA` or `../shared/data`; without it the report says so and
   replays what it has.
3. Trace replays of the planners alone on `v100-ib50` (the SmartMoE-AE sample when present, a
   synthetic drifting Zipf trace).
4. Writes `OUT/report.html` with PNG plots next to it and `OUT/demo.json` (`measured`:
   `static_tok_s`, `auto_tok_s`, `speedup`, `ideal_speedup`, ...; `simulated`: one entry per
   table), both atomically, and prints a summary. The report's words and `demo.json`'s figures
   are made in `poise.commands.demo_report`.

`--quick` trains 30 steps of 12 sequences per run instead of 120 of 16, and replays fewer
steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from poise.commands.demo_report import (
    compare_traces,
    demo_json,
    measured_summary,
    sim_line,
    sim_note,
)
from poise.core.errors import ConfigError, PoiseError
from poise.core.finite import json_text
from poise.util.argparsing import int_in

if TYPE_CHECKING:
    from poise.train.config import TrainConfig


class DemoError(PoiseError):
    """A training run of the demo failed."""


@dataclass(frozen=True)
class DemoSize:
    """How much the demo does. `steps`: training steps per run; `batch`: sequences of 128 bytes
    per step over both ranks; `sim_steps`: the most steps a simulated replay runs."""

    steps: int
    batch: int
    warmup: int
    replan_every: int
    eval_batches: int
    sim_steps: int
    drift_steps: int


FULL = DemoSize(
    steps=120,
    batch=16,
    warmup=20,
    replan_every=10,
    eval_batches=2,
    sim_steps=30,
    drift_steps=60,
)
# 30 steps: enough re-plans (every 3 steps) for a plan to take effect and be measured under
# the controller's rule; a batch of 12 sequences keeps both runs' 60 steps within the quick
# demo's minute on a 2-core machine
QUICK = DemoSize(
    steps=30,
    batch=12,
    warmup=3,
    replan_every=3,
    eval_batches=1,
    sim_steps=12,
    drift_steps=20,
)
POLICIES = ("static", "auto")
WORLD = 2
# The measured model: the `tiny` preset with 16 experts of width 1024, top-1. With the preset's
# 8 small experts top-2 the experts are a third of a CPU step and balance is worth < 10%
# (benchmarks/train_speedup.py `tiny`); here the slowest rank's expert work sets the step.
MODEL_ARGS: dict[str, int] = {"num_experts": 16, "top_k": 1, "d_expert": 1024}
# Processes that draw the report's figures (`poise.report.figure_workers`) beside the
# simulations and the page's writing, at most one a core.
FIGURE_WORKERS = 2


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
        help=f"{QUICK.steps} training steps of {QUICK.batch} sequences per run, not "
        f"{FULL.steps} of {FULL.batch}, and shorter replays "
        "(a smoke test: too few steps to measure a speedup)",
    )
    p.add_argument(
        "--steps",
        type=int_in(2),
        default=None,
        help=f"training steps per run (default {FULL.steps}; --quick {QUICK.steps})",
    )
    p.add_argument(
        "--corpus",
        default=None,
        metavar="PATH",
        help="text file or folder to train on (default: the Python standard library)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="folder with smartmoe-ae-sample/ and olmoe-expert-counts/ (default "
        "$POISE_SHARED_DATA or ../shared/data)",
    )
    p.set_defaults(run=run)


def find_smartmoe_sample(explicit: str | None) -> Path | None:
    """The SmartMoE-AE sample folder under the shared data (`demo_sims.find_shared_data`)."""
    from poise.commands.demo_sims import SMARTMOE_DIR, find_shared_data

    root = find_shared_data(explicit)
    if root is not None and (root / SMARTMOE_DIR).is_dir():
        return root / SMARTMOE_DIR
    return None


def check_output_folder(out: Path) -> None:
    """Check `out` (`poise.core.outputs.check_output_dir`) and create it; else one
    `ConfigError` naming it."""
    from poise.core.outputs import check_output_dir

    check_output_dir(out, "--out")
    try:
        out.mkdir(parents=True, exist_ok=True)
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
        model_args=dict(MODEL_ARGS),
        device=device,
        context=128,
        batch=size.batch,
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


def train_in_turns(
    cfgs: list[TrainConfig], console: Console, turns: Path, clock: Callable[..., Any]
) -> tuple[float, dict[str, Any]]:
    """Run `cfgs` at once, each on `WORLD` local ranks (`poise train --nproc` 's launcher),
    taking their steps in turns through the counter file `turns` (made fresh here), with
    `clock(turns, slot, slots)` (`expert_clock.expert_seconds_in_turns`) timing the experts in a
    turn of its own and one progress bar read from their `metrics.jsonl`; returns the wall
    seconds and the clock's result. Raises `DemoError` naming the first run that failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from poise.commands.train import in_turns, launch
    from poise.train.config import save_config

    paths = []
    for cfg in cfgs:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
        paths.append(out)
    done = threading.Event()
    started = time.perf_counter()
    names = " and ".join(c.policy for c in cfgs)
    columns = (
        TextColumn(f"training {names} in turns on {WORLD} ranks each"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps {task.fields[info]}"),
    )

    def train_one(cfg: TrainConfig) -> int:
        save_config(cfg, Path(cfg.out) / "config.yaml")
        return launch(WORLD, Path(cfg.out) / "config.yaml", quiet=True)

    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("train", total=sum(c.steps for c in cfgs), info="")

        def watch() -> None:
            while not done.wait(0.5):
                n = 0
                for out in paths:
                    try:
                        n += sum(1 for _ in (out / "metrics.jsonl").open())
                    except OSError:
                        continue
                bar.update(task, completed=n, info=f"({time.perf_counter() - started:.0f} s)")

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            *codes, timed = in_turns(cfgs, turns, train_one, [partial(clock, turns)])
        finally:
            done.set()
            watcher.join()
    for cfg, out, code in zip(cfgs, paths, codes, strict=True):
        if code != 0:
            raise DemoError(
                f"training with policy {cfg.policy} failed (a rank exited with status {code}; "
                "its message is above)",
                source=str(out),
            )
    return time.perf_counter() - started, timed


def simulate_clusters(
    trace, size: DemoSize, data_dir: str | None, console: Console, *, quick: bool
) -> tuple[list, list[str]]:
    """Replay the demo's simulated cases (`demo_sims.sim_cases`: the run's own `trace`, then
    the real routing found) under every registered policy, background planning on, each step
    charged the work outside the MoE layers of the model's dense parameters
    (`ModelSpec.dense_params`, the simulator's default, as `poise simulate`). Returns the
    `SimSection`s and, in words, the real data that was not found."""
    from poise.commands.demo_sims import sim_cases
    from poise.core.presets import get_cluster
    from poise.plan.policies import (
        REGISTRY,
        registry,  # noqa: F401  (fills the registry)
    )
    from poise.report.html import SimSection
    from poise.sim.simulator import simulate

    found = sim_cases(trace, data_dir, quick=quick, sim_steps=size.sim_steps)
    names = sorted(REGISTRY)
    sections = []
    for case in found.cases:
        cluster = get_cluster(case.cluster)
        if case.spec.experts < cluster.num_devices:
            raise ConfigError(
                f"{case.spec.experts} experts on {cluster.num_devices} devices: the demo "
                "simulates only clusters with at least as many experts as devices",
                source=case.key,
                field="cluster",
            )
        steps = case.trace.steps if case.steps is None else min(case.steps, case.trace.steps)
        t0 = time.perf_counter()
        with console.status(
            f"simulating {case.title}: {steps} steps x {len(names)} policies "
            f"({cluster.num_devices:,} devices)"
        ):
            result = simulate(
                case.trace,
                cluster,
                case.spec,
                names,
                "sync",
                case.replan_every,
                "ema",
                steps=steps,
                background_planning=True,
            )
        seconds = time.perf_counter() - t0
        sections.append(
            SimSection(
                case.key,
                f"{case.title} (simulated)",
                result,
                seconds,
                case.why + " " + sim_note(result),
            )
        )
    return sections, found.missing


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


def run(args: argparse.Namespace) -> int:
    """The demo, built in a fresh folder beside `--out` (`.NAME.tmp-<pid>`) and published whole
    in its place (`poise.util.atomic.atomic_publish_dir`) once the report is written: an
    interrupted or failed demo (Ctrl-C included) removes its folder, turns file and all, and
    leaves the previous one as it was."""
    from poise.core.outputs import check_output_dir

    size = QUICK if args.quick else FULL
    steps = args.steps if args.steps is not None else size.steps
    if steps < 2:
        raise ConfigError(f"must be >= 2, got {steps}", source=str(steps), field="--steps")
    final = Path(args.out)
    check_output_dir(final, "--out")
    _remove_stale_builds(final)
    build = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        return _run(args, size, steps, build, final)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def _remove_stale_builds(final: Path) -> None:
    """Remove the build folders of demos into `final` that were killed outright (their
    process is gone)."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(args: argparse.Namespace, size: DemoSize, steps: int, out: Path, final: Path) -> int:
    """The demo's work, written into `out`, then published as `final`."""
    console = Console()
    check_output_folder(out)
    if args.data:
        from poise.commands.demo_sims import find_shared_data

        find_shared_data(args.data)  # a --data folder without the data fails before training
    started = time.perf_counter()
    wall: dict[str, float] = {}

    from poise.runtime.launch import warm_fork_server

    # the runs' ranks fork from it: its imports (torch, seconds) overlap this process's own
    # below and the corpus's reading, on another core
    warm_fork_server()

    from poise.commands.expert_clock import expert_seconds_in_turns
    from poise.report.figure_workers import FigureWorkers
    from poise.report.html import DemoData, draw_measured_figures, write_demo_report
    from poise.report.runs import MeasuredRun, loss_agreement
    from poise.report.tables import (
        MEASURED_COLUMNS,
        SIM_COLUMNS,
        breakdown_by_phase,
        measured_rows,
        sim_rows,
    )
    from poise.runtime.plan_inputs import shared_cores
    from poise.trace.trace import Trace
    from poise.train.data import build_corpus
    from poise.util.atomic import atomic_publish_dir, atomic_write_text

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
        f"{mcfg.num_experts} experts of width {mcfg.d_expert} top-{mcfg.top_k}, no aux loss) "
        f"on {WORLD} ranks, {steps} steps per run, seed {first.seed}; corpus {corpus.source} "
        f"({len(corpus.tokens):,} bytes)"
    )
    # the ranks' threads as the launcher sets them (`commands.train`: cores // ranks by default)
    threads = first.threads or max(1, (os.cpu_count() or 1) // WORLD)
    skip = first.replan_every + 2
    clock = partial(
        expert_seconds_in_turns,
        steps=steps,
        d_model=mcfg.d_model,
        d_expert=mcfg.d_expert,
        experts_per_rank=max(1, mcfg.num_experts // WORLD),
        activation=mcfg.activation,
        skip=min(skip, steps - 1),
        every=max(1, min(5, (steps - skip) // 8)),  # every 3rd step (--quick), else 5th
        threads=threads,
    )
    wall[f"train {' and '.join(POLICIES)} in turns ({steps} steps, {WORLD} ranks each)"], timed = (
        train_in_turns([cfgs[p] for p in POLICIES], console, out / "train.turns", clock)
    )
    runs = {p: MeasuredRun.load(cfgs[p].out) for p in POLICIES}
    # the report's workers draw the measured figures while this process simulates, the rest
    # while it writes the page (an error here ends them at the interpreter's exit)
    figures = FigureWorkers(min(FIGURE_WORKERS, os.cpu_count() or 1))
    draw_measured_figures(runs, out, figures)
    traces = {}
    for p, r in runs.items():
        if r.trace_path is None:
            raise DemoError("the run recorded no routing trace", source=str(r.path))
        traces[p] = Trace.load(r.trace_path)
    trace_note = compare_traces(traces["static"], traces["auto"])
    c_s = timed["c_s"]  # timed in the runs' own turns (`poise.commands.expert_clock`)
    cores = shared_cores(WORLD, WORLD, threads=threads)
    summary = measured_summary(runs, skip, c_s, cores)

    sims, missing = simulate_clusters(
        traces["static"], size, args.data, console, quick=bool(args.quick)
    )
    for sec in sims:
        wall[f"simulate {sec.key} ({sec.result.steps} steps)"] = sec.seconds
    t0 = time.perf_counter()
    replays = replay_sections(args.data, size, console)
    wall["trace replays"] = time.perf_counter() - t0

    sim_intro = [
        "Each table below replays a routing trace in the simulator on a modelled cluster with "
        "at least as many experts as devices, as in real expert-parallel training (with fewer "
        "experts than devices, static EP keeps several copies of each expert and there is "
        "little to balance). Every registered policy re-plans from the loads it has already "
        "seen (EMA-predicted), in a planner beside training as the runtime plans, so a plan "
        "takes effect at the first step after its planning time has run (the next step at the "
        "earliest); a re-plan due while the previous plan is still being made is skipped, so a "
        "planner slower than the re-planning interval stretches it and no step waits for it. "
        "Columns: mean step time over all replayed steps, its ratio to static, the busiest "
        "device's load over the mean, bytes moved per step (Trans, Agg, migration), planning "
        "time charged per step (none, beside training) and the planner's CPU time per layer "
        "on this machine."
    ]
    if missing:
        sim_intro.append(
            "Real routing not found: "
            + "; ".join(missing)
            + " (looked in --data, $POISE_SHARED_DATA and ../shared/data), so those tables are "
            "left out and only what was found is replayed."
        )
        console.print(
            "[yellow]real routing not found: " + "; ".join(missing) + "; replaying the "
            "rest[/yellow]"
        )
    settings = {
        "model": f"{first.model}: {mcfg.layers} layers, d_model {mcfg.d_model}, "
        f"{mcfg.num_experts} experts (d_expert {mcfg.d_expert}) top-{mcfg.top_k} in every layer, "
        f"context {mcfg.context}, byte-level",
        "corpus": f"{corpus.source} ({len(corpus.tokens):,} bytes, {corpus.files} files)",
        "training": f"{WORLD} local ranks (gloo, CPU), global batch {first.batch} sequences, "
        f"{steps} steps, AdamW lr {first.lr:g}, seed {first.seed}, no auxiliary loss",
        "policies": f"static EP ({mcfg.num_experts // WORLD} slots per rank) and auto "
        f"(re-plan every {first.replan_every} steps, {first.spare_slots} spare slot per rank)",
        "simulated": ", ".join(f"{s.key} on {s.result.cluster.name}" for s in sims)
        + "; every registered policy, background planning, the dense gradients' all-reduce in "
        "every step",
    }
    data = DemoData(
        runs=runs,
        sims=sims,
        replays=replays,
        settings=settings,
        notes=[trace_note],
        wall_s=wall,
        summary=summary,
        sim_intro=sim_intro,
        replay_intro="The planners alone: each policy's plans priced by the cost model on "
        "FasterMoE's cluster (16 V100, 32 experts), layer by layer, without the work outside "
        "the MoE layers: a check that the policies behave on real and synthetic skew.",
    )
    wall["total before the report"] = time.perf_counter() - started
    atomic_write_text(
        out / "demo.json", json_text(demo_json(summary, sims, missing), str(out / "demo.json"))
    )
    with console.status("writing the report"):
        report = write_demo_report(data, out, figures)
    atomic_publish_dir(out, final)  # the whole folder at once, the previous one replaced
    report = final / Path(report).relative_to(out)
    total = time.perf_counter() - started

    table = Table(title=f"measured on this machine: {WORLD} ranks, {steps} steps per run")
    shown = [0, 2, 4, 5, 6, 7, 8]  # policy, final loss, step, tokens/s, vs static, load, plans
    for i in shown:
        col = MEASURED_COLUMNS[i]
        table.add_column(col, justify="left" if col == "policy" else "right", overflow="fold")
    for row in measured_rows(runs):
        table.add_row(*(row[i] for i in shown))
    console.print(table)
    for line in summary.lines:
        console.print(line)
    agreement = loss_agreement(runs["static"], runs["auto"])
    if agreement.judged:  # one line: agreed, or the warning that they did not
        agrees = "agree to float rounding" if agreement.agrees else "DIFFER beyond rounding"
        console.print(
            f"losses {agrees} up to the first plan change ({agreement.judged_max:.1e} nats/byte)"
        )
    for sec in sims:
        t = Table(
            title=f"{sec.title}: {sec.result.cluster.num_devices:,} devices, "
            f"{sec.result.spec.experts} experts, {sec.result.steps} steps"
        )
        for col in SIM_COLUMNS:
            t.add_column(col, justify="left" if col == "policy" else "right", overflow="fold")
        for row in sim_rows(sec.result):
            t.add_row(*row)
        console.print(t)
        line = sim_line(sec.result)
        if line:
            console.print(line)
    if sims:
        sec = sims[-1]
        fastest = sec.result.summary_rows()[0]["policy"]
        columns, rows = breakdown_by_phase(sec.result, ["static", fastest, "auto"])
        t = Table(title=f"{sec.title}: step time by phase (the report has every table's)")
        for i, col in enumerate(columns):
            t.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
        for row in rows:
            t.add_row(*row)
        console.print(t)
    console.print(f"demo finished in {total:.1f} s")
    console.print(f"report: {report}")
    console.print(f"summary: {final / 'demo.json'}")
    return 0
