"""Scenario results as a markdown table and as JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from poise.sim.scenarios.core import ScenarioResult

# --------------------------------------------------------------------------- output


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def markdown_table(results: Sequence[ScenarioResult]) -> str:
    """The comparison table (one row per published figure), then `auto`'s check per run."""
    lines = [
        "| scenario | setup | system vs baseline | ours | auto | published | source |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for res in results:
        for r in res.rows:
            lines.append(
                f"| {r.scenario} | {r.setup} | {r.comparison} | {_x(r.ours)} | {_x(r.auto)} "
                f"| {r.published_text} | {r.source} |"
            )
    lines += [
        "",
        "`auto` against the fastest other policy of each run (one case under one schedule, every "
        "policy on the same trace), mean step time over the measured steps, with the planner's "
        "measured wall time charged and without it (the cost model's time alone); the figures "
        "above use the column the scenario's setup names. A ratio above 1 is flagged **slower**; "
        "in the figures' column the flag gives auto's gap in standard errors of the paired "
        "difference, from the means of its re-planning windows (steps under one plan share "
        "its forecast error):",
        "",
        "| scenario | case | schedule | auto, planning charged (s) | fastest other | auto / other "
        "| auto, not charged (s) | fastest other | auto / other |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for res in results:
        for c in res.checks:
            flag_c = _slower(c.ratio_charged, c.gap_in_se if c.count_planning else None)
            flag_p = _slower(c.ratio_priced, None if c.count_planning else c.gap_in_se)
            lines.append(
                f"| {c.scenario} | {c.case} | {c.schedule} | {c.auto_charged_s:.4g} | "
                f"{c.best_charged} {c.best_charged_s:.4g} | {c.ratio_charged:.4f}{flag_c} | "
                f"{c.auto_priced_s:.4g} | {c.best_priced} {c.best_priced_s:.4g} | "
                f"{c.ratio_priced:.4f}{flag_p} |"
            )
    lines += ["", "Setups:", ""]
    for res in results:
        s = res.scenario
        replay = (
            ""
            if s.runner is not None  # not a trace replay: no re-planning, warm-up or forecast
            else f"Re-plan every {s.replan_every} steps ({s.predictor} forecast), first "
            f"{s.warmup_steps} steps warm-up (not in the means), "
        )
        lines.append(
            f"- **{s.name}** ({s.paper}): {s.summary}. {replay}{s.planning_note}. Traces: "
            + "; ".join(sorted(set(res.trace_notes.values())))
            + ". "
            + " ".join(s.notes)
            + f" ({res.wall_s:.1f} s)"
        )
    return "\n".join(lines) + "\n"


def results_json(results: Sequence[ScenarioResult]) -> dict[str, Any]:
    return {"scenarios": [r.as_dict() for r in results]}


def _slower(ratio: float, gap_in_se: float | None) -> str:
    """The flag of a ratio above 1, with the gap in standard errors where it is known (the
    figures' column; `replay.paired_gap_se`)."""
    if ratio <= 1.0:
        return ""
    return " **slower**" if gap_in_se is None else f" **slower** ({gap_in_se:.1f} SE)"
