"""The words and figures of `poise demo`'s report: what each simulated table shows
(`sim_note`), whether the two runs routed alike (`compare_traces`), the measured runs against
their ideal (`measured_summary`) and `OUT/demo.json` (`demo_json`). Pure: results in, text and
plain data out; `poise.commands.demo` runs the demo and writes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from poise.report.gain_accounting import gain_accounting

if TYPE_CHECKING:
    from poise.report.html import MeasuredSummary


def sim_note(result) -> str:
    """What a simulated table shows, in words: who wins, by how much, and what static pays."""
    rows = result.summary_rows()
    if "static" not in result.runs or not rows:
        return ""
    static_ms = 1e3 * result.runs["static"].mean_step_s
    best = rows[0]["policy"]
    best_ms = 1e3 * result.runs[best].mean_step_s
    parts = [
        f"Static's step is {static_ms:,.2f} ms with its busiest device at "
        f"{float(result.runs['static'].max_over_mean.mean()):.2f}x the mean load."
    ]
    if "auto" in result.runs:
        auto_ms = 1e3 * result.runs["auto"].mean_step_s
        plan_ms = 1e3 * float(result.runs["auto"].plan_s.mean())
        charged = (
            f", of which {plan_ms:,.2f} ms per step is planning time charged to the steps"
            if plan_ms > 0
            else ""
        )
        parts.append(f"auto: {auto_ms:,.2f} ms ({static_ms / auto_ms:.2f}x static){charged}.")
        if best != "auto":
            parts.append(
                f"The fastest here is {best} ({best_ms:,.2f} ms, {static_ms / best_ms:.2f}x): "
                f"auto is {auto_ms / best_ms:.2f}x its step."
            )
            late = plan_delay_note(result.runs["auto"], result.runs[best], best)
            missed = forecast_miss_note(result.runs["auto"], result.runs[best], best)
            parts.extend(note for note in (late, missed) if note)
        else:
            parts.append("auto is the fastest policy here.")
    outside = result.runs["static"].outside_s
    if "grad_allreduce_s" in outside:
        grad_ms = 1e3 * float(outside["grad_allreduce_s"].mean())
        parts.append(
            f"Every policy's step includes the all-reduce of the model's "
            f"{result.spec.dense_params:,} replicated (dense) parameters' gradients "
            f"({grad_ms:,.2f} ms), as poise simulate charges it; the steps before the first "
            "plan takes effect run static's placement in every policy."
        )
    return " ".join(parts)


def plan_delay_note(auto, best, best_name: str) -> str:
    """Why `auto` trails `best` where its plans come later (`PolicyRun.plan_delays`), in
    words; empty where they do not."""
    if not auto.plan_delays or auto.mean_plan_delay <= best.mean_plan_delay:
        return ""
    cpu_ms = 1e3 * float(auto.plan_wall_s[auto.plan_wall_s > 0].mean())
    skipped = len(auto.skipped_replans)
    stretched = (
        f" {skipped} of its {skipped + len(auto.plan_ms)} re-plans came while the last plan was "
        f"still being made and {'was' if skipped == 1 else 'were'} skipped."
        if skipped
        else ""
    )
    return (
        f"auto's plans took effect {auto.mean_plan_delay:.1f} steps after their request on "
        f"average, {best_name}'s {best.mean_plan_delay:.1f}: auto prices every policy's plan, "
        f"{cpu_ms:,.1f} ms of this host's CPU per re-plan, and a plan serves only once made."
        + stretched
    )


def forecast_miss_note(auto, best, best_name: str) -> str:
    """Why `auto` trails `best` where its last re-plan priced `best`'s plan slower than its own
    choice on the forecast it planned on (`notes["candidate_step_s"]`, the cost model's step
    on the forecast), yet `best` ran faster on the steps that came: the loads departed from the
    forecast, and `best`'s placement held up better. Empty where auto's pricing did not rank
    `best` below its choice (another reason, or none found)."""
    plan = auto.last_plan
    priced = plan.notes.get("candidate_step_s", {}) if plan is not None else {}
    if best_name not in priced or not priced:
        return ""
    chosen_s, best_s = min(priced.values()), priced[best_name]
    made = np.nonzero(auto.plan_wall_s > 0)[0]
    if best_s <= chosen_s * (1 + 1e-9) or not len(made) or not auto.plan_delays:
        return ""
    start = int(made[-1]) + int(auto.plan_delays[-1])  # the last plan's steps in force
    ran_auto, ran_best = float(auto.step_s[start:].mean()), float(best.step_s[start:].mean())
    if start >= len(auto.step_s) or ran_best >= ran_auto:
        return ""
    copies = ""
    if best.last_plan is not None and plan is not None:
        extra = [int(r.last_plan.placement.copies.sum() - r.last_plan.placement.home.size)
                 for r in (auto, best)]  # fmt: skip
        copies = f" ({best_name}'s {extra[1]:,} replicas against auto's {extra[0]:,})"
    return (
        f"auto's last re-plan priced its choice at {1e3 * chosen_s:,.2f} ms a step on the "
        f"forecast and {best_name}'s plan at {1e3 * best_s:,.2f} ms; from step {start}, where it "
        f"took effect, the steps ran at {1e3 * ran_auto:,.2f} ms and {1e3 * ran_best:,.2f} ms: "
        "the forecast "
        f"(a mean of loads that differ from step to step) is flatter than the steps, and "
        f"{best_name}'s placement held up better on the steps as they came{copies}."
    )


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


def measured_summary(runs: dict, skip: int, c_s: float, cores: float = 0.0) -> MeasuredSummary:
    """Static and auto tokens/s over the steps after `skip`, the ideal of the static run with
    `c_s` seconds per routed token of expert work (its ranks sharing `cores` cores' worth of
    compute, 0: none, `poise.report.ideal`) and where its gain went; `lines` for the console
    (at most 3), `paragraphs` for the report."""
    from poise.report.html import MeasuredSummary
    from poise.report.ideal import ideal_of, judge, measured_steps, tokens_per_s

    static, auto = runs["static"], runs["auto"]
    st, au = tokens_per_s(static, skip), tokens_per_s(auto, skip)
    ideal = ideal_of(static, c_s, skip, cores=cores)
    speedup, ideal_speedup = au / st, ideal["ideal_speedup"]
    verdict = judge(speedup, ideal_speedup)
    steps = len(static.step_s[measured_steps(static.step_s, skip)])
    in_turns = bool(static.config.get("turns")) and bool(auto.config.get("turns"))
    same_steps = len(static.step_s) == len(auto.step_s)
    accounting = gain_accounting(static, auto, c_s, skip, cores=cores) if same_steps else None
    share = verdict["gain_fraction"] if ideal_speedup > 1.0 else None
    lines = [f"auto {speedup:.2f}x static over {steps} steps; the ideal (balance for free) "
             f"{ideal_speedup:.2f}x"]  # fmt: skip
    if share is not None:
        lines.append(
            f"auto kept {share:.0%} of the possible gain; the report says where the rest went"
        )
    clock = paired_clock_sentence(getattr(auto, "last_evidence", {}) or {}).strip()
    paragraphs = [
        f"Over the {steps} steps after the warm-up (re-planning and switch steps included) auto "
        f"trained at {au:,.0f} tokens/s against static's {st:,.0f}: {speedup:.3f}x."
        + (
            " The two runs took their steps in turns, so the machine's drift fell on both alike."
            if in_turns
            else ""
        ),
        f"The ideal, {ideal_speedup:.3f}x, is the static run with its experts perfectly balanced "
        f"for free: the slowest rank computed {ideal['max_over_mean']:.2f}x the mean rank's "
        f"token-expert pairs, {ideal['slowest_expert_ms']:.0f} ms of expert work a step where "
        f"balance would take {ideal['balanced_expert_ms']:.0f} ms (at {c_s * 1e6:.2f} us per "
        f"routed token, measured in the runs' turns), beside {ideal['non_expert_ms']:.0f} ms of "
        "everything else.",
    ]
    if clock:
        paragraphs.append(clock)
    if speedup > 1.02 * ideal_speedup or speedup < 0.98 / ideal_speedup:
        paragraphs.append(
            "A speedup outside what balance can explain means other processes took CPU from one "
            "run's steps more than from the other's: benchmarks/train_speedup.py repeats the "
            "pair and takes the median."
        )
    if steps < 30:
        note = f"{steps} steps are too few to measure a speedup on a shared machine"
        paragraphs.append(note + ": run the full demo (no --quick) for a figure.")
        lines.append(note + ": run the full demo for a figure")
    return MeasuredSummary(
        static_tok_s=st,
        auto_tok_s=au,
        speedup=speedup,
        ideal_speedup=ideal_speedup,
        verdict=verdict,
        measured_steps=steps,
        expert_us_per_token=c_s * 1e6,
        text="\n\n".join(paragraphs),
        gain_accounting=accounting,
        lines=lines[:3],
    )


def paired_clock_sentence(evidence: dict[str, Any]) -> str:
    """The auto run's own paired clock in words (`poise.runtime.control.clock`: its probe steps,
    the plan's homes without the replicas, against their neighbours), or nothing when the run
    never probed."""
    probes = int(evidence.get("probes") or 0)
    saving = evidence.get("clock_s")
    if probes == 0 or saving is None:
        return ""
    from poise.runtime.control.evidence import t_critical

    se = float(evidence.get("clock_se_s") or 0.0)
    z = t_critical(probes - 1)  # Student's t for its probes
    call = (
        f"beyond {z:g} standard errors"
        if abs(saving) > z * se
        else f"within {z:g} standard errors, so not conclusive"
    )
    way = "saved" if saving >= 0 else "cost"
    text = (
        f" Within the auto run, where the machine's drift between runs does not reach, its "
        f"{probes} probe steps (the plan's homes without the replicas) against their neighbours "
        f"measured that the replicas {way} {abs(saving) * 1e3:.1f} ms a step (standard error "
        f"{se * 1e3:.1f} ms; {call})."
    )
    modelled = evidence.get("modelled_clock_s")
    if modelled is not None:
        text += (
            f" The run's fitted cost model had predicted {float(modelled) * 1e3:+.1f} ms a step "
            "for the same comparison."
        )
    return text


def demo_json(summary: MeasuredSummary, sims: list, missing: list[str]) -> dict:
    """`OUT/demo.json`: the measured line, then one entry per simulated table."""
    simulated = []
    for sec in sims:
        res = sec.result
        simulated.append(
            {
                "key": sec.key,
                "title": sec.title,
                "cluster": res.cluster.name,
                "devices": int(res.cluster.num_devices),
                "experts": int(res.spec.experts),
                "top_k": int(res.spec.top_k),
                "model": res.spec.name,
                "trace": res.trace_name,
                "steps": int(res.steps),
                "replan_every": int(res.replan_every),
                "policies": [
                    {
                        "policy": row["policy"],
                        "step_ms": round(row["mean_step_s"] * 1e3, 4),
                        "vs_static": None
                        if row["speedup_vs_static"] is None
                        else round(row["speedup_vs_static"], 4),
                        "planning_ms_per_step": round(row["planning_s_per_step"] * 1e3, 4),
                        "plan_delay_steps": round(row["plan_delay_steps"], 3),
                    }
                    for row in res.summary_rows()
                ],
            }
        )
    return {
        "measured": summary.as_json(),
        "simulated": simulated,
        "real_data_missing": list(missing),
    }


def sim_line(result) -> str:
    """A simulated table in one line: auto against static, and the fastest where not auto."""
    rows = result.summary_rows()
    if "static" not in result.runs or "auto" not in result.runs or not rows:
        return ""
    static_s = result.runs["static"].mean_step_s
    auto_s = result.runs["auto"].mean_step_s
    best = rows[0]["policy"]
    text = f"auto {static_s / auto_s:.2f}x static"
    if best != "auto":
        best_s = result.runs[best].mean_step_s
        text += f"; fastest {best} {static_s / best_s:.2f}x (the report says why)"
    return text


__all__ = [
    "compare_traces",
    "demo_json",
    "forecast_miss_note",
    "measured_summary",
    "plan_delay_note",
    "sim_line",
    "sim_note",
]
