"""`poise layouts TRACE`: SmartMoE's offline pool of hybrid parallel layouts for a trace.

Enumerates the layouts (pipeline stages, expert-parallel degree, expert-data-parallel replicas,
experts per device) of the cluster and model, prices each on the trace's load distribution
with `poise.layouts.price.rank_layouts` (with the expert placement the online `permute` would
choose, unless `--static`), prints them ranked and marks the pool; `--json OUT` writes
everything, atomically.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from poise.commands.options import (
    MODEL_HELP,
    SCHEDULE_HELP,
    add_cluster_arg,
    check_cluster_size,
    cluster_for_trace,
    model_for_trace,
)
from poise.core.finite import json_text
from poise.core.outputs import check_output_file
from poise.core.presets import get_cluster
from poise.cost.schedule import parse_schedule
from poise.layouts.pool import LayoutSettings
from poise.layouts.price import LayoutSearch, rank_layouts
from poise.trace.loads import fit_devices, require_tokens
from poise.util.argparsing import int_in
from poise.util.atomic import atomic_write_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "layouts",
        help="rank hybrid parallel layouts (pipeline, expert, expert-data) on a trace",
        description="SmartMoE's offline stage: price every layout of the cluster (pipeline "
        "stages x expert-parallel groups x expert-data-parallel replicas) on TRACE's loads "
        "(.npz, SmartMoE-AE folder, EPLB weights, expert-count JSON) and keep the best --pool.",
    )
    p.add_argument("trace", help="routing trace")
    add_cluster_arg(p)
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--pool", type=int_in(1), default=4, help="layouts kept in the pool (default 4)")
    p.add_argument(
        "--micro-batches",
        type=int_in(1, 4096),
        default=4,
        help="pipeline micro-batches per step (default 4)",
    )
    p.add_argument(
        "--steps",
        type=int_in(1),
        default=32,
        help="price at most N evenly spaced steps (default 32)",
    )
    p.add_argument(
        "--max-pp",
        type=int_in(1),
        default=None,
        help="largest pipeline degree tried (default: all)",
    )
    p.add_argument("--schedule", default="sync", help=SCHEDULE_HELP)
    p.add_argument(
        "--static",
        action="store_true",
        help="price the static expert placement only (no online permute inside each layout)",
    )
    p.add_argument("--all", action="store_true", help="print every layout, not only the top 12")
    p.add_argument(
        "--json", default=None, metavar="OUT", help="write the ranking as JSON (default: none)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poise.trace.importers import load_any

    if args.json:
        check_output_file(args.json, "--json")
    settings = LayoutSettings(
        pool=args.pool,
        micro_batches=args.micro_batches,
        max_steps=args.steps,
        online=not args.static,
        max_pp=args.max_pp,
        schedule=parse_schedule(args.schedule),
    )
    if args.cluster is not None:  # a bad --cluster fails before the trace is read
        check_cluster_size(get_cluster(args.cluster), "--cluster")
    trace = load_any(args.trace)
    require_tokens(trace, args.trace)
    cluster = cluster_for_trace(args.cluster, trace, args.trace)
    spec = model_for_trace(args.model, trace, args.trace)
    loads = fit_devices(trace.counts, cluster.num_devices, args.trace)
    search = rank_layouts(loads, cluster, spec, settings)
    meta = {
        "trace": str(args.trace),
        "trace_devices": trace.devices,
        "cluster": cluster.name,
        "devices": cluster.num_devices,
        "model": spec.name,
    }
    if args.json:  # the file before the console: a reader that closes early loses nothing
        atomic_write_text(args.json, json_text({**meta, **search.to_dict()}, str(args.json)))
    _print(search, meta, args.all)
    if args.json:
        Console().print(f"layouts written to {args.json}")
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _print(search: LayoutSearch, meta: dict[str, Any], show_all: bool) -> None:
    console = Console()
    s = search.settings
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"poise layouts: {meta['model']} on {meta['cluster']} ({meta['devices']} "
        f"devices), {search.steps_priced} step(s) priced, "
        f"{'online permute' if s.online else 'static placement'}, {s.micro_batches} "
        f"micro-batches",
    )
    columns = ("#", "layout", "step ms", "static ms", "a2a", "expert", "bubble", "EDP ar", "GiB")
    for col in columns:
        if col == "layout":
            table.add_column(col, no_wrap=True, min_width=13)
        else:
            table.add_column(col, justify="right", overflow="fold")
    shown = search.ranked if show_all else search.ranked[: max(12, s.pool)]
    for i, c in enumerate(shown):
        table.add_row(
            f"{i + 1}{'*' if i < s.pool else ''}",
            c.layout.name,
            _ms(c.step_s),
            _ms(c.static_s),
            _ms(c.a2a_s),
            _ms(c.expert_s),
            _ms(c.bubble_s),
            _ms(c.edp_allreduce_s),
            f"{c.memory_bytes / 2**30:.1f}",
        )
    console.print(table)
    console.print(
        "* in the pool. ms per step, mean over the priced steps; static: without the online "
        "permute; a2a, expert: slowest stage, forward and backward; bubble: pipeline fill and "
        "drain; EDP ar: expert gradient all-reduce; GiB: expert and dense state per device "
        "(the JSON has every phase)"
    )
    hidden = len(search.ranked) - len(shown)
    if hidden:
        console.print(f"{hidden} slower layout(s) not shown (--all shows them)")
    for layout, why in search.rejected:
        console.print(f"rejected {layout.name}: {why}")
    best = search.ranked[0]
    console.print(f"pool: {', '.join(c.layout.name for c in search.pool)}")
    console.print(f"best: {best.layout.describe()}")
    pure_ep = next((c for c in search.ranked if c.layout.pp == 1 and c.layout.edp == 1), None)
    if pure_ep is not None and pure_ep is not best:
        console.print(
            f"predicted step time: pure EP ({pure_ep.layout.name}) {_ms(pure_ep.step_s)} ms "
            f"-> {best.layout.name} {_ms(best.step_s)} ms ({pure_ep.step_s / best.step_s:.2f}x)"
        )
