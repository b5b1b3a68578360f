"""`poise scenarios`: the published setups of the systems we compare with, ours beside theirs.

Runs the scenarios of `poise.sim.scenarios` (all, or `--only NAME ...`), prints one markdown
table (scenario, setup, system vs baseline, ours, auto, published, source), then `auto`'s check
against every other policy per run and the setups, and writes the same text to
`OUT/scenarios.md` and the full results (every case's mean step times, the checks) to
`OUT/scenarios.json`, both atomically. Progress goes to stderr. Planning runs in a thread beside
training, as the runtime plans (`Scenario.background_planning`); `--inline-planning` charges it
on the critical path instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from poise.core.finite import json_text
from poise.core.outputs import check_output_dir
from poise.sim.scenarios import (
    SCENARIOS,
    ScenarioResult,
    find_shared_data,
    get_scenario,
    markdown_table,
    results_json,
    run_scenario,
)
from poise.util.atomic import atomic_write_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scenarios",
        help="the papers' setups (FasterMoE, Pro-Prophet, SmartMoE, FlexMoE, HybridEP, "
        "1,000 datacentres) in the simulator, our figures beside the published ones",
        description="Replay the published setups of FasterMoE, Pro-Prophet, SmartMoE, FlexMoE, "
        "HybridEP and a 1,000-datacentre case in the simulator; print one table of our "
        "figures beside the published ones and write OUT/scenarios.md and OUT/scenarios.json. "
        "The SmartMoE cases replay the SmartMoE-AE sample from --data.",
    )
    p.add_argument(
        "--only",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME",
        help=f"run only these scenarios (known: {', '.join(SCENARIOS)})",
    )
    p.add_argument("--out", default="poise-out", help="output folder (default poise-out)")
    p.add_argument(
        "--quick", action="store_true", help="reduced forms: fewer cases and steps (seconds)"
    )
    p.add_argument(
        "--data",
        default=None,
        help="folder with smartmoe-ae-sample/ (default $POISE_SHARED_DATA or ../shared/data)",
    )
    p.add_argument(
        "--inline-planning",
        action="store_true",
        help="charge each plan's time on the critical path of the step it is made in, instead "
        "of planning in a thread beside training as the runtime does (each scenario's default)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(args.only)) if args.only else list(SCENARIOS)
    scenarios = [get_scenario(n) for n in names]  # unknown names fail before any work
    out = check_output_dir(args.out, "--out")
    if args.data is not None:
        find_shared_data(args.data)  # a --data folder without the sample fails here
    if args.inline_planning:
        scenarios = [
            dataclasses.replace(
                s,
                background_planning=False,
                planning_note="planning wall time charged on the critical path of the step "
                "each plan is made in (--inline-planning)",
            )
            for s in scenarios
        ]
    err = Console(stderr=True)
    results: list[ScenarioResult] = []
    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} runs"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        for scenario in scenarios:
            runs = len(scenario.cases_for(args.quick)) * len(scenario.runs)
            task = progress.add_task(scenario.name, total=runs)

            def report(what: str, done: int, total: int, task=task) -> None:
                progress.update(task, description=what, completed=done)

            results.append(
                run_scenario(scenario, quick=args.quick, data=args.data, progress=report)
            )
            progress.update(task, description=scenario.name, completed=runs)
    wall = time.perf_counter() - started
    text = markdown_table(results)
    sys.stdout.write(text)
    md, js = out / "scenarios.md", out / "scenarios.json"
    atomic_write_text(md, text)
    payload = results_json(results)
    payload["wall_s"] = wall
    payload["quick"] = bool(args.quick)
    atomic_write_text(js, json_text(payload, str(js), default=_jsonable))
    slower = [c for r in results for c in r.checks if not c.auto_fastest]
    err.print(f"scenarios: {len(results)} run in {wall:.1f} s; wrote {md} and {js}")
    if slower:
        gaps = [c.gap_in_se for c in slower if c.gap_in_se is not None]
        within = f"; largest gap {max(gaps):.1f} standard errors" if gaps else ""
        err.print(
            f"[yellow]auto is slower than another policy in {len(slower)} run(s){within}; "
            "see the check table[/yellow]"
        )
    return 0


def _jsonable(value: object) -> object:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
