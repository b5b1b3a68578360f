"""The demo's tables as rows of strings: simulated policies, their step broken down by phase,
trace replays and measured runs (`poise.report.html` puts them on the page, `poise demo` and
`poise simulate` on the console)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from poise.report.runs import MeasuredRun

SIM_COLUMNS = (
    "policy",
    "step time (ms)",
    "vs static",
    "device max/mean",
    "GB moved/step",
    "planning ms/step",
    "planner ms/layer",
)


def sim_rows(result: Any) -> list[list[str]]:
    """Rows of `SIM_COLUMNS` for a `SimResult`, fastest policy first (the `poise simulate`
    table, the demo's and the report's)."""
    rows = []
    for row in result.summary_rows():
        speedup = row["speedup_vs_static"]
        rows.append(
            [
                row["policy"],
                f"{row['mean_step_s'] * 1e3:,.2f}",
                "" if speedup is None else f"{speedup:.2f}x",
                f"{row['max_over_mean']:.2f}",
                f"{row['bytes_moved_per_step'] / 1e9:,.3f}",
                f"{row['planning_s_per_step'] * 1e3:.2f}",
                f"{row['plan_ms_per_layer']:.2f}",
            ]
        )
    return rows


# The step's work by phase for the breakdown tables: label -> the `PolicyRun.phase_totals` keys
# it sums (seconds of work per step; dispatch and combine count forward and backward). Every
# key `phase_totals` returns is in exactly one group (tests/test_demo.py checks).
BREAKDOWN_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-to-all", ("dispatch_s", "combine_s")),
    ("expert compute", ("expert_fwd_s", "expert_bwd_s")),
    ("dense compute", ("non_moe_fwd_s", "non_moe_bwd_s")),
    ("dispatcher host", ("dispatch_host_fwd_s", "dispatch_host_bwd_s")),
    ("Trans/Agg", ("trans_s", "agg_s")),
    ("migration", ("migrate_s",)),
    ("dense all-reduce", ("grad_allreduce_s",)),
    ("counts, clip, optimizer", ("counts_s", "clip_s", "optimizer_s")),
    ("planning", ("planning_s",)),
)
# Shown even when zero for every policy; the other groups only where some policy has them.
BREAKDOWN_ALWAYS = (
    "all-to-all",
    "expert compute",
    "dense compute",
    "Trans/Agg",
    "migration",
    "dense all-reduce",
    "planning",
)
STEP_LABEL = "step"
OVERLAP_LABEL = "overlapped"  # step time minus the work: < 0 under an overlapping schedule


def step_breakdown(result: Any) -> dict[str, dict[str, float]]:
    """Per policy of a `SimResult`, fastest first: its mean step time (`STEP_LABEL`) and its
    work per step by phase (`BREAKDOWN_GROUPS`), seconds. Under the `sync` schedule the phases
    add up to the step time; an overlapping schedule hides part of the work, given as a negative
    `OVERLAP_LABEL` (step time minus the work). Groups that are zero for every policy and not in
    `BREAKDOWN_ALWAYS` are left out, and so is `OVERLAP_LABEL` when nothing overlaps."""
    order = [row["policy"] for row in result.summary_rows()]
    out: dict[str, dict[str, float]] = {}
    for k in order:
        totals = result.runs[k].phase_totals()
        step = result.runs[k].mean_step_s
        work = {label: sum(totals[n] for n in names) for label, names in BREAKDOWN_GROUPS}
        out[k] = {STEP_LABEL: step, **work, OVERLAP_LABEL: step - sum(work.values())}
    unused = {
        label
        for label, _ in BREAKDOWN_GROUPS
        if label not in BREAKDOWN_ALWAYS and all(out[k][label] == 0 for k in order)
    }
    if all(abs(out[k][OVERLAP_LABEL]) <= 1e-9 * out[k][STEP_LABEL] for k in order):
        unused.add(OVERLAP_LABEL)
    return {k: {n: v for n, v in row.items() if n not in unused} for k, row in out.items()}


def breakdown_table(result: Any) -> tuple[list[str], list[list[str]]]:
    """`step_breakdown` of a `SimResult` as `(columns, rows)`: one row per policy, fastest
    first, ms per step."""
    parts = step_breakdown(result)
    labels = list(next(iter(parts.values())))
    columns = ["policy", *(f"{label} (ms)" for label in labels)]
    rows = [[k, *(f"{row[n] * 1e3:,.2f}" for n in labels)] for k, row in parts.items()]
    return columns, rows


def breakdown_by_phase(result: Any, policies: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """`step_breakdown` of a `SimResult` turned on its side for a narrow console:
    `(columns, rows)` with one row per phase and one column per policy of `policies` (those the
    result has), ms per step."""
    parts = step_breakdown(result)
    names = [k for k in dict.fromkeys(policies) if k in parts]
    labels = list(next(iter(parts.values())))
    columns = ["ms per step", *names]
    rows = [[label, *(f"{parts[k][label] * 1e3:,.2f}" for k in names)] for label in labels]
    return columns, rows


REPLAY_COLUMNS = (
    "policy",
    "device max/mean",
    "step time (ms)",
    "speedup",
    "GB moved/step",
    "planner ms/layer",
)


def replay_rows(runs: dict[str, Any]) -> list[list[str]]:
    """Rows of `REPLAY_COLUMNS` for `PolicyRun`s, fastest first."""
    static = runs["static"].mean_step_s if "static" in runs else None
    rows = []
    for name, r in sorted(runs.items(), key=lambda kv: kv[1].mean_step_s):
        rows.append(
            [
                name,
                f"{r.max_over_mean.mean():.2f}",
                f"{r.mean_step_s * 1e3:,.1f}",
                f"{static / r.mean_step_s:.2f}x" if static else "",
                f"{np.mean(r.bytes_moved) / 1e9:.3f}",
                f"{r.plan_ms_per_layer:.2f}",
            ]
        )
    return rows


MEASURED_COLUMNS = (
    "policy",
    "steps",
    "final loss",
    "val loss",
    "median step (ms)",
    "tokens/s",
    "vs static",
    "rank max/mean",
    "plan changes",
    "MB moved/step",
)


def measured_rows(runs: dict[str, MeasuredRun]) -> list[list[str]]:
    """Rows of `MEASURED_COLUMNS`, in the order of `runs`."""
    base = runs["static"].tokens_per_s if "static" in runs else None
    rows = []
    for name, r in runs.items():
        rows.append(
            [
                name,
                str(len(r.steps)),
                f"{r.losses[-1]:.4f}",
                f"{r.val[-1][1]:.4f}" if r.val else "",
                f"{r.median_step_s * 1e3:,.1f}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.tokens_per_s / base:.3f}x" if base else "",
                f"{r.max_over_mean:.3f}",
                str(r.plan_changes),
                f"{r.bytes_moved.mean() / 1e6:.2f}",
            ]
        )
    return rows
