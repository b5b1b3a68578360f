"""The leader's decision at a decision boundary: what the guard makes of its planner's result.

The Balancer's leader (`poise.runtime.planner.broadcast`) takes its planning job's `JobResult` at
the
boundary where a plan is due and turns it into the `Outcome` every rank acts on
(`leader_outcome`):

1. when the plan in force is not the static layout and does not pay (`SwitchGuard.pays`), it
   gives way to the fresh candidate (`replace`) or to an exit (`fallback`), whichever nets
   the most over the horizon (`exit_outcome`, `SwitchGuard.exit_choice`);
2. otherwise the candidate is adopted if it pays for its switch (`SwitchGuard.decide`), or
   refused (`same`, `no-gain`; `idle` where the static layout is in force, or the clock has
   refuted the model outright (`SwitchGuard.trust` 0: no candidate with replicas can be
   adopted, and `auto` plans homes only until the re-trial, `SwitchGuard.replan_due`), or the
   clock has settled that the plan in force pays (`verdict.clock_proved`: no probe is due and
   the plan keeps its layout), and the candidate's credited gain did not cover the planning's
   CPU seconds: the re-plans back off. On `train_speedup.py`'s `skewed` (2-core machine) the
   re-plans of steps 21-91 all kept the replica trial of step 11, and the steps that carried
   them ran a median 23-27 ms slower than their neighbours, each job's 30-50 ms of CPU taken
   from the ranks' cores);
3. from the static layout, a candidate the guard would adopt is adopted only where the last job's
   candidate, priced on the steps run since its loads were taken, would have saved time a step net
   of its transfers (`JobResult.backtest`, `planning_job.backtest`; at the run's first re-plan,
   where there is no last candidate, one made from the window's older half and priced on its newer
   half, `planning_job.holdout`, which vouches only for a candidate without replicas: `auto` plans
   homes only there, and a refusal there is never `idle`, since a candidate held to homes says
   nothing of what planning is worth); otherwise it waits (`unsettled`), with no backoff, for the
   next re-plan, which the Balancer asks half a period after the refused one
   (`Balancer(recheck=...)`, `PlanCycle.replan_phase`). A plan made from a forecast pays only while
   the loads hold still for as long as it serves. Where the router still moves (the first tens of
   steps of a run from scratch), the first plan is stale by the time it has paid for its switch. In
   `train_speedup.py`'s `skewed-4` on the 2-core machine (6 of 7 rounds recorded on 2026-11-28) and
   `tiny` on a 16-core host (both rounds), auto adopted at step 11 and fell back at step 21 because
   the plan had saved nothing on the steps between (docs/benchmarks.md). A trial costs its switch,
   its transfers and its way back, and a backtest costs one assessment. The backtest asks only
   whether the forecast held, not whether its plan would have repaid its switch: that is the fresh
   candidate's question (`SwitchGuard.decide`). Asked with the switch, it held `skewed` on the
   static layout until step 31 in both rounds, where the first plan (15 homes moved) had not repaid
   its migration in 10 steps yet the forecast it came from held.
   A candidate that rests on no forecast needs no backtest (`JobResult.follows_router`): where
   the Balancer retargets replicas and the candidate keeps the homes in force, each step runs
   those homes with replicas re-chosen from the step before, which is how its assessment priced
   the recent steps; where `auto`'s plan would move homes unvouched, the job offers such a
   *replica trial* in its place (`planning_job.run_job`, step 6). On `train_speedup.py`'s
   `skewed` (2-core machine) the first adoption came at step 11 instead of 16 in every round
   (docs/benchmarks.md, "A replica trial at the first re-plan").
4. a candidate with replicas is not adopted (`unjudged`, no backoff) while no plan with
   replicas has been timed by the paired clock in this run and the run ends before the clock
   could judge one adopted now (`trial_judgeable`: `MIN_PROBES` probe steps, one every
   `probe_every` steps, then the re-plan that reads them). Until the clock has timed replicas
   their price is the model's prior, which on ranks that share cores overstates what they
   save (docs/benchmarks.md); a trial the guard can take back costs at most its steps, one it
   cannot is a bet on that prior for the rest of the run. On `train_speedup.py`'s `skewed-4`
   (4 ranks on 2 cores) the first replicas came at step 81 of 100 and ran 1.6-2.5% slower
   than static over the 19 steps left, in both rounds. The Balancer knows at the request
   which decision will be blind, and asks `auto` for homes only there (`PlanningJob.homes_only`,
   as while the clock refutes replicas): its other candidates could only be refused, and on
   ranks that share cores their planning is paid in step time (there, with its decisions of
   steps 81 and 91 `unjudged`, `skewed-4`'s jobs took 15-28 ms of CPU each). Where the ranks
   share their cores the Balancer asks for homes only at every request and a candidate with
   replicas (another policy's) is refused as blind (`PlanCycle.cores_shared`): a trial of
   replicas there cost more a step than its candidate was priced to save.

Every outcome also carries the lag of the next request (`planner.adoption_lag` of this job's
wall time over the median measured step, `median_period_s`). Pure: no collective, no torch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from poise.runtime.assessment import Assessment
from poise.runtime.guard import SwitchGuard
from poise.runtime.planner.background import adoption_lag
from poise.runtime.planner.broadcast import Outcome
from poise.runtime.planning_job import JobResult, vouched
from poise.runtime.selfcal import fit as selfcal
from poise.runtime.verdict import MIN_PROBES, clock_proved


def median_period_s(rows: np.ndarray) -> float:
    """The median measured step period of `rows[n, 1 + len(selfcal.MEASURED)]` (step, then the
    seconds), 0 before any was measured."""
    periods = rows[:, 1 + selfcal.PERIOD] if len(rows) else np.zeros(0)
    periods = periods[periods > 0]
    return float(np.median(periods)) if periods.size else 0.0


def leader_outcome(
    guard: SwitchGuard,
    result: JobResult,
    *,
    wait_s: float,
    plan_s: float,
    planning_s: float,
    on_static: bool,
    period_s: float,
    plan_lag: int,
    blind_replicas: bool = False,
) -> Outcome:
    """The outcome of `result` (module docstring). `wait_s`: the seconds the boundary waited
    for the planner; `plan_s`: the job's wall seconds; `planning_s`: its CPU seconds charged
    to the step (0 on accelerators); `on_static`: the static layout is in force; `period_s`:
    the median step; `plan_lag`: the least next lag; `blind_replicas`:
    no plan with replicas has been timed by the clock and one adopted now could not be judged
    before the run ends (module docstring, 4)."""
    next_lag = adoption_lag(plan_s, period_s, plan_lag)
    fit, assessment = result.fit, result.assessment
    blind = blind_replicas and assessment.candidate_transfers_s > 0  # (4)
    if not on_static and not guard.pays(result.paid):
        return exit_outcome(guard, result, wait_s, result.switch_prior, next_lag)
    decision = guard.decide(
        assessment, wait_s, switch_prior=result.switch_prior, horizon=result.horizon
    )
    steps = result.horizon or guard.horizon  # what `decide` credited the gain over
    if (
        decision.adopt
        and on_static
        and guard.enabled
        and not result.follows_router
        and not forecast_held(result, assessment)
    ):
        decision = replace(decision, adopt=False, reason="unsettled")
        reason = decision.reason
    elif decision.adopt and guard.enabled and blind:
        decision = replace(decision, adopt=False, reason="unjudged")
        reason = decision.reason
    elif decision.adopt:
        reason = decision.reason
    elif (
        (on_static or guard.trust <= 0 or clock_proved(result.paid))
        and not result.held_out  # its candidate was held to homes: no verdict on planning
        and not guard.planning_pays(decision, planning_s)
    ):
        reason = "idle"
    else:
        reason = decision.reason
    return Outcome(
        plan=result.plan,
        decision=reason,
        gain_s=decision.gain_s,
        switch_s=decision.switch_s,
        doubt_s=decision.doubt_s,
        predicted_step_s=assessment.candidate_s if decision.adopt else assessment.current_s,
        modelled_switch_s=assessment.switch_s,
        wait_s=wait_s,
        cluster=result.cluster,
        fit=fit,
        verdict=None if on_static else result.paid,
        next_lag=next_lag,
        step_gain_s=decision.gain_s / steps if decision.adopt else 0.0,
    )


def trial_judgeable(steps_left: int | None, probe_every: int, replan_every: int) -> bool:
    """Whether a plan with replicas adopted with `steps_left` steps of the run to go leaves the
    paired clock time to judge it (module docstring, 4): `MIN_PROBES * probe_every +
    replan_every` steps; always where the run's length is not known or nothing probes."""
    if steps_left is None or probe_every <= 0:
        return True
    return steps_left >= MIN_PROBES * probe_every + replan_every


def forecast_held(result: JobResult, candidate: Assessment | None = None) -> bool:
    """Whether the last job's candidate would have saved time a step net of its transfers on
    the steps run since (`result.backtest`: `Assessment.live_gain_s` above 0; module
    docstring, 3). False without a backtest, where that candidate was the static layout itself
    (nothing to learn from), and where the backtest was a holdout (`result.held_out`) and
    `candidate` holds replicas."""
    transfers_s = 0.0 if candidate is None else candidate.candidate_transfers_s
    return vouched(result.backtest, result.held_out, transfers_s)


def exit_outcome(
    guard: SwitchGuard, result: JobResult, wait_s: float, switch_prior: float, next_lag: int
) -> Outcome:
    """The plan in force did not pay: replace it with the fresh candidate or fall back to one
    of `result.exits`, whichever nets the most over the horizon (`SwitchGuard.exit_choice`;
    the candidate is not weighed when the clock refuted the model, `model_refuted`, and is
    credited at the share of its promise the plan in force delivered,
    `SwitchGuard.replacement_credit`)."""
    options = [(result.plan, result.assessment), *result.exits]
    pick = guard.exit_choice(
        result.assessment,
        [a for _, a in result.exits],
        model_refuted=guard.model_refuted(result.paid),
        switch_prior=switch_prior,
        horizon=result.horizon,
        paid=result.paid,
    )
    plan, a = options[pick]
    # the candidate's gain as `exit_choice` took it
    credit = guard.replacement_credit(result.paid, a) if pick == 0 else 1.0
    return Outcome(
        plan=plan,
        decision="replace" if pick == 0 else "fallback",
        gain_s=credit * a.live_gain_s() * (result.horizon or guard.horizon),
        switch_s=guard.switch_cost(a.switch_s, wait_s, switch_prior),
        predicted_step_s=a.candidate_s,
        modelled_switch_s=a.switch_s,
        wait_s=wait_s,
        cluster=result.cluster,
        fit=result.fit,
        verdict=result.paid,
        next_lag=next_lag,
        step_gain_s=credit * a.live_gain_s() if pick == 0 else 0.0,
    )


__all__ = [
    "exit_outcome",
    "forecast_held",
    "leader_outcome",
    "median_period_s",
    "trial_judgeable",
]
