"""`poise simulate TRACE`: replay a routing trace on a modelled cluster under every policy.

Prints a table (rich), writes `summary.json`, `steps.csv` (per step and policy), `layers.csv`
(per step, layer and policy: the phase breakdown) and plots (`step_time.png`, `breakdown.png`,
`device_load.png`) to `--out`. A trace recorded on fewer ranks than the cluster has devices is
scaled by resampling its source rows; the output says so. Planning runs in the background by
default, as in the runtime (`--no-background-planning` charges it on the critical path).
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from poise.commands.options import (
    MAX_SLOTS,
    MODEL_HELP,
    OPTION_HELP,
    SCHEDULE_HELP,
    add_cluster_arg,
    check_cluster_size,
    check_plan_size,
    cluster_for_trace,
    model_for_trace,
    parse_options,
)
from poise.core.budget import check_fits
from poise.core.errors import ConfigError
from poise.core.finite import json_text, require_finite
from poise.core.outputs import check_output_dir
from poise.core.presets import get_cluster
from poise.cost.schedule import parse_schedule
from poise.plan.policies import REGISTRY
from poise.plan.predict import parse_predictor
from poise.report.tables import SIM_COLUMNS, sim_rows
from poise.sim.simulator import PHASES, SimResult, simulate
from poise.trace.loads import require_tokens
from poise.util.argparsing import int_in
from poise.util.atomic import atomic_write_text

DEFAULT_REPLAN_EVERY = 10


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a routing trace on a modelled cluster under every policy",
        description="Replay TRACE (.npz, SmartMoE-AE folder, EPLB weights, expert-count JSON) "
        "step by step: each policy re-plans from predicted loads every --replan-every steps and "
        "is priced on each step's actual loads.",
    )
    p.add_argument("trace", help="routing trace")
    add_cluster_arg(p)
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument(
        "--policies", default="all", help="comma-separated policies (default all registered)"
    )
    p.add_argument("--schedule", default="sync", help=SCHEDULE_HELP)
    p.add_argument(
        "--replan-every",
        type=int_in(1),
        default=None,
        help=f"steps between re-plans (default {DEFAULT_REPLAN_EVERY}, or half the trace's "
        "steps if it is shorter, so that it is re-planned at least once)",
    )
    p.add_argument(
        "--steps", type=int_in(1), default=None, help="replay the first N steps (default all)"
    )
    p.add_argument(
        "--predictor", default="ema", help="last, window[:w] or ema[:alpha] (default ema)"
    )
    p.add_argument(
        "--slots",
        type=int_in(1, MAX_SLOTS),
        default=None,
        help="slots per device (default: ceil(experts/devices) + 1)",
    )
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="seed of the trace scaling")
    p.add_argument(
        "--no-planning-time",
        action="store_true",
        help="do not charge measured planner time to the steps",
    )
    p.add_argument(
        "--background-planning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan in a thread beside training, as the runtime's Balancer does (the default): "
        "plans take effect one step later and only planning time beyond that step is charged; "
        "--no-background-planning charges planning on the critical path of the step it is "
        "made in",
    )
    p.add_argument(
        "--split-tokens",
        action="store_true",
        help="split each step's tokens of a replicated expert among its holders by that step's "
        "counts, as the runtime's Balancer does by default (off: by the plans' fixed shares)",
    )
    p.add_argument(
        "--retarget",
        action="store_true",
        help="re-choose a plan's replicas at each step from the step before's counts, homes "
        "staying, as the runtime's Balancer does by default (poise.plan.retarget; off: the "
        "plans' own replicas)",
    )
    p.add_argument(
        "--option", action="append", default=[], metavar="POLICY.KEY=VALUE", help=OPTION_HELP
    )
    p.add_argument(
        "--dense-params",
        type=int_in(0),
        default=None,
        metavar="N",
        help="replicated parameters whose gradients every step all-reduces across the devices "
        "(default: the model's dense blocks, moe_layers x F_d / 2; 0: time the MoE layers alone)",
    )
    p.add_argument(
        "--out", default="poise-out/simulate", help="output folder (default poise-out/simulate)"
    )
    p.set_defaults(run=run)


def _policies(text: str) -> list[str]:
    from poise.plan.policies import registry  # noqa: F401  (fills the registry)

    if text == "all":
        return sorted(REGISTRY)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("no policy named", source=text, field="--policies")
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ConfigError(
            f"unknown policy {', '.join(unknown)} (known: {', '.join(sorted(REGISTRY))})",
            source="--policies",
            field="policy",
        )
    return names


def run(args: argparse.Namespace) -> int:
    from poise.report.plots import breakdown_plot, device_load_heatmaps, step_time_plot
    from poise.trace.importers import load_any

    console = Console(stderr=True)
    out = check_output_dir(args.out, "--out")
    options = parse_options(args.option)
    schedule = parse_schedule(args.schedule)
    predictor = parse_predictor(args.predictor)
    if args.cluster is not None:  # a bad --cluster fails before the trace is read
        check_cluster_size(get_cluster(args.cluster), "--cluster")
    names = _policies(args.policies)
    trace = load_any(args.trace)
    require_tokens(trace, args.trace)
    cluster = cluster_for_trace(args.cluster, trace, args.trace)
    spec = model_for_trace(args.model, trace, args.trace)
    dense = spec.dense_params if args.dense_params is None else int(args.dense_params)
    steps = trace.steps if args.steps is None else min(args.steps, trace.steps)
    slots = args.slots if args.slots is not None else -(-spec.experts // cluster.num_devices) + 1
    check_plan_size(trace.layers, cluster.num_devices, slots, spec.experts, steps=1)
    check_fits(
        steps * trace.layers * cluster.num_devices * (spec.experts + 4 * len(names)) * 8,
        f"replaying {steps} steps x {trace.layers} layers on {cluster.num_devices} devices "
        f"under {len(names)} policies",
        source="--cluster",
        field="size",
        hint="use fewer --steps, a smaller --cluster or fewer --policies",
    )
    replan_every = _replan_every(args.replan_every, steps, console)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create output folder: {exc.strerror or exc}", source=args.out, field="--out"
        ) from None
    console.print(
        f"simulating {steps} steps x {len(names)} policies of {trace.name} on {cluster.name} "
        f"({cluster.num_devices} devices), model {spec.name}, re-plan every {replan_every}"
    )
    columns = (
        TextColumn("simulating"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} policy-steps"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("simulate", total=steps * len(names))
        result = simulate(
            trace,
            cluster,
            spec,
            names,
            schedule,
            replan_every,
            predictor,
            slots_per_device=args.slots,
            steps=args.steps,
            options=options,
            seed=args.seed,
            count_planning=not args.no_planning_time,
            background_planning=args.background_planning,
            dense_params=dense,
            split_tokens=args.split_tokens,
            retarget=args.retarget,
            progress=lambda done, total: bar.update(task, completed=done),
        )
    # every figure finite before anything is written (a plot of inf fails half-way)
    require_finite({n: r.step_s for n, r in result.runs.items()}, str(out / "summary.json"))
    # every file first: a reader of the table that closes early (`| head`) loses none of them
    _write_outputs(result, out, args.trace)
    title = f"{Path(args.trace).name} on {cluster.name} ({schedule.name})"
    step_time_plot({k: r.step_s for k, r in result.runs.items()}, out / "step_time.png", title)
    order = [row["policy"] for row in result.summary_rows()]
    breakdown_plot(
        {k: result.runs[k].phase_totals() for k in order},
        out / "breakdown.png",
        title,
        {k: result.runs[k].mean_step_s for k in order},
    )
    shown = [k for k in ("static", order[0]) if k in result.runs]
    device_load_heatmaps(
        {k: result.runs[k].device_load for k in dict.fromkeys(shown)},
        out / "device_load.png",
        f"{title}: device load per step",
    )
    Console().print(_table(result))
    Console().print(headline(result), soft_wrap=True)
    console.print(result.scaling)
    console.print(f"wrote {out}/summary.json, steps.csv, layers.csv and 3 plots")
    return 0


def _replan_every(given: int | None, steps: int, console: Console) -> int:
    """`--replan-every`, or the default fitted to the trace: a trace no longer than the interval
    is never re-planned (every policy would tie with static), so the default shrinks to half
    the trace, and an explicit interval that long is warned about."""
    if given is None:
        fitted = min(DEFAULT_REPLAN_EVERY, max(1, steps // 2))
        if fitted != DEFAULT_REPLAN_EVERY:
            console.print(
                f"note: the trace has {steps} steps; re-planning every {fitted} step(s) "
                f"instead of {DEFAULT_REPLAN_EVERY} so that it is re-planned (--replan-every)"
            )
        return fitted
    if given >= steps:
        console.print(
            f"[yellow]warning: --replan-every {given} >= the {steps} steps replayed: no policy "
            "ever re-plans after the first step, so all match static; use a smaller "
            "--replan-every[/yellow]"
        )
    return given


def headline(result: SimResult) -> str:
    """The table's key figures as one line, printed below it so a narrow terminal that folds
    the table still shows them whole."""
    rows = result.summary_rows()
    best = rows[0]
    text = f"fastest: {best['policy']} {best['mean_step_s'] * 1e3:,.2f} ms/step"
    if best["speedup_vs_static"] is not None and best["policy"] != "static":
        static = result.runs["static"].mean_step_s
        text += f", {best['speedup_vs_static']:.2f}x static ({static * 1e3:,.2f} ms/step)"
    return text + f"; {best['bytes_moved_per_step'] / 1e9:,.3f} GB moved/step"


def _table(result: SimResult) -> Table:
    c, s = result.cluster, result.spec
    table = Table(
        title=f"{result.trace_name}: {result.steps} steps on {c.name} ({c.num_devices} devices), "
        f"{s.experts} experts top-{s.top_k}, schedule {result.schedule.name}, "
        f"re-plan every {result.replan_every}, predictor {result.predictor.name}"
    )
    for col in SIM_COLUMNS:
        table.add_column(col, justify="left" if col == "policy" else "right", overflow="fold")
    for row in sim_rows(result):
        table.add_row(*row)
    return table


def _csv(rows: list[list[object]], header: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def _write_outputs(result: SimResult, out: Path, trace_path: str) -> None:
    summary = {
        "trace": trace_path,
        "cluster": result.cluster.name,
        "devices": result.cluster.num_devices,
        "model": result.spec.name,
        "experts": result.spec.experts,
        "layers": result.spec.moe_layers,
        "schedule": result.schedule.name,
        "predictor": result.predictor.name,
        "replan_every": result.replan_every,
        "steps": result.steps,
        "scaling": result.scaling,
        "policies": result.summary_rows(),
    }
    atomic_write_text(out / "summary.json", json_text(summary, str(out / "summary.json"), indent=2))
    step_rows: list[list[object]] = []
    layer_rows: list[list[object]] = []
    for name, r in result.runs.items():
        for s in range(result.steps):
            step_rows.append(
                [
                    s,
                    name,
                    f"{r.step_s[s]:.6g}",
                    f"{r.plan_s[s]:.6g}",
                    f"{r.max_over_mean[s]:.6g}",
                    f"{r.bytes_moved[s]:.6g}",
                ]
            )
            for layer in range(r.layer_s.shape[1]):
                layer_rows.append(
                    [s, layer, name, f"{r.layer_s[s, layer]:.6g}"]
                    + [f"{r.phases[k][s, layer]:.6g}" for k in PHASES]
                )
    atomic_write_text(
        out / "steps.csv",
        _csv(
            step_rows,
            ["step", "policy", "step_s", "planning_s", "max_over_mean", "bytes_moved"],
        ),
    )
    atomic_write_text(
        out / "layers.csv", _csv(layer_rows, ["step", "layer", "policy", "layer_s", *PHASES])
    )
