"""No untimed replicas the clock could not judge before the run ends (`leader`, rule 4).

`leader.trial_judgeable` by hand; `leader_outcome` refuses a candidate with replicas as
`unjudged` where the Balancer says no plan with replicas was timed and none adopted now could
be; the Balancer says so from the run's length, its probe cadence and the verdicts it shared.
"""

from __future__ import annotations

import dataclasses

from poise.runtime.verdict import Verdict
from tests.test_forecast_backtest import _gain, _outcome
from tests.test_runtime_balancer import _one_rank_balancer, _one_rank_steps, _spy_jobs


def test_a_trial_is_judgeable_with_room_for_the_clocks_probes_and_the_replan_that_reads_them():
    """4 probes (`MIN_PROBES`) one every 5 steps, then a re-plan every 10: 30 steps."""
    from poise.runtime.leader import trial_judgeable
    from poise.runtime.verdict import MIN_PROBES

    assert MIN_PROBES == 4
    assert trial_judgeable(30, 5, 10) and not trial_judgeable(29, 5, 10)
    assert trial_judgeable(None, 5, 10)  # the run's length is not known
    assert trial_judgeable(0, 0, 10)  # nothing probes: no clock to wait for


def test_the_leader_refuses_blind_replicas_only(monkeypatch) -> None:
    """A candidate saving 10 ms a step for a 50 ms switch, under a plan in force (no backtest
    needed): with replicas (Trans and Agg priced) and `blind_replicas`, `unjudged`; without
    replicas, or not blind, or with the guard off, as before."""
    import poise.runtime.leader as leader
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.planner.broadcast import ADOPTING

    guard = SwitchGuard(horizon=10, margin=0.0)
    replicas = dataclasses.replace(_gain(10e-3, 50e-3), candidate_transfers_s=1e-3)
    homes = _gain(10e-3, 50e-3)
    outcome = leader.leader_outcome

    def blind(*args, **kw):
        return outcome(*args, **kw, blind_replicas=True)

    assert _outcome(guard, replicas, None, on_static=False) == "adopt"
    monkeypatch.setattr(leader, "leader_outcome", blind)
    assert _outcome(guard, replicas, None, on_static=False) == "unjudged"
    assert "unjudged" not in ADOPTING and not guard.skip_replan()  # no backoff
    assert _outcome(guard, homes, None, on_static=False) == "adopt"
    assert _outcome(SwitchGuard(horizon=10, enabled=False), replicas, None) == "off"


def _spy_blind(monkeypatch) -> list[bool]:
    """The `blind_replicas` the Balancer passes to every `leader_outcome` from now on, in a
    list that fills as the decisions come."""
    import poise.runtime.plan_cycle as plan_cycle

    seen: list[bool] = []
    outcome = plan_cycle.leader_outcome

    def spy(*args, **kw):
        seen.append(kw["blind_replicas"])
        return outcome(*args, **kw)

    monkeypatch.setattr(plan_cycle, "leader_outcome", spy)
    return seen


def test_the_balancer_is_blind_to_replicas_until_the_clock_timed_them(monkeypatch) -> None:
    """A 12-step run re-planning every 2 steps with probes every 5: no decision leaves the
    4 * 5 + 2 = 22 steps a trial needs, so every decision is blind until a shared verdict read
    from 4 probes says the clock timed replicas; a run of unknown length never is."""
    from poise.runtime.verdict import Verdict

    seen = _spy_blind(monkeypatch)
    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0, guard=False)
    balancer.total_steps, balancer.probes.every = 12, 5
    _one_rank_steps(model, opt, balancer, 2)
    assert seen == [True]
    balancer.note_verdict(Verdict(1.0, 0.1, 3, wall_saving_s=None, probes=4))  # no clock read
    _one_rank_steps(model, opt, balancer, 2)
    assert seen == [True, True]
    balancer.note_verdict(Verdict(1.0, 0.1, 3, wall_saving_s=2e-3, wall_se_s=1e-3, probes=3))
    _one_rank_steps(model, opt, balancer, 2)
    assert seen == [True, True, True]  # fewer probes than the clock needs
    balancer.note_verdict(Verdict(1.0, 0.1, 3, wall_saving_s=2e-3, wall_se_s=1e-3, probes=4))
    _one_rank_steps(model, opt, balancer, 2)
    assert seen == [True, True, True, False]
    balancer.total_steps = None  # an open-ended run: always judgeable
    balancer._replicas_timed = False
    _one_rank_steps(model, opt, balancer, 2)
    assert seen[-1] is False
    balancer.close()


def test_a_request_whose_decision_would_be_blind_plans_homes_only() -> None:
    """The same 12-step run with the guard on: every job is requested homes only
    (`PlanningJob.homes_only`) until a verdict read from 4 probes says the clock timed
    replicas; then, and in a run of unknown length, in full. With the guard off (rule 4 off),
    never homes only."""
    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
    balancer.total_steps = 12
    jobs = _spy_jobs(balancer, lambda job, _: job.homes_only)
    balancer.guard.skip_replan = lambda: False  # one rank idles: plan at every boundary here
    _one_rank_steps(model, opt, balancer, 2)
    assert jobs == [True] and balancer.probes.every == 5
    balancer.note_verdict(Verdict(1.0, 0.1, 3, wall_saving_s=2e-3, wall_se_s=1e-3, probes=4))
    _one_rank_steps(model, opt, balancer, 2)
    assert jobs == [True, False]
    balancer._replicas_timed = False
    balancer.total_steps = None
    _one_rank_steps(model, opt, balancer, 2)
    assert jobs == [True, False, False]
    balancer.close()
    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0, guard=False)
    balancer.total_steps, balancer.probes.every = 12, 5
    off = _spy_jobs(balancer, lambda job, _: job.homes_only)
    _one_rank_steps(model, opt, balancer, 2)
    assert jobs == [True, False, False] and off == [False]
    balancer.close()


def test_where_the_ranks_share_their_cores_the_guard_plans_homes_only(monkeypatch) -> None:
    """An open-ended run (never blind) re-planning every 2 steps: on a cluster whose devices
    share 2 cores' worth of compute (`HostCosts.shared_cores`, CPU ranks wanting more cores
    than the host gives) every job is homes only and the leader is told to refuse replicas as
    blind (another policy's); on the same cluster without sharing, and with the guard off
    (plans adopted as published), neither."""
    import poise.runtime.plan_cycle as plan_cycle

    told = _spy_blind(monkeypatch)

    def jobs(shared: float, guard: bool = True) -> list:
        model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0, guard=guard)
        host = dataclasses.replace(balancer.cluster.host, shared_cores=shared)
        balancer.cluster = dataclasses.replace(balancer.cluster, host=host)
        assert isinstance(balancer, plan_cycle.PlanCycle) and balancer.total_steps is None
        seen = _spy_jobs(balancer, lambda job, _: job.homes_only)
        balancer.guard.skip_replan = lambda: False  # plan at every boundary here
        told.clear()
        _one_rank_steps(model, opt, balancer, 6)
        balancer.close()
        return list(zip(seen, told, strict=True))

    assert jobs(2.0) == [(True, True)] * 3
    assert jobs(0.0) == [(False, False)] * 3
    assert jobs(2.0, guard=False) == [(False, True)] * 3  # the leader's rule 4 needs the guard


def test_poise_train_says_at_start_up_where_it_plans_homes_only() -> None:
    """`shared_cores_note`: one line naming the ranks, the cores' worth they share and homes
    only, for a guarded balancing run on shared cores; None without sharing or without the
    guard."""
    from poise.train.setup import shared_cores_note

    def note(shared: float, guard: bool = True) -> str | None:
        _, _, balancer = _one_rank_balancer(replan_every=2, plan_lag=0, guard=guard)
        host = dataclasses.replace(balancer.cluster.host, shared_cores=shared)
        balancer.cluster = dataclasses.replace(balancer.cluster, host=host)
        try:
            return shared_cores_note(balancer)
        finally:
            balancer.close()

    line = note(0.5)
    assert line is not None and "1 ranks share 0.5 cores'" in line and "homes only" in line
    assert note(0.0) is None and note(0.5, guard=False) is None
