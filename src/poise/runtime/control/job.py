"""One planning job of the live Balancer, run from snapshots in a worker process while training
goes on (`run_job`):

1. fit the cluster's constants to the steps run under the plan in force (`selfcal.fit`);
2. judge that plan (`evidence.judge`); where its paired clock read, price replicas at what it
   measured them to cost beyond its noise (`clock.replica_scale`, `Fit.k_replica`);
3. forecast `[L, D, E]` and make the policy's plan on the fitted cluster (`planning_options`),
   each home re-chosen among its holders (`moves.homes`), `auto`'s replicas under retargeting
   counted as they would run (`poise.plan.replica_budget`);
4. price the candidates against the plan in force (`pricing.price`): that plan, for `auto`
   under retargeting the homes in force with budgeted replicas (no forecast in it), and where
   the evidence refutes the plan in force its exits (`exits`);
5. measure how far the last forecast missed (`forecast_miss`).

NumPy and plain data only: a job and its `JobResult` pickle to and from the worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.placement import Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.cost.model import CostModel
from poise.plan.policies.auto import with_steps_left
from poise.plan.policies.base import PlanContext
from poise.plan.policies.bounds import BOUNDS
from poise.plan.policies.registry import make_plan
from poise.plan.predict import Predictor
from poise.plan.replica_budget import replica_budget
from poise.plan.retarget import homes_with, ran_plans, with_placement
from poise.runtime.control.clock import Probes, replica_scale, steady_probes
from poise.runtime.control.evidence import Evidence, judge, t_critical
from poise.runtime.control.pricing import Priced, price
from poise.runtime.moves.homes import homes_alone, keep_homes
from poise.runtime.selfcal.fit import Fit, cluster_of, fit_cluster


@dataclass(frozen=True)
class PlanningJob:
    """Snapshots for one job. `history[S, L, D, E]`: the window; `fit_counts[n, ...]`,
    `fit_rows[n, 1 + len(MEASURED)]` (step, then seconds), `settled[n]` (not the switch's
    step), `fit_rank_experts[n, D]` (None: not per rank), `fit_ran` (the replicas each ran,
    `StepRecords.ran`; None: the plan's own): the newest steps run under `current`; `probes`:
    the probe steps and their neighbours (None: no probing); `previous`: the last fit;
    `switch_scale`: `auto`'s price of a modelled migration second (`SwitchPrice.k_switch`);
    `horizon`: the steps a plan serves at least; `steps_left`: those the run has left (None:
    not known); `held_before`: the load pattern's age carried from the last plan; `replicas`:
    off where replicas cannot pay, so `auto` plans homes only; `last`: the last job's plan and
    the number of `history`'s rows before the steps run since it (None: none); `guarded`: the
    controller is on; `retarget`: the Balancer retargets replicas each step."""

    history: np.ndarray
    fit_counts: np.ndarray
    fit_rows: np.ndarray
    settled: np.ndarray
    current: Plan
    static: Plan
    prior: Cluster
    spec: ModelSpec
    previous: Fit
    policy: str
    predictor: Predictor
    options: Mapping[str, Mapping[str, Any]]
    slots: int
    horizon: int
    calibrate: bool = True
    split_tokens: bool = True
    switch_scale: float = 1.0
    guarded: bool = True
    retarget: bool = False
    replicas: bool = True
    probes: Probes | None = None
    fit_rank_experts: np.ndarray | None = None
    fit_ran: tuple[np.ndarray, ...] | None = None
    steps_left: int | None = None
    held_before: int = 0
    last: tuple[Plan, int] | None = None


@dataclass(frozen=True)
class JobResult:
    """`candidates` priced against the plan in force (the policy's plan first), `evidence` on
    the plan in force (None on the static layout), the fitted `cluster` and `fit`, `forecast`:
    the policy's plan, which the next job backtests, and `miss`: how far the last forecast
    missed, a share in [0, 1]."""

    candidates: tuple[Priced, ...]
    evidence: Evidence | None
    cluster: Cluster
    fit: Fit
    forecast: Plan
    miss: float


def live_plan(
    job: PlanningJob, history: np.ndarray, cluster: Cluster, options: Mapping
) -> tuple[Plan, np.ndarray]:
    """`(plan, loads)`: the forecast `loads[L, D, E]` from `history[S, L, D, E]` and the policy's
    plan for them on `cluster`, each expert's home re-chosen among its holders (`keep_homes`)."""
    loads = job.predictor.predict(history)
    ctx = PlanContext.create(
        cluster, job.spec, slots_per_device=job.slots,
        history=history.sum(axis=2).astype(np.float64), options=options,
        split_tokens=job.split_tokens,
    )  # fmt: skip
    plan = make_plan(job.policy, loads, job.current, ctx)
    return keep_homes(plan, job.current.placement, job.spec), loads


def planning_options(job: PlanningJob, fit: Fit) -> dict[str, dict[str, Any]]:
    """The policies' options for `job`: `auto`'s migration priced at the switches' measured
    scale over the fitted transfer scale (with calibration off, the prior's: the plan depends on
    the loads alone), its horizon capped by the run, the pattern's carried age, and its
    candidates held to those with one copy per expert where replicas are off."""
    out = {k: dict(v) for k, v in job.options.items()}
    auto = out.setdefault("auto", {})
    scale = job.switch_scale if job.calibrate else 1.0
    auto.setdefault("migration_scale", max(scale / (fit.k_transfer * fit.k_replica), 0.0))
    out = with_steps_left(out, job.steps_left)
    out["auto"]["held_before"] = job.held_before
    if not job.replicas:
        chosen = out["auto"].get("candidates")
        names = [n for n in (sorted(BOUNDS) if chosen is None else chosen) if n in BOUNDS]
        out["auto"]["candidates"] = names or ["static"]
    return out


def plan_horizon(plan: Plan, job: PlanningJob) -> int:
    """The steps `plan` is credited over: the job's horizon or the plan's own (`auto`'s: as long
    as its load pattern held) where longer, never past the end of the run."""
    horizon = max(job.horizon, int(plan.notes.get("horizon", job.horizon)))
    return horizon if job.steps_left is None else max(1, min(horizon, job.steps_left))


def keeps_homes(job: PlanningJob, plan: Plan) -> bool:
    """Whether nothing of `plan` rests on the forecast: it keeps the homes in force and the
    Balancer retargets its replicas each step (never a plan that routes by groups, HybridEP's,
    whose replicas retargeting leaves where they are)."""
    return (
        job.retarget
        and not plan.assignment.grouped
        and np.array_equal(plan.placement.home, job.current.placement.home)
    )


def homes_kept(plan: Plan, job: PlanningJob, cost: CostModel, recent: np.ndarray) -> Plan:
    """The homes in force with the replicas that price least as they would run `recent[S, L, D,
    E]` (`replica_budget`), `plan`'s policy, notes and split kept."""
    cur = job.current.placement
    counts = recent[-1] if len(recent) else job.history[-1]
    base = with_placement(plan, homes_with(cur, []), counts, cur, job.spec)
    return replica_budget(cost, base, recent, cur)


def exits(current: Plan, static: Plan, spec: ModelSpec) -> list[tuple[str, Plan]]:
    """Where a refuted plan may go: its homes alone where it holds replicas on homes other than
    the static layout's (no migration; Trans and Agg stop), and the static layout (its homes
    moved back)."""
    back = dataclasses.replace(
        static, transfers=transfers_between(current.placement, static.placement, spec)
    )
    p = current.placement
    if not p.replicas().any() or np.array_equal(p.home, static.placement.home):
        return [("static", back)]
    return [("homes alone", homes_alone(current, spec)), ("static", back)]


def missed(
    cost: CostModel, job: PlanningJob, plan: Plan, before: np.ndarray, after: np.ndarray
) -> float | None:
    """How far `plan`'s forecast missed: its gain over the static layout a step on the forecast
    from `before[B, L, D, E]` against its mean gain on the steps `after[A, L, D, E]` (as they would
    have run), `clip(1 - after / forecast, 0, 1)`; None where it promised nothing."""
    promised = price(cost, job.static, plan, job.predictor.predict(before)).forecast_gain_s
    if not promised > 0:
        return None
    ran = price(cost, job.static, plan, after.mean(axis=0), recent=after, retarget=job.retarget)
    return float(np.clip(1.0 - (ran.recent_gain_s or 0.0) / promised, 0.0, 1.0))


def forecast_miss(job: PlanningJob, cost: CostModel, cluster: Cluster, options: Mapping) -> float:
    """How far the last forecast missed (module docstring, 5); 1 where nothing tells."""
    history = job.history
    if job.last is not None:
        plan, cut = job.last
        if 0 < cut < len(history):
            m = missed(cost, job, plan, history[:cut], history[cut:])
            return 1.0 if m is None else m
        return 1.0
    if len(history) < 2:
        return 1.0
    cut = len(history) // 2
    made, _ = live_plan(job, history[:cut], cluster, options)
    m = missed(cost, job, made, history[:cut], history[cut:])
    return 1.0 if m is None else m


def run_job(job: PlanningJob) -> JobResult:
    """Run `job` (module docstring)."""
    cluster, fit = job.prior, Fit()
    rows = job.fit_rows[:, 1:]
    ran = ran_plans(job.current, job.fit_ran, job.fit_counts)  # the steps as they ran
    if job.calibrate:
        cluster, fit = fit_cluster(
            job.prior, CostModel(job.prior, job.spec), ran, job.fit_counts, rows,
            previous=job.previous, settled=job.settled, rank_experts=job.fit_rank_experts,
        )  # fmt: skip
        fit = dataclasses.replace(fit, k_replica=job.previous.k_replica)
        cluster = cluster_of(job.prior, fit)
    fitted = CostModel(cluster, job.spec)
    evidence = None
    if job.guarded and job.current.digest() != job.static.digest():
        after = job.settled
        ran_after = (
            ran if isinstance(ran, Plan) else [p for p, a in zip(ran, after, strict=True) if a]
        )
        probes, stalled = job.probes, 0
        if probes is not None:  # a probe beside a stalled step measures the stall
            kept = steady_probes(fitted, job.static, probes, job.fit_counts[after], rows[after])
            probes, stalled = kept, len(probes) - len(kept)
        evidence = judge(
            fitted, job.static, job.current, ran_after, job.fit_counts[after], rows[after],
            probes, stalled,
        )  # fmt: skip
        if job.calibrate and evidence is not None and evidence.clock_s is not None:
            assert probes is not None  # replicas priced at what the clock measured
            ceiling = evidence.clock_s + t_critical(evidence.probes - 1) * evidence.clock_se_s
            fit = dataclasses.replace(
                fit, k_replica=replica_scale(fitted, job.current, probes, ceiling)
            )
            cluster = cluster_of(job.prior, fit)
            fitted = CostModel(cluster, job.spec)
    options = planning_options(job, fit)
    plan, loads = live_plan(job, job.history, cluster, options)
    recent = job.history[len(job.history) - min(len(job.history), job.horizon) :]
    budgeted = job.retarget and job.policy == "auto" and job.replicas
    if budgeted:
        plan = replica_budget(fitted, plan, recent, job.current.placement)
    prior = CostModel(job.prior, job.spec)

    def priced(p: Plan, exit: str = "") -> Priced:
        return price(
            fitted, job.current, p, loads, switch_cost=prior, recent=recent,
            retarget=job.retarget, horizon=plan_horizon(p, job), forecast_free=keeps_homes(job, p),
            exit=exit,
        )  # fmt: skip

    candidates = [priced(plan)]
    if job.guarded and budgeted and not keeps_homes(job, plan):
        candidates.append(priced(homes_kept(plan, job, fitted, recent)))
    if evidence is not None and evidence.refutes:
        candidates += [priced(p, exit=name) for name, p in exits(job.current, job.static, job.spec)]
    miss = forecast_miss(job, fitted, cluster, options) if job.guarded else 0.0
    return JobResult(tuple(candidates), evidence, cluster, fit, plan, miss)
