"""From the static layout a plan is adopted only where the last candidate's forecast held.

`planning_job.backtest` prices the last job's candidate against the static layout on the steps
run since its loads were taken (without one, `planning_job.holdout`: a plan from the window's
older half on its newer half); `leader.forecast_held` asks whether that plan would have saved
time a step on them, net of its transfers; `leader_outcome` refuses a candidate (`unsettled`)
from the static layout otherwise.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.test_runtime_balancer import _probes_reading, _replica_case, _replica_job


def _gain(per_step_s: float, switch_s: float = 0.0):
    """An assessment whose candidate saves `per_step_s` a step over the plan in force (busy
    seconds, no transfers) and moves homes for `switch_s`."""
    from poise.runtime.assessment import Assessment

    return Assessment(
        False, current_busy_s=1.0, candidate_busy_s=1.0 - per_step_s, switch_s=switch_s
    )


def _outcome(
    guard, candidate, backtest, on_static: bool = True, held_out: bool = False,
    planning_s: float = 0.0, paid=None,
) -> str:  # fmt: skip
    from poise.core.placement import Plan
    from poise.runtime.leader import leader_outcome
    from poise.runtime.planning_job import JobResult
    from poise.runtime.selfcal.fit import Fit

    cost, _, replica, _ = _replica_case()
    plan = Plan("fresh", replica.placement, replica.assignment, replica.transfers)
    result = JobResult(plan, candidate, cost.cluster, Fit(), paid, horizon=10, backtest=backtest,
                       held_out=held_out)  # fmt: skip
    return leader_outcome(
        guard, result, wait_s=0.0, plan_s=0.0, planning_s=planning_s, on_static=on_static,
        period_s=0.2, plan_lag=1,
    ).decision  # fmt: skip


def test_the_leader_adopts_from_static_only_where_the_last_forecast_held() -> None:
    """Horizon 10, margin 0: a candidate saving 10 ms a step for a 50 ms switch passes the
    guard (100 > 50 ms). From the static layout it is adopted only with a backtest whose plan
    saved time a step on the steps since: 4 ms a step does, though it would not have repaid
    the same switch over 10 steps (whether a switch pays is the fresh candidate's question);
    a loss does not, nor 0, nor no backtest at all (the first job), nor a last candidate equal
    to the static layout. Under another plan, or with the guard off, the backtest plays no
    part."""
    from poise.runtime.assessment import Assessment
    from poise.runtime.guard import SwitchGuard

    guard = SwitchGuard(horizon=10, margin=0.0)
    candidate = _gain(10e-3, 50e-3)
    assert guard.decide(candidate).adopt
    assert _outcome(guard, candidate, _gain(4e-3, 50e-3)) == "adopt"
    assert not guard.decide(_gain(4e-3, 50e-3)).adopt
    assert _outcome(guard, candidate, _gain(-2e-3)) == "unsettled"
    assert _outcome(guard, candidate, _gain(0.0)) == "unsettled"
    assert _outcome(guard, candidate, None) == "unsettled"
    assert _outcome(guard, candidate, Assessment(same=True)) == "unsettled"
    assert _outcome(guard, candidate, None, on_static=False) == "adopt"
    assert _outcome(SwitchGuard(horizon=10, enabled=False), candidate, None) == "off"
    # a candidate the guard refuses is refused for its own reason, whatever the backtest
    assert _outcome(guard, _gain(1e-3, 50e-3), _gain(4e-3, 50e-3)) == "no-gain"


def test_an_unsettled_refusal_does_not_back_off() -> None:
    """`unsettled` is no adoption, and the next re-plan runs as usual: no skipped re-plans."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.planner.broadcast import ADOPTING

    guard = SwitchGuard(horizon=10, margin=0.0)
    assert "unsettled" not in ADOPTING
    assert _outcome(guard, _gain(10e-3, 50e-3), None) == "unsettled"
    assert not guard.skip_replan()


def test_a_refusal_at_a_holdout_is_never_idle() -> None:
    """A candidate saving 1 us a step against a 50 ms switch, whose planning took 20 ms of
    CPU: refused, and from the static layout `idle` (the re-plans back off), except where the
    job backtested a holdout (`JobResult.held_out`): its candidate was held to homes, so it
    says nothing of what planning is worth (`no-gain`, no backoff)."""
    from poise.runtime.guard import SwitchGuard

    guard = SwitchGuard(horizon=10, margin=0.0)
    small = _gain(1e-6, 50e-3)
    assert _outcome(guard, small, None, planning_s=0.02, held_out=True) == "no-gain"
    assert _outcome(guard, small, None, planning_s=0.02) == "idle"


def test_re_plans_back_off_under_a_plan_the_clock_proved() -> None:
    """Under a plan in force, a refused candidate (10 us a step for a 50 ms switch) that did not
    cover its planning's 20 ms of CPU backs the re-plans off (`idle`) once the paired clock has
    settled that the plan pays (4 probes, 30 +- 5 ms a step: beyond t(3) = 3.18 standard
    errors), and only then: with 3 probes, or 30 +- 10 ms (inconclusive), the next re-plan
    carries the verdict that may still take the plan back (`no-gain`); so it does where the
    planning cost the step nothing (accelerators), and where the candidate's gain covered it.
    The backoff then skips the next re-plan."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.verdict import Verdict

    def paid(probes: int, se_s: float) -> Verdict:
        return Verdict(0.3, 0.0, 10, wall_saving_s=0.030, wall_se_s=se_s, probes=probes)

    guard = SwitchGuard(horizon=10, margin=0.0)
    small = _gain(1e-6, 50e-3)  # 10 us over the horizon against a 50 ms switch
    proved = paid(4, 0.005)
    assert _outcome(guard, small, None, False, planning_s=0.02, paid=proved) == "idle"
    assert _outcome(guard, small, None, False, planning_s=0.02, paid=paid(3, 0.005)) == "no-gain"
    assert _outcome(guard, small, None, False, planning_s=0.02, paid=paid(4, 0.010)) == "no-gain"
    assert _outcome(guard, small, None, False, planning_s=0.0, paid=proved) == "no-gain"
    covered = _gain(5e-3, 60e-3)  # 50 ms over the horizon: refused, yet worth its planning
    assert _outcome(guard, covered, None, False, planning_s=0.02, paid=proved) == "no-gain"
    guard.planning_idle()  # what the Balancer does with an `idle` outcome
    assert guard.skip_replan() and not guard.skip_replan()


def test_the_backtest_prices_the_last_candidate_on_the_steps_since_by_hand() -> None:
    """`_replica_case` (tests/test_runtime_balancer.py): on counts [[10, 30], [20, 40]] the
    replica saves 27,840 - 23,680 = 4,160 ns of busy for 512 ns of Trans + Agg: 3,648 ns a
    step. On the cold counts [[30, 10], [40, 20]] it loses 3,840 + 512 = 4,352 ns a step
    (tests/test_runtime_balancer.py, `test_guard_prices_a_plan_by_its_live_parts`). Two steps
    of each since the last candidate was made: the forecast (their mean, [[20, 20], [30, 30]])
    and the steps' own mean decide; their mean is (3,648 - 4,352) / 2 = -352 ns a step."""
    from poise.cost.model import CostModel
    from poise.runtime.planning_job import backtest, run_job

    cost, static, replica, counts = _replica_case()
    cold = np.array([[[30, 10], [40, 20]]], dtype=float)
    steps = np.stack([counts, counts, cold, cold])  # [S, L, D, E]
    job = replace(
        _replica_job(_probes_reading(counts, np.zeros(1))), current=static, backtest_plan=replica,
        backtest_counts=steps[:2],
    )  # fmt: skip
    tested = backtest(cost, cost, job)
    assert tested is not None and not tested.same
    assert tested.recent_busy_gain_s == pytest.approx(4_160e-9)
    assert tested.live_gain_s() == pytest.approx(3_648e-9)
    mixed = backtest(cost, cost, replace(job, backtest_counts=steps))
    assert mixed is not None
    assert mixed.recent_busy_gain_s + mixed.recent_transfers_gain_s == pytest.approx(-352e-9)
    assert mixed.live_gain_s() <= -352e-9 + 1e-15
    # none where a plan other than static is in force, without a candidate, steps or guard
    assert backtest(cost, cost, replace(job, current=replica)) is None
    assert backtest(cost, cost, replace(job, backtest_plan=None)) is None
    assert backtest(cost, cost, replace(job, backtest_counts=steps[:0])) is None
    assert backtest(cost, cost, replace(job, guarded=False)) is None
    # the planning job carries it to the leader, priced on its fitted cluster (the prior's
    # constants here: the job's rows measure nothing)
    result = run_job(job)
    assert result.backtest is not None
    fitted = CostModel(result.cluster, job.spec)
    assert result.backtest == backtest(fitted, CostModel(job.prior, job.spec), job)


def test_without_an_earlier_candidate_the_job_backtests_its_windows_older_half() -> None:
    """The run's first re-plan (no earlier candidate, or none with steps since): EPLB's plan
    from the window's older half (hot steps [[10, 30], [20, 40]]: e1 replicated on d0) is
    priced on the newer half. On hot steps it saves 3,648 ns a step (by hand, above): held.
    Hot then cold ([[30, 10], [40, 20]]): it loses 4,352 ns a step there: not held. The plan
    is the one `live_plan` makes from the older half, and none is made under another plan in
    force, with the guard off, with a candidate that has steps since, or from one step."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.leader import forecast_held
    from poise.runtime.planning_job import holdout, live_plan, run_job

    cost, static, replica, hot = _replica_case()
    cold = np.array([[[30, 10], [40, 20]]], dtype=float)
    job = replace(
        _replica_job(_probes_reading(hot, np.zeros(1))), current=static, policy="eplb",
        history=np.stack([hot, hot, hot, hot]), probes=None,
    )  # fmt: skip
    result = run_job(job)
    assert result.backtest is not None and result.held_out
    assert result.backtest.live_gain_s() == pytest.approx(3_648e-9) and forecast_held(result)
    # a holdout vouches for no candidate with replicas (EPLB's here): the leader waits
    assert result.assessment.candidate_transfers_s > 0
    assert not forecast_held(result, result.assessment)
    assert forecast_held(replace(result, held_out=False), result.assessment)
    guard = SwitchGuard(horizon=10, margin=0.0)
    held = result.backtest
    assert _outcome(guard, result.assessment, held) == "adopt"  # a backtest would do
    assert _outcome(guard, result.assessment, held, held_out=True) == "unsettled"
    homes = _gain(10e-3)  # a candidate without replicas: the holdout vouches for it
    assert _outcome(guard, homes, held, held_out=True) == "adopt"
    turned = replace(job, history=np.stack([hot, hot, cold, cold]))
    result = run_job(turned)
    assert result.backtest.live_gain_s() == pytest.approx(-4_352e-9)
    assert not forecast_held(result)
    plan, newer = holdout(turned, cost.cluster, {})
    made, _ = live_plan("eplb", job.predictor, turned.history[:2], static, cost.cluster,
                        job.spec, job.slots, {}, False)  # fmt: skip
    assert plan.digest() == made.digest() and plan.placement.copies[0, 0, 1] == 1
    np.testing.assert_array_equal(newer, turned.history[2:])
    three = replace(turned, history=turned.history[:3])  # an odd window: the newer half longer
    np.testing.assert_array_equal(holdout(three, cost.cluster, {})[1], turned.history[1:3])
    # none under another plan, without the guard, with a backtest of its own, from one step
    assert holdout(replace(turned, current=replica), cost.cluster, {}) is None
    assert holdout(replace(turned, guarded=False), cost.cluster, {}) is None
    earlier = replace(turned, backtest_plan=replica, backtest_counts=turned.history[3:])
    assert holdout(earlier, cost.cluster, {}) is None
    assert run_job(earlier).backtest.live_gain_s() == pytest.approx(-4_352e-9)  # its own
    assert not run_job(earlier).held_out
    no_steps = replace(earlier, backtest_counts=turned.history[:0])
    assert holdout(no_steps, cost.cluster, {}) is not None  # a candidate with no steps since
    assert holdout(replace(turned, history=turned.history[:1]), cost.cluster, {}) is None


def test_a_job_backtesting_a_holdout_plans_autos_homes_only() -> None:
    """On `_replica_case`'s hot steps `auto` replicates (both devices hold both experts) where an
    earlier candidate is backtested; where the job backtests a holdout instead (the run's first
    re-plan) it weighs homes-only plans (`homes_only_options`), for its candidate and for the
    holdout's plan alike."""
    from poise.runtime.planning_job import holdout, holdout_due, run_job

    cost, static, replica, hot = _replica_case()
    job = replace(
        _replica_job(_probes_reading(hot, np.zeros(1))), current=static, policy="auto",
        history=np.stack([hot, hot, hot, hot]), probes=None,
    )  # fmt: skip
    later = replace(job, backtest_plan=replica, backtest_counts=job.history[2:])
    assert holdout_due(job) and not holdout_due(later)
    assert run_job(later).plan.placement.replicas().any()
    first = run_job(job)
    assert first.held_out and not first.plan.placement.replicas().any()
    assert first.backtest is not None and first.backtest.candidate_transfers_s == 0  # its plan too
    # the next job backtests the candidate with every policy weighed, as a later job makes it
    again = run_job(later)
    assert first.next_backtest().digest() == again.plan.digest() != first.plan.digest()
    assert again.backtest_next is None and again.next_backtest() is again.plan
    homes = run_job(replace(job, homes_only=True))  # homes only for the clock: nothing else
    assert homes.held_out and homes.backtest_next is None
    assert holdout(job, cost.cluster, {})[0].placement.replicas().any()  # options as given


def test_the_balancer_backtests_the_candidate_a_job_names_for_it() -> None:
    """The Balancer keeps `JobResult.next_backtest()` of each job it takes as the last
    candidate, and the next job from the static layout backtests that plan."""
    import dataclasses

    from poise.core.placement import Assignment, Placement, Plan
    from tests.test_runtime_balancer import _one_rank_balancer, _one_rank_steps, _spy_jobs

    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
    balancer.guard.skip_replan = lambda: False  # one rank idles: plan at every boundary here
    p = Placement.from_homes(np.array([[0, 0, 0, 0]]), 1, 5)
    named = Plan("named", p, Assignment.to_home(p), balancer.static_plan.transfers)
    take = balancer.planner.take
    backtested = _spy_jobs(balancer, lambda job, _: job.backtest_plan)

    def took():
        done = take()
        return dataclasses.replace(done, value=dataclasses.replace(done.value, backtest_next=named))

    balancer.planner.take = took
    _one_rank_steps(model, opt, balancer, 4)
    balancer.close()
    assert backtested[0] is None and backtested[1] is named


def test_with_holdouts_off_the_first_job_weighs_every_plan_and_vouches_for_none() -> None:
    """`PlanningJob(holdout=False)` (`Balancer(holdout=False)`, the training setting
    `holdout`): the run's first job makes no holdout, so `auto` weighs its plans with replicas
    as a later job does, and the leader finds no forecast held: the first adoption waits for
    the next job's backtest. The Balancer hands the setting to every job."""
    from poise.runtime.leader import forecast_held
    from poise.runtime.planning_job import holdout_due, run_job
    from tests.test_runtime_balancer import _one_rank_balancer, _one_rank_steps, _spy_jobs

    _, static, _, hot = _replica_case()
    job = replace(
        _replica_job(_probes_reading(hot, np.zeros(1))), current=static, policy="auto",
        history=np.stack([hot, hot, hot, hot]), probes=None, holdout=False,
    )  # fmt: skip
    assert not holdout_due(job) and holdout_due(replace(job, holdout=True))
    first = run_job(job)
    assert not first.held_out and first.backtest is None
    assert first.plan.placement.replicas().any()  # every policy weighed
    assert not forecast_held(first, first.assessment)
    for setting in (False, True):
        model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
        balancer.holdout = setting
        balancer.guard.skip_replan = lambda: False
        seen = _spy_jobs(balancer, lambda job, _: job.holdout)
        _one_rank_steps(model, opt, balancer, 4)
        balancer.close()
        assert seen and set(seen) == {setting}


def test_training_runs_without_the_holdout_unless_asked() -> None:
    """`poise train`'s Balancer (`train.setup.make_balancer`) has no holdout by default
    (`TrainConfig.holdout` false: a router trained from scratch still moves at the first
    re-plan, docs/benchmarks.md), while the Balancer's own default keeps it for replays; the
    setting `holdout: true` reaches the Balancer."""
    import inspect

    from poise.models.gpt import GPTMoE
    from poise.runtime.balancer import Balancer
    from poise.train.config import TrainConfig
    from poise.train.setup import make_balancer, make_optimizer

    assert inspect.signature(Balancer).parameters["holdout"].default is True
    cfg = TrainConfig(policy="auto", steps=10)
    for setting, want in ((None, False), (True, True)):
        run = cfg if setting is None else cfg.replace(holdout=setting)
        model = GPTMoE(run.model_config(), seed=0)
        balancer = make_balancer(run, model, make_optimizer(model, run), 1, 1, None)
        try:
            assert balancer.holdout is want
        finally:
            balancer.close()


def test_training_rechecks_an_unsettled_candidate_unless_told_not_to() -> None:
    """`recheck` is on in `poise train` (`TrainConfig.recheck`) and in the Balancer, and the
    setting `recheck: false` reaches the Balancer; without the guard there is no `unsettled`
    refusal to recheck."""
    from poise.models.gpt import GPTMoE
    from poise.train.config import TrainConfig
    from poise.train.setup import make_balancer, make_optimizer

    cfg = TrainConfig(policy="auto", steps=10)
    for run, want in (
        (cfg, True),
        (cfg.replace(recheck=False), False),
        (cfg.replace(balance_guard=False), False),
    ):
        model = GPTMoE(run.model_config(), seed=0)
        balancer = make_balancer(run, model, make_optimizer(model, run), 1, 1, None)
        try:
            assert balancer.recheck is want
            assert balancer.replan_phase == 0
        finally:
            balancer.close()


def test_the_recheck_shifts_the_cadence_once_a_run() -> None:
    """`recheck`: the first `unsettled` refusal (decided at the boundary after a request at 10,
    every 10 steps) moves the next request to 15 and the cadence with it; a later refusal keeps
    the shifted cadence (planning does not double while loads move); a refusal decided after
    the half-period point (a lag of 6) shifts nothing."""
    from tests.test_runtime_balancer import _one_rank_balancer

    _, _, balancer = _one_rank_balancer(replan_every=10, plan_lag=1)
    try:
        assert balancer.recheck and balancer.replan_phase == 0
        balancer._requested_at = 10
        balancer._shift_after_unsettled(decided_at=11)
        assert balancer.replan_phase == 5
        assert [s for s in range(1, 40) if balancer.replan_due_at(s)] == [5, 15, 25, 35]
        balancer._requested_at = 25
        balancer._shift_after_unsettled(decided_at=26)
        assert balancer.replan_phase == 5
        balancer.replan_phase = 0
        balancer._requested_at = 10
        balancer._shift_after_unsettled(decided_at=16)
        assert balancer.replan_phase == 0
    finally:
        balancer.close()


def _two_hot_homes_job(retarget: bool):
    """`tests/test_replica_budget.py`'s two layers (homes e0, e1 on d0; e2, e3 on d1; a spare
    slot a device and layer) at the run's first re-plan, the static layout in force, no
    holdout: both of d0's experts are hot on every step, so `auto` moves a home (e1 to d1)."""
    from poise.core.placement import Assignment
    from tests.helpers import toy_cluster, toy_spec
    from tests.test_replica_budget import SLOTS, D, E, _plan
    from tests.test_runtime_balancer import _probes_reading, _replica_case, _replica_job

    spec = toy_spec(experts=E, layers=2, d_model=8, d_expert=16)
    history = np.full((12, 2, D, E), 4.0)
    history[:, :, :, :2] = 30.0
    static = _plan([], spec)
    static = replace(static, policy="static", assignment=Assignment.to_home(static.placement))
    job = _replica_job(_probes_reading(_replica_case()[3], np.zeros(1)))
    return replace(
        job, history=history, fit_counts=history[:0], fit_rows=job.fit_rows[:0],
        settled=np.zeros(0, dtype=bool), static_counts=history[:0], balanced_counts=history[:0],
        probes=None, calibrate=False, policy="auto", current=static, static=static, spec=spec,
        slots=SLOTS, split_tokens=True, holdout=False, prior=toy_cluster(D, bw=1e9, flops=1e9),
        retarget=retarget,
    )  # fmt: skip


def test_a_replica_trial_from_the_static_layout_needs_no_forecast() -> None:
    """Where the Balancer retargets, a candidate that keeps the homes in force rests on no
    forecast (its replicas are re-chosen from the step before at every boundary, as its
    assessment priced the recent steps), so the leader adopts it from the static layout without
    a backtest. Where `auto`'s plan moves a home and no backtest vouches for it, the job offers
    the homes in force with the replicas the budget prices least as run instead (a replica
    trial), and names `auto`'s homes move for the next job to backtest. Without retargeting,
    `auto`'s homes move waits (`unsettled`), as before."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.leader import leader_outcome
    from poise.runtime.planning_job import follows_router, run_job

    guard = SwitchGuard(horizon=10, margin=0.0)

    def decided(result) -> str:
        return leader_outcome(
            guard, result, wait_s=0.0, plan_s=0.0, planning_s=0.0, on_static=True,
            period_s=0.2, plan_lag=1,
        ).decision  # fmt: skip

    plain = run_job(_two_hot_homes_job(retarget=False))
    static_home = _two_hot_homes_job(False).static.placement.home
    plain_home = plain.plan.placement.home
    assert not np.array_equal(plain_home, static_home)  # auto moves a home
    assert not plain.follows_router and plain.backtest is None
    assert decided(plain) == "unsettled"

    job = _two_hot_homes_job(retarget=True)
    trial = run_job(job)
    np.testing.assert_array_equal(trial.plan.placement.home, static_home)
    assert trial.plan.placement.replicas().sum() > 0 and trial.follows_router
    assert follows_router(job, trial.plan) and not follows_router(job, plain.plan)
    np.testing.assert_array_equal(trial.next_backtest().placement.home, plain_home)
    assert trial.assessment.live_gain_s() > 0
    assert decided(trial) == "adopt"
    # a backtest that vouches for the homes move: the job keeps `auto`'s plan
    vouching = replace(job, backtest_plan=plain.plan, backtest_counts=job.history[-3:])
    kept = run_job(vouching)
    assert kept.backtest is not None and kept.backtest.live_gain_s() > 0
    assert not np.array_equal(kept.plan.placement.home, static_home) and not kept.follows_router
    assert decided(kept) == "adopt"
    # with homes only asked for (the clock refuted replicas), no trial
    assert not run_job(replace(job, homes_only=True)).plan.placement.replicas().any()
    # a plan that routes by groups (HybridEP's) keeps its replicas where they are: not forecast-free
    a = trial.plan.assignment
    grouped = replace(
        trial.plan,
        assignment=replace(a, group_weights=trial.plan.placement.copies.transpose(0, 2, 1) * 1.0,
                           group_size=1),
    )  # fmt: skip
    assert grouped.assignment.grouped and not follows_router(job, grouped)
