"""Replays a scenario's cases with `simulate`, one worker process per CPU, and sets
our figures beside the published ones (`run_scenario`); `auto`'s check against the fastest
other policy of each case and run (`auto_check`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from poise.core.spec import ModelSpec
from poise.plan.memory_slots import memory_bound_slots
from poise.plan.policies.base import REGISTRY
from poise.plan.policies.registry import get_policy
from poise.sim.scenarios.core import (
    Case,
    Check,
    Figure,
    Progress,
    Row,
    Run,
    Scenario,
    ScenarioResult,
    build_trace,
    case_schedule,
    find_shared_data,
)
from poise.sim.simulator import SimResult, simulate
from poise.trace.trace import Trace
from poise.util.processes import available_cpus, map_in_processes


def _policies(scenario: Scenario, run: Run, figures: Sequence[Figure]) -> list[str]:
    names: list[str] = []
    if scenario.all_policies:
        get_policy("static")  # fills REGISTRY
        names.extend(sorted(REGISTRY))
    names.extend(run.policies)
    for f in figures:
        for sched, pol in (f.system, *f.baselines):
            if sched == run.name:
                names.append(pol)
    names.append("auto")
    return list(dict.fromkeys(names))


def step_times(result: SimResult, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """`(charged, priced)` seconds per step `[S]`: the cost model's step time with the planner's
    measured wall time charged as the replay's planning model charges it, and without it
    (whatever `count_planning` the replay used)."""
    run = result.runs[policy]
    priced = run.step_s - run.plan_s
    return priced + run.plan_charge_s, priced


def measured_mean(x: np.ndarray, warmup: int) -> float:
    """Mean of the step seconds `x[S]` after the `warmup` steps (the last step if none is
    left)."""
    return float(x[min(warmup, len(x) - 1) :].mean())


def paired_gap_se(a: np.ndarray, b: np.ndarray, warmup: int, window: int) -> float | None:
    """Standard error of the mean of `a - b` over the measured steps (`[S]` step seconds of
    two policies on the same trace), from the means of consecutive `window`-step blocks: steps
    under one plan share its forecast error, so blocks of a re-planning window, not single
    steps, are the independent samples. None with fewer than two blocks."""
    diff = (a - b)[min(warmup, len(a) - 1) :]
    blocks = [diff[i : i + window].mean() for i in range(0, len(diff), window)]
    if len(blocks) < 2:
        return None
    return float(np.std(blocks, ddof=1) / np.sqrt(len(blocks)))


def run_scenario(
    scenario: Scenario,
    *,
    quick: bool = False,
    data: str | Path | None = None,
    progress: Progress | None = None,
) -> ScenarioResult:
    """Replay every case of `scenario` under each of its runs and compute the figures. The
    replays run in one worker process per CPU (`poise.util.processes`); the figures do not
    depend on where they ran (a planner's time is its thread's CPU time)."""
    if scenario.runner is not None:
        return scenario.runner(quick, find_shared_data(data))
    started = time.perf_counter()
    data_dir = find_shared_data(data)
    cases = scenario.cases_for(quick)
    trace_notes: dict[str, str] = {}
    replays: dict[tuple[int, int], RunReplay] = {}  # by (case, run) index
    total = len(cases) * len(scenario.runs)
    # The replays are independent, and mostly Python holding the GIL: one worker process per
    # CPU, one job per case (its trace built once), or per case and run with fewer cases.
    workers = available_cpus()
    runs = tuple(range(len(scenario.runs)))
    jobs = [(scenario, c, runs, quick, data_dir) for c in range(len(cases))]
    if len(cases) < workers:
        jobs = [(scenario, c, (r,), quick, data_dir) for c in range(len(cases)) for r in runs]
    for i, (note, made) in map_in_processes(replay_case, jobs, workers):
        case = jobs[i][1]
        trace_notes[cases[case].label] = note
        for r, replay in zip(jobs[i][2], made, strict=True):
            replays[case, r] = replay
            if progress is not None:
                what = f"{scenario.name}: {cases[case].label}, {scenario.runs[r].name}"
                progress(what, len(replays), total)
    means: dict[str, dict[str, dict[str, float]]] = {}
    checks: list[Check] = []
    for c, case in enumerate(cases):
        means[case.label] = {}
        for r, run in enumerate(scenario.runs):
            replay = replays[c, r]
            means[case.label][run.name] = (
                replay.charged if scenario.count_planning else replay.priced
            )
            checks.append(replay.check)
    rows = [_row(scenario, f, cases, means) for f in scenario.figures]
    rows = [r for r in rows if r is not None]
    return ScenarioResult(
        scenario=scenario,
        rows=rows,
        checks=checks,
        means=means,
        wall_s=time.perf_counter() - started,
        quick=quick,
        trace_notes=trace_notes,
    )


@dataclass
class RunReplay:
    """One case under one run: each policy's mean step seconds over the measured steps with
    the planning time charged (`charged`) and without (`priced`), and `auto`'s check."""

    charged: dict[str, float]
    priced: dict[str, float]
    check: Check


def replay_case(
    scenario: Scenario, case_index: int, runs: tuple[int, ...], quick: bool, data: Path | None
) -> tuple[str, list[RunReplay]]:
    """Case `case_index` of `scenario.cases_for(quick)` under the runs `runs` (indices into
    `scenario.runs`): its trace's line (`build_trace`) and one `RunReplay` per run."""
    case = scenario.cases_for(quick)[case_index]
    trace, note = build_trace(case, quick, data)
    return note, [replay_run(scenario, case, trace, scenario.runs[r]) for r in runs]


def replay_run(scenario: Scenario, case: Case, trace: Trace, run: Run) -> RunReplay:
    """`trace` of `case` replayed with `simulate` under `run`, every policy of the run."""
    names = _policies(scenario, run, scenario.figures)
    cluster, spec = case.get_cluster(), timed_spec(scenario, case.spec)
    unbounded = memory_bound_slots(cluster, memory_spec(scenario, case.spec))
    result = simulate(
        trace,
        cluster,
        spec,
        names,
        case_schedule(run.schedule, cluster),
        scenario.replan_every,
        scenario.predictor,
        count_planning=scenario.count_planning,
        background_planning=scenario.background_planning,
        dense_params=timed_dense_params(scenario, case.spec),
        options={k: dict(v) for k, v in run.options.items()},
        policy_slots={n: unbounded for n in scenario.memory_bound if n in names},
        fixed_plans=[n for n in scenario.fixed_plans if n in names],
        workers=1,  # the replays take the CPUs (`run_scenario`); threads would take turns
    )
    warmup = scenario.warmup_steps
    charged, priced = {}, {}
    for n in names:
        c, p = step_times(result, n)
        charged[n], priced[n] = measured_mean(c, warmup), measured_mean(p, warmup)
    check = auto_check(scenario, case.label, run.name, result, charged, priced)
    return RunReplay(charged, priced, check)


def timed_spec(scenario: Scenario, spec: ModelSpec) -> ModelSpec:
    """The model a scenario replays: as given when the paper times whole steps, without its
    dense (non-MoE) compute when it times the MoE layers alone (`Scenario.timed`)."""
    if scenario.timed == "moe":
        return spec.with_(non_moe_flops_per_token=0.0)
    return spec


def memory_spec(scenario: Scenario, spec: ModelSpec) -> ModelSpec:
    """The model whose state fills a device's memory (`poise.plan.memory_slots`): the whole
    model for a paper that times whole steps; one MoE layer alone, without dense parts, for one
    that times each MoE layer alone (FasterMoE's Fig. 13 benchmarks one layer at a time)."""
    if scenario.timed == "moe":
        return spec.with_(non_moe_flops_per_token=0.0, moe_layers=1)
    return spec


def timed_dense_params(scenario: Scenario, spec: ModelSpec) -> int | None:
    """The replicated (non-expert) parameters whose gradients every step all-reduces across the
    devices (`ModelSpec.dense_params`) for a paper that times whole steps; None (nothing
    charged) when the paper times the MoE layers alone."""
    if scenario.timed == "moe":
        return None
    return spec.dense_params


def auto_check(
    scenario: Scenario,
    case: str,
    schedule: str,
    result: SimResult,
    charged: dict[str, float],
    priced: dict[str, float],
) -> Check:
    others = [n for n in result.runs if n != "auto"]
    best_c = min(others, key=lambda n: charged[n])
    best_p = min(others, key=lambda n: priced[n])
    auto_plan = result.runs["auto"].last_plan
    chosen = list(auto_plan.notes.get("chosen", [])) if auto_plan is not None else []
    column = 0 if scenario.count_planning else 1  # step_times: (charged, priced)
    best = best_c if scenario.count_planning else best_p
    gap_se = paired_gap_se(
        step_times(result, "auto")[column],
        step_times(result, best)[column],
        scenario.warmup_steps,
        scenario.replan_every,
    )
    return Check(
        scenario=scenario.name,
        case=case,
        schedule=schedule,
        count_planning=scenario.count_planning,
        auto_charged_s=charged["auto"],
        best_charged=best_c,
        best_charged_s=charged[best_c],
        auto_priced_s=priced["auto"],
        best_priced=best_p,
        best_priced_s=priced[best_p],
        auto_planning_s=charged["auto"] - priced["auto"],
        auto_chosen=chosen,
        gap_se_s=gap_se,
    )


def _speedup(f: Figure, means: dict[str, dict[str, float]], system_policy: str) -> float:
    base = float(np.mean([means[s][p] for s, p in f.baselines]))
    return base / means[f.system[0]][system_policy]


def _row(
    scenario: Scenario,
    f: Figure,
    cases: Sequence[Case],
    means: dict[str, dict[str, dict[str, float]]],
) -> Row | None:
    labels = [c.label for c in cases if not f.cases or c.label in f.cases]
    if not labels:
        return None  # a --quick run left this figure's cases out
    ours = {c: _speedup(f, means[c], f.system[1]) for c in labels}
    auto = {c: _speedup(f, means[c], "auto") for c in labels}
    if f.aggregate == "max":
        o, a = max(ours.values()), max(auto.values())
        setup = f"max over {', '.join(labels)}" if len(labels) > 1 else labels[0]
    elif f.aggregate == "mean":
        o, a = float(np.mean(list(ours.values()))), float(np.mean(list(auto.values())))
        setup = f"mean over {', '.join(labels)}" if len(labels) > 1 else labels[0]
    else:
        o, a = ours[labels[0]], auto[labels[0]]
        setup = ", ".join(labels)
    return Row(
        scenario=scenario.name,
        setup=setup,
        comparison=f.label,
        ours=o,
        auto=a,
        published=f.published,
        published_text=f.published_text,
        source=f.source,
        cases=labels,
        per_case=ours,
        per_case_auto=auto,
    )
