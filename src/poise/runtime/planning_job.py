"""One planning job of the live Balancer: fit, judge, forecast, plan and price, from snapshots.

The Balancer's leader takes `PlanningJob` at a re-plan boundary (copies of the window of
gathered loads `[S, L, D, E]`, the measured phases, the plan in force, the prior cluster) and
hands it to its background planner (`poise.runtime.planner.background`), which runs `run_job` in a
worker
process while training goes on:

1. fit the cluster's constants to the steps run under the plan in force
(`poise.runtime.selfcal.fit`);
2. judge whether that plan paid on them (`poise.runtime.verdict.verdict`), where it is not static;
   where its paired clock has spoken, price replicas at what it measured them to cost beyond
   its noise (`paired_clock.replica_scale` at `verdict.clock_ceiling`, `Fit.k_replica`; kept
   from the previous fit otherwise), leaving out the probes beside a stalled step
   (`paired_clock.steady_probes`);
3. forecast `[L, D, E]` (the predictor) and make the policy's plan on the fitted cluster, with
   `auto`'s migration price set from what the switches measured (`with_migration_scale`; with
   calibration off, the prior's, so that the plan depends on the loads alone) and
   its horizon no longer than the steps the run has left (`auto.with_steps_left`), only its
   homes-only candidates while the clock's refutation of replicas holds (`homes_only_options`),
   each expert's home re-chosen among its holders (`poise.runtime.homes.keep_homes`), and,
   where the Balancer retargets replicas, `auto`'s number of replicas the one that prices
   least as they would run the recent steps (`poise.runtime.replica_budget`);
4. price the candidate against the plan in force (`poise.runtime.assessment.assess`), and, where
   the plan in force is not static and did not pay (`verdict.plan_pays`, with the guard on), the
   layouts a fallback could go to (`guard.exit_plans`), among which the leader then chooses
   (`SwitchGuard.exit_choice`);
5. where the static layout is in force, price the last job's candidate on the steps run since
   its loads were taken (`backtest`): whether that forecast held (`poise.runtime.leader`);
   without such a candidate (the run's first re-plan, the first after a resume), a candidate
   made from the window's older half, priced on its newer half (`holdout`);
6. where the static layout is in force, the Balancer retargets replicas (`retarget`) and `auto`'s
   plan moves homes that no backtest vouches for (`vouched`), offer a *replica trial* instead:
   the homes in force with the replicas that price least as they would run the recent steps
   (`replica_budget` on `on_homes_in_force`), and name `auto`'s homes move for the next job to
   backtest (`JobResult.backtest_next`). A candidate that keeps the homes in force rests on no
   forecast (`follows_router`): its replicas are re-chosen each step from the step before, as
   `assess(retarget=True)` priced them, so the leader adopts it without a backtest.

Everything here is NumPy and plain data (no torch): a job and its `JobResult` pickle, so the
planner can run it in another process, where its Python holds no lock the training thread needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.cost.model import CostModel
from poise.plan.policies.auto import with_steps_left
from poise.plan.policies.base import PlanContext
from poise.plan.policies.bounds import BOUNDS
from poise.plan.policies.registry import make_plan
from poise.plan.predict import Predictor
from poise.plan.retarget import homes_with, ran_plans, with_placement
from poise.runtime.assessment import Assessment, assess
from poise.runtime.guard import exit_plans
from poise.runtime.moves.homes import keep_homes
from poise.runtime.paired_clock import Probes, replica_scale, steady_probes
from poise.runtime.replica_budget import replica_budget
from poise.runtime.selfcal import fit as selfcal
from poise.runtime.verdict import Verdict, clock_ceiling, plan_pays, verdict


def planning_context(
    cluster: Cluster,
    spec: ModelSpec,
    slots: int,
    history: np.ndarray,
    options: Mapping[str, Mapping[str, Any]],
    split_tokens: bool,
) -> PlanContext:
    """The context a plan is made in from the window `history[S, L, D, E]` (the same on every
    rank that plans)."""
    return PlanContext.create(
        cluster,
        spec,
        slots_per_device=slots,
        history=history.sum(axis=2).astype(np.float64),
        options=options,
        split_tokens=split_tokens,
    )


def with_migration_scale(
    options: Mapping[str, Mapping[str, Any]], scale: float
) -> dict[str, dict[str, Any]]:
    """`options` with `auto.migration_scale` set to `scale` unless the user set it: the
    switches' measured seconds over the prior cluster's model (`SwitchGuard.k_switch`; before
    the first switch, the start-up switch probe's, `poise.runtime.probe.probe_switch_scale`,
    else `k_transfer`: a migration is bulk transfers like Trans and Agg) divided
    by the fitted transfer scale (`k_transfer`), so that `auto`, pricing on the fitted cluster,
    charges a migration what the guard will."""
    out = {k: dict(v) for k, v in options.items()}
    out.setdefault("auto", {}).setdefault("migration_scale", max(scale, 0.0))
    return out


def homes_only_options(options: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A copy of `options` whose `auto.candidates` keeps only the policies that place one copy
    per expert (those `poise.plan.policies.bounds` bounds: `static`, `permute`), of the user's
    list where one was set (`static` where none of it is left): `auto`'s plans while the paired
    clock's refutation of replicas holds (`SwitchGuard.trust` 0)."""
    out = {k: dict(v) for k, v in options.items()}
    auto = out.setdefault("auto", {})
    chosen = auto.get("candidates")
    names = [n for n in (sorted(BOUNDS) if chosen is None else chosen) if n in BOUNDS]
    auto["candidates"] = names or ["static"]
    return out


def live_plan(
    policy: str,
    predictor: Predictor,
    history: np.ndarray,
    current: Plan,
    cluster: Cluster,
    spec: ModelSpec,
    slots: int,
    options: Mapping[str, Mapping[str, Any]],
    split_tokens: bool,
) -> tuple[Plan, np.ndarray]:
    """`(plan, loads)`: the forecast `loads[L, D, E]` from `history[S, L, D, E]` and the
    policy's plan for them on `cluster`, each expert's home re-chosen among its holders
    (`keep_homes`) so that homes stay put where they can (steps 3 of the module docstring)."""
    loads = predictor.predict(history)
    ctx = planning_context(cluster, spec, slots, history, options, split_tokens)
    plan = keep_homes(make_plan(policy, loads, current, ctx), current.placement, spec)
    return plan, loads


@dataclass(frozen=True)
class PlanningJob:
    """Snapshots for one job (module docstring). `history[S, L, D, E]`: the window of gathered
    loads; `fit_counts[n, L, D, E]`, `fit_rows[n, 1 + len(selfcal.MEASURED)]` (step, then the
    measured seconds): the newest steps run under `current`; `settled[n]`: those after the step
    that carried the switch; `static_counts[T, L, D, E]`, `static_rows[T, 1 + len(MEASURED)]`:
    the newest settled steps run under the static layout, `balanced_counts[B, ...]`,
    `balanced_rows[B, ...]`: the settled steps run under plans with replicas since the static
    layout last ran (the wall-clock test of `poise.runtime.guard`; T and B may be 0);
    `previous`: the last fit; `measured_switch`: the guard's `k_switch`
    once a switch was measured, before that the start-up switch probe's (`PlanCycle._switch_scale`;
    None without either); `horizon`: steps a plan is expected to serve;
    `guarded`: the guard is on (the exits are priced only then); `probes`: the probe steps
    and their neighbours for the paired clock test (None: the Balancer does not probe, and the
    clock compares with the static steps); `fit_rank_experts[n, D]`: every rank's own expert
    seconds on the `fit_rows` steps (the marginal compute fit, `selfcal.fit_compute`; None:
    the slowest rank's alone); `fit_ran`: the replicas each `fit_rows` step ran, `[R, 3]` rows
    (`records.StepRecords.ran`: `current`'s own, or retargeted; None: `current`'s own on every
    step), on which those steps are priced (`poise.plan.retarget.ran_plans`); `steps_left`: the
    steps a plan decided for this job serves before the run ends (None: not known), which caps every
    horizon the plan is priced and judged over; `backtest_plan`, `backtest_counts[B, L, D, E]`: the
    candidate of the last job and the counts of the steps run since its loads were taken, where the
    static layout is in force (None otherwise: `JobResult.backtest`); `homes_only`: the paired
    clock refuted replicas
    (`SwitchGuard.trust` 0) or could not judge any adopted from this job before the run ends
    (`leader`, rule 4), so `auto` weighs only plans without them (`homes_only_options`);
    `held_before`: the steps the load pattern had held before `history`'s first step, carried
    from the last plan (`poise.plan.persistence.carried_age`; `auto`'s option of that name);
    `holdout`: a job without a backtest may vouch for a homes-only candidate by a `holdout`
    (off: the first adoption of a homes move waits for a backtest, at the second re-plan at the
    earliest; a replica trial does not, step 6);
    `retarget`: the runtime retargets replicas each step (`Balancer(retarget=)`), so every
    assessment prices the recent steps as the plans would run them (`assess(retarget=)`)."""

    history: np.ndarray
    fit_counts: np.ndarray
    fit_rows: np.ndarray
    settled: np.ndarray
    static_counts: np.ndarray
    static_rows: np.ndarray
    balanced_counts: np.ndarray
    balanced_rows: np.ndarray
    current: Plan
    static: Plan
    prior: Cluster
    spec: ModelSpec
    previous: selfcal.Fit
    policy: str
    predictor: Predictor
    options: Mapping[str, Mapping[str, Any]]
    slots: int
    calibrate: bool
    split_tokens: bool
    horizon: int
    measured_switch: float | None
    guarded: bool = True
    probes: Probes | None = None
    fit_rank_experts: np.ndarray | None = None
    fit_ran: tuple[np.ndarray, ...] | None = None
    steps_left: int | None = None
    backtest_plan: Plan | None = None
    backtest_counts: np.ndarray | None = None
    homes_only: bool = False
    held_before: int = 0
    holdout: bool = True
    retarget: bool = False


@dataclass(frozen=True)
class JobResult:
    """The candidate `plan`, its `assessment` against the plan in force, the fitted `cluster`
    and `fit`, and `paid`: whether the plan in force paid (None when it is the static one);
    `exits`: the layouts a fallback may go to, each with its assessment against the plan in
    force (empty when that is the static one or it paid, `verdict.plan_pays`); `horizon`: the
    steps the guard credits the candidate's saving over (None: its own; an `auto` plan's
    horizon where that is longer, `plan_horizon`; never more than the job's `steps_left`);
    `backtest`: the last job's candidate against the static layout on the steps run since
    (`backtest`; None where the job has none to price), or, where `held_out`, the `holdout`
    candidate against the window's newer half; `backtest_next`: see `next_backtest`;
    `k_switch`: the scale of a switch's modelled migration the job priced with (the job's
    `measured_switch` where calibrating, else `fit.k_transfer`), which the guard takes as its
    prior until a switch is measured (None: `fit.k_transfer`); `follows_router`: nothing of
    `plan` rests on the forecast (`follows_router`), so the leader adopts it from the static
    layout without a backtest's word."""

    plan: Plan
    assessment: Assessment
    cluster: Cluster
    fit: selfcal.Fit
    paid: Verdict | None
    exits: tuple[tuple[Plan, Assessment], ...] = ()
    horizon: int | None = None
    backtest: Assessment | None = None
    held_out: bool = False
    backtest_next: Plan | None = None
    k_switch: float | None = None
    follows_router: bool = False

    @property
    def switch_prior(self) -> float:
        """The guard's `k_switch` before a switch was measured (`k_switch`, else the fit's)."""
        return self.fit.k_transfer if self.k_switch is None else self.k_switch

    def next_backtest(self) -> Plan:
        """The candidate the next job backtests (`PlanningJob.backtest_plan`): `backtest_next`
        where the job made one (a holdout job's `auto` candidate with every policy weighed, since
        its own `plan` was restricted to homes), `plan` otherwise."""
        return self.plan if self.backtest_next is None else self.backtest_next


def plan_horizon(plan: Plan, base: int) -> int:
    """The steps `plan` is priced over: `base`, or the plan's own `horizon` note where longer
    (`auto`'s, `poise.plan.persistence`: as long as its load pattern has held)."""
    return max(int(base), int(plan.notes.get("horizon", base)))


def run_job(job: PlanningJob) -> JobResult:
    """Run `job` (module docstring, steps 1-4)."""
    cluster, fit = job.prior, selfcal.Fit()
    rows = job.fit_rows[:, 1:]
    ran = ran_plans(job.current, job.fit_ran, job.fit_counts)  # the fit steps priced on what ran
    if job.calibrate:
        cluster, fit = selfcal.fit_cluster(
            job.prior,
            CostModel(job.prior, job.spec),
            ran,
            job.fit_counts,
            rows,
            previous=job.previous,
            settled=job.settled,
            rank_experts=job.fit_rank_experts,
        )
    fitted = CostModel(cluster, job.spec)
    paid = None
    probes = job.probes
    if probes is not None:  # a probe beside a stalled step measures the stall: left out
        probes = steady_probes(
            fitted, job.static, probes, job.balanced_counts, job.balanced_rows[:, 1:]
        )
    if job.current.digest() != job.static.digest():
        after = job.settled
        ran_after = (
            ran if isinstance(ran, Plan) else [p for p, a in zip(ran, after, strict=True) if a]
        )
        paid = verdict(
            fitted, job.static, job.current, job.fit_counts[after], rows[after], ran=ran_after,
            static_counts=job.static_counts, static_measured=job.static_rows[:, 1:],
            balanced_counts=job.balanced_counts, balanced_measured=job.balanced_rows[:, 1:],
            probes=probes,
        )  # fmt: skip
        if job.probes is not None and probes is not None:
            paid = dataclasses.replace(paid, stalled_probes=len(job.probes) - len(probes))
    if job.calibrate:  # replicas priced at what the paired clock measured them to cost
        k_replica = job.previous.k_replica
        if paid is not None and paid.probes and paid.wall_saving_s is not None:
            assert probes is not None
            k_replica = replica_scale(fitted, job.current, probes, clock_ceiling(paid))
        fit = dataclasses.replace(fit, k_replica=k_replica)
        if k_replica != 1.0:
            cluster = selfcal.cluster_of(job.prior, fit)
            fitted = CostModel(cluster, job.spec)
    # the switches' measured price is a fitted figure too: without calibration a plan is a
    # function of the loads alone, whatever the machine's speed
    measured = job.measured_switch if job.calibrate else None
    k_switch = fit.k_transfer if measured is None else measured
    options = with_migration_scale(job.options, k_switch / (fit.k_transfer * fit.k_replica))
    options = with_steps_left(options, job.steps_left)
    options["auto"]["held_before"] = job.held_before  # the caller's state, not a setting
    unrestricted = options
    first = holdout_due(job)
    if job.homes_only or first:  # a holdout is weaker evidence: homes only
        options = homes_only_options(options)
    plan, loads = live_plan(
        job.policy, job.predictor, job.history, job.current, cluster, job.spec, job.slots,
        options, job.split_tokens,
    )  # fmt: skip
    recent = job.history[len(job.history) - min(len(job.history), job.horizon) :]
    budgeted = job.retarget and job.policy == "auto"  # replicas counted as they will run
    if budgeted and not (job.homes_only or first):
        plan = replica_budget(fitted, plan, recent, job.current.placement)
    backtest_next = None
    if first and not job.homes_only and job.policy == "auto":
        # what the next job backtests: the candidate this job would have made on a backtest
        backtest_next, _ = live_plan(
            job.policy, job.predictor, job.history, job.current, cluster, job.spec, job.slots,
            unrestricted, job.split_tokens,
        )  # fmt: skip
        if budgeted:
            backtest_next = replica_budget(fitted, backtest_next, recent, job.current.placement)
    prior = CostModel(job.prior, job.spec)
    made = holdout(job, cluster, options)
    if made is not None:  # no earlier candidate to backtest: one of the window's older half
        job = dataclasses.replace(job, backtest_plan=made[0], backtest_counts=made[1])
    tested = backtest(fitted, prior, job)
    follows = follows_router(job, plan)
    # a homes move the leader would leave `unsettled` (no holdout here: not `first`): offer the
    # homes in force with the replicas that price least as run instead, and backtest the homes
    # move next time
    if (
        trial_allowed(job)
        and not (first or follows or plan.assignment.grouped)
        and not vouched(tested, held_out=False, candidate_transfers_s=0.0)
    ):
        base = on_homes_in_force(plan, job, recent)
        trial = replica_budget(fitted, base, recent, job.current.placement)
        if trial.placement.replicas().any():
            backtest_next = plan if backtest_next is None else backtest_next
            plan, follows = trial, True
    assessment = assess(
        fitted, job.current, plan, loads, switch_cost=prior, recent=recent, retarget=job.retarget
    )
    exits: tuple[tuple[Plan, Assessment], ...] = ()
    if paid is not None and job.guarded and not plan_pays(paid):
        exits = tuple(
            (target, assess(fitted, job.current, target, loads, prior, recent, job.retarget))
            for target in exit_plans(job.current, job.static, job.spec)
        )
    horizon = plan_horizon(plan, job.horizon)
    if job.steps_left is not None:  # no step past the run's end pays anything back
        horizon = max(1, min(horizon, job.steps_left))
    return JobResult(
        plan, assessment, cluster, fit, paid, exits, horizon, tested,
        held_out=made is not None, backtest_next=backtest_next, k_switch=k_switch,
        follows_router=follows,
    )  # fmt: skip


def vouched(tested: Assessment | None, held_out: bool, candidate_transfers_s: float) -> bool:
    """Whether a backtest vouches for a candidate from the static layout (module docstring,
    5): the last job's candidate, `tested` against the static layout on the steps run since,
    would have saved time a step net of its transfers (`Assessment.live_gain_s` above 0), and,
    where `tested` was a `holdout`, the candidate holds no replicas
    (`candidate_transfers_s` 0). False without a backtest, or where `tested` was the static
    layout itself (nothing to learn from)."""
    if held_out and candidate_transfers_s > 0:
        return False
    return tested is not None and not tested.same and tested.live_gain_s() > 0


def follows_router(job: PlanningJob, plan: Plan) -> bool:
    """Whether nothing of `plan` rests on the job's forecast (module docstring, 6): the
    Balancer retargets replicas each step (`job.retarget`) and `plan` keeps the homes in force
    (`job.current`'s), so what it runs each step is the homes in force with replicas re-chosen
    from the step before, as the assessment priced it on the recent steps. Never a plan that
    routes by groups (HybridEP's): retargeting leaves its replicas where they are."""
    return (
        job.retarget
        and not plan.assignment.grouped
        and np.array_equal(plan.placement.home, job.current.placement.home)
    )


def trial_allowed(job: PlanningJob) -> bool:
    """Whether `job` may offer a replica trial (module docstring, 6): `auto` with retargeting
    and the guard, the static layout in force, replicas allowed (not `homes_only`)."""
    return (
        job.policy == "auto"
        and job.retarget
        and job.guarded
        and not job.homes_only
        and job.current.digest() == job.static.digest()
    )


def on_homes_in_force(plan: Plan, job: PlanningJob, recent: np.ndarray) -> Plan:
    """`plan` (its policy, notes and per-step splitting) on the homes in force with no
    replicas, its tokens split to level the newest of `recent[S, L, D, E]`: what
    `replica_budget` adds replicas to for a replica trial."""
    cur = job.current.placement
    counts = recent[-1] if len(recent) else job.history[-1]
    return with_placement(plan, homes_with(cur, []), counts, cur, job.spec)


def holdout_due(job: PlanningJob) -> bool:
    """Whether `job` backtests a `holdout` candidate: holdouts on (`PlanningJob.holdout`), the
    static layout in force, the guard on, no earlier candidate with steps run since it, and at
    least 2 steps in the window."""
    has_backtest = job.backtest_plan is not None and job.backtest_counts is not None
    return (
        job.holdout
        and job.guarded
        and not (has_backtest and len(job.backtest_counts) > 0)
        and job.current.digest() == job.static.digest()
        and len(job.history) >= 2
    )


def holdout(
    job: PlanningJob, cluster: Cluster, options: Mapping[str, Mapping[str, Any]]
) -> tuple[Plan, np.ndarray] | None:
    """`(plan, counts[H, L, D, E])`: where the static layout is in force, with the guard, and
    the job has no earlier candidate with steps run since it (`backtest_plan`, `backtest_counts`:
    the run's first re-plan, or the first after a resume), the policy's plan made as this job
    makes its own (`cluster`, `options`) from the window's older half, and the newer half's
    counts to price it on (`backtest`): the same question the backtest asks of the last job's
    candidate (did a forecast hold for as long again as it was made from?), on the steps this
    job already has. None otherwise, or with fewer than 2 steps in the window.

    Half a window vouches for a forecast over half as many steps as the plan would serve, and
    before the paired clock has timed any replica their price is the model's prior: so such a
    job plans `auto`'s homes only (`homes_only_options`, in `run_job`), whose worst case is one
    migration, and the leader adopts no candidate with replicas on it (`poise.runtime.leader`,
    rule 3). On `train_speedup.py`'s `skewed-4` (4 ranks on 2 cores) a first plan with 5
    replicas adopted on a holdout alone at step 11 fell back at step 21 in both rounds
    (docs/benchmarks.md). Such a job also makes the candidate with every policy weighed, for
    the next job to backtest (`JobResult.next_backtest`): backtesting the homes-only one there
    held `skewed`'s first adoption from step 21 to 31."""
    if not holdout_due(job):
        return None
    cut = len(job.history) // 2
    older, newer = job.history[:cut], job.history[cut:]
    plan, _ = live_plan(
        job.policy, job.predictor, older, job.current, cluster, job.spec, job.slots, options,
        job.split_tokens,
    )  # fmt: skip
    return plan, newer


def backtest(fitted: CostModel, prior: CostModel, job: PlanningJob) -> Assessment | None:
    """The last job's candidate (`job.backtest_plan`) priced against the static layout on the
    counts of the steps run since its loads were taken (`job.backtest_counts[B, L, D, E]`, their
    mean as the forecast and each as a recent step): what that plan would have saved had it
    been adopted then. None without a candidate, steps, or the guard, or where a plan other
    than the static layout is in force. The leader adopts from the static layout only where
    this would have passed the guard too (`poise.runtime.leader`): a forecast that did not hold
    for one re-plan interval is not trusted for the next."""
    if (
        not job.guarded
        or job.backtest_plan is None
        or job.backtest_counts is None
        or len(job.backtest_counts) == 0
        or job.current.digest() != job.static.digest()
    ):
        return None
    counts = job.backtest_counts
    return assess(
        fitted, job.static, job.backtest_plan, counts.mean(axis=0), switch_cost=prior,
        recent=counts, retarget=job.retarget,
    )  # fmt: skip


__all__ = [
    "JobResult",
    "PlanningJob",
    "backtest",
    "holdout",
    "holdout_due",
    "homes_only_options",
    "live_plan",
    "plan_horizon",
    "planning_context",
    "run_job",
    "with_migration_scale",
]
