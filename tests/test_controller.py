"""The controller's rule on hand-built candidates and evidence (`poise.runtime.control.controller`).

Every figure is in seconds a step; each candidate's noise and horizon are set by hand, so each
decision can be checked against the rule's inequality computed here.
"""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement, Plan
from poise.runtime.control.controller import MAX_BACKOFF, Adopt, Controller, Keep, Revert
from poise.runtime.control.evidence import Evidence
from poise.runtime.control.pricing import Priced

HOME = np.array([[0, 0, 1, 1]])  # one layer, 4 experts on 2 devices


def plan(name: str, home=HOME, replica: tuple[int, int] | None = None) -> Plan:
    """A plan on `home` with one replica `(expert, device)` where given."""
    copies = np.zeros((1, 2, 4), np.int32)
    copies[0, home[0], np.arange(4)] = 1
    if replica is not None:
        copies[0, replica[1], replica[0]] = 1
    placement = Placement(np.asarray(home), copies, slots_per_device=3)
    return Plan(name, placement, Assignment.even(placement), None)


def candidate(gain: float, switch: float = 0.0, horizon: int = 10, se: float = 0.0, **kw) -> Priced:
    """A candidate with replicas that keeps the homes unless `moves` (then no replica)."""
    moves = kw.pop("moves", False)
    p = plan("moved", home=np.array([[0, 1, 0, 1]])) if moves else plan("auto", replica=(0, 1))
    n = kw.pop("n", 10)
    return Priced(
        p, forecast_gain_s=gain, recent_gain_s=gain, se_s=se, n_recent=n, horizon=horizon,
        switch_s=switch, forecast_free=not moves, **kw,
    )  # fmt: skip


def clock(saving: float, se: float, predicted: float = 0.010, probes: int = 4) -> Evidence:
    return Evidence(
        "clock", saving, se, probes - 1, probes, predicted, probes, saving, se, predicted
    )


def test_a_candidate_is_adopted_only_when_its_gain_covers_its_switch() -> None:
    c = Controller(margin=0.2)
    # 1 ms a step over 10 steps = 10 ms, against a switch of 100 ms x 1.2
    assert isinstance(c.decide([candidate(0.001, switch=0.100)], None, None), Keep)
    # against 5 ms x 1.2 = 6 ms it pays: adopted, with its reason in words
    action = c.decide([candidate(0.001, switch=0.005)], None, None)
    assert isinstance(action, Adopt) and action.plan.policy == "auto"
    assert action.reason.startswith("adopt: auto (1 replicas, 0 homes moved) saves 1.0 ms/step")
    assert action.gain_s == pytest.approx(0.010) and action.switch_s == pytest.approx(0.005)
    # the margin is the boundary: 10 ms against 9 ms x 1.2 = 10.8 ms is refused
    assert isinstance(Controller().decide([candidate(0.001, switch=0.009)], None, None), Keep)


def test_the_recent_steps_spread_is_taken_off_the_gain() -> None:
    # 2 ms a step with a standard error of 0.5 ms from 10 steps: t(9) = 2.262 takes 1.131 off
    c = Controller(margin=0.0)
    gain = (0.002 - 2.262 * 0.0005) * 10
    assert isinstance(
        c.decide([candidate(0.002, se=0.0005, switch=gain * 0.99)], None, None), Adopt
    )
    c = Controller(margin=0.0)
    assert isinstance(c.decide([candidate(0.002, se=0.0005, switch=gain * 1.01)], None, None), Keep)


def test_no_imbalance_costs_nothing() -> None:
    """Balanced loads: no candidate gains, so nothing switches and nothing backs off."""
    c = Controller()
    for _ in range(5):
        action = c.decide([candidate(0.0), Priced(plan("static"), same=True)], None, None)
        assert isinstance(action, Keep) and action.switch_s == 0.0
    assert c.skip == 0 and not c.skip_replan()
    assert c.decide([Priced(plan("static"), same=True)], None, None).reason == (
        "keep: no candidate differs from the plan in force"
    )


def test_a_plan_near_the_runs_end_is_not_adopted() -> None:
    """The same gain credited over the 3 steps the run has left does not repay its switch."""
    assert isinstance(Controller().decide([candidate(0.002, 0.010, horizon=10)], None, None), Adopt)
    assert isinstance(Controller().decide([candidate(0.002, 0.010, horizon=3)], None, None), Keep)


def test_a_forecast_that_missed_holds_back_moving_homes_but_not_keeping_them() -> None:
    moved = candidate(0.003, switch=0.005, moves=True)
    kept = candidate(0.002, switch=0.005)
    # the last forecast held: the homes move, which gains more, is adopted
    assert Controller().decide([moved, kept], None, None, miss=0.0).plan is moved.plan
    # it missed by half: 3 - 2 * 1.5 = 0 ms a step credited; the homes kept win
    assert Controller().decide([moved, kept], None, None, miss=0.5).plan is kept.plan
    # missed wholly, and nothing keeps the homes: nothing is adopted
    assert isinstance(Controller().decide([moved], None, None, miss=1.0), Keep)


def test_a_plan_that_pays_is_kept_and_its_ratio_learned() -> None:
    c = Controller()
    c.promised_s = 0.012
    ev = clock(0.008, 0.001, predicted=0.010)  # conclusive: 8 +- 1 ms (t(3) = 3.182)
    action = c.decide([Priced(plan("auto"), same=True)], ev, "replicas")
    assert isinstance(action, Keep)
    assert c.ratio["replicas"] == pytest.approx(0.5 * (1.0 + 0.8))  # halfway to 8 / 10
    assert c.ratio["homes"] == 1.0 and c.skip == 0
    # an inconclusive clock teaches nothing
    c.decide([Priced(plan("auto"), same=True)], clock(0.008, 0.005), "replicas")
    assert c.ratio["replicas"] == pytest.approx(0.9)


def test_a_plan_the_clock_refutes_is_reverted_and_the_replans_back_off() -> None:
    c = Controller()
    homes_alone = Priced(plan("homes"), forecast_gain_s=-0.004, horizon=10, exit="homes alone")
    static = Priced(
        plan("static"), forecast_gain_s=-0.004, switch_s=0.050, horizon=10, exit="static"
    )
    fresh = candidate(0.001)  # priced by the model the clock refuted: not weighed
    ev = clock(-0.010, 0.002)  # slower by 10 +- 2 ms: conclusive
    action = c.decide([fresh, homes_alone, static], ev, "replicas")
    assert isinstance(action, Revert) and action.plan is homes_alone.plan  # no migration
    assert action.reason.startswith("revert: the clock measured -10.0 +- 2.0 ms/step over 4")
    assert c.ratio["replicas"] == pytest.approx(0.5)  # halfway to 0
    assert c.promised_s is None  # the homes alone: nobody predicted their saving
    # the next re-plan is skipped; a second revert doubles the wait
    assert c.skip_replan() and not c.skip_replan()
    c.decide([fresh, homes_alone, static], ev, "replicas")
    assert [c.skip_replan() for _ in range(3)] == [True, True, False]
    for _ in range(6):
        c.decide([fresh, homes_alone, static], ev, "replicas")
    assert c.skip == MAX_BACKOFF
    # an adoption resets the backoff's growth
    c.skip = 0
    assert isinstance(c.decide([candidate(0.010, moves=True)], None, "homes", miss=0.0), Adopt)
    assert c.next_backoff == 1


def test_a_plan_the_model_saw_go_stale_gives_way_to_the_best_option() -> None:
    """Refuted by the model's own counterfactual (the loads moved away from its homes): a fresh
    candidate competes with the exits, at its ratio after the refutation."""
    static = Priced(
        plan("static"), forecast_gain_s=0.001, switch_s=0.004, horizon=10, exit="static"
    )
    stale = Evidence("model", -0.003, 0.0005, 9, 10)
    c = Controller(margin=0.0)
    c.promised_s = 0.004
    fresh = candidate(0.004, switch=0.010, moves=True)  # 0.5 * 4 ms * 10 - 10 = 10 ms > 6 ms
    assert c.decide([fresh, static], stale, "homes", miss=0.0).plan is fresh.plan
    assert c.ratio["homes"] == pytest.approx(0.5) and c.skip == 1
    c = Controller(margin=0.0)
    c.promised_s = 0.004
    small = candidate(0.002, switch=0.010, moves=True)  # 0.5 * 2 ms * 10 - 10 = 0 < 6 ms
    assert c.decide([small, static], stale, "homes", miss=0.0).plan is static.plan
    assert c.promised_s == 0.0  # back on static


def test_a_plan_that_is_slower_but_not_conclusively_so_is_kept() -> None:
    c = Controller()
    static = Priced(plan("static"), forecast_gain_s=0.001, exit="static")
    action = c.decide([Priced(plan("auto"), same=True), static], clock(-0.004, 0.002), "replicas")
    assert isinstance(action, Keep) and c.skip == 0  # -4 + 3.182 * 2 > 0: not refuted


def test_ranks_that_share_their_cores_take_no_replica() -> None:
    c = Controller(replicas_prior=0.0)
    with_replica = candidate(0.005, switch=0.001)
    assert isinstance(c.decide([with_replica], None, None), Keep)
    homes = candidate(0.005, switch=0.001, moves=True)
    assert c.decide([with_replica, homes], None, None, miss=0.0).plan is homes.plan


def test_with_the_guard_off_every_differing_candidate_is_adopted() -> None:
    c = Controller(enabled=False)
    assert isinstance(
        c.decide([candidate(-0.005, switch=1.0)], clock(-1.0, 0.001), "replicas"), Adopt
    )
    assert isinstance(c.decide([Priced(plan("auto"), same=True)], None, None), Keep)


def test_the_promise_adds_up_from_the_static_layout() -> None:
    c = Controller(margin=0.0)
    c.decide([candidate(0.004, moves=True)], None, None, miss=0.0)
    assert c.promised_s == pytest.approx(0.004)
    c.decide([candidate(0.002, moves=True)], None, "homes", miss=0.0)
    assert c.promised_s == pytest.approx(0.006)
    # the model's counterfactual delivered 3 of the 6 ms promised: homes' ratio halfway to 0.5
    ev = Evidence("model", 0.003, 0.0001, 9, 10)
    c.decide([Priced(plan("x"), same=True)], ev, "homes")
    assert c.ratio["homes"] == pytest.approx(0.75)


def test_the_learned_state_round_trips_and_refuses_bad_entries() -> None:
    c = Controller()
    c.ratio["replicas"], c.promised_s, c.skip, c.next_backoff = 0.25, None, 2, 4
    d = Controller()
    d.restore(c.state())
    assert d.state() == c.state()
    bad = {**c.state(), "ratio": {"homes": 1.0, "replicas": 1.5}}
    with pytest.raises(ConfigError, match=r"ratio\.replicas"):
        d.restore(bad, source="poise.pt")
    with pytest.raises(ConfigError, match="skip"):
        d.restore({**c.state(), "skip": -1})
    with pytest.raises(ConfigError, match="unexpected"):
        d.restore({"ratio": {}})
