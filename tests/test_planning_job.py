"""One planning job (`poise.runtime.control.job`): the candidates it prices, the exits it offers
where the evidence refutes the plan in force, how far the last forecast missed, and what it
tells `auto` (homes only, the switches' price, the run's end, the load pattern's age)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.plan.predict import Predictor
from poise.runtime.control.job import (
    PlanningJob,
    exits,
    forecast_miss,
    missed,
    planning_options,
    run_job,
)
from poise.runtime.selfcal import fit as selfcal
from tests.helpers import measured_rows, replica_case, replica_job, toy_cluster, toy_spec


def _static_auto_job() -> PlanningJob:
    """`auto` from a static layout whose rank 0 holds the 4 hot experts of 8 (2 ranks, 5 slots
    each), 4 steps of the same counts measured, calibrating."""
    spec = toy_spec(experts=8, d_model=64, d_expert=256)
    home = Placement.from_homes(np.array([[0, 0, 0, 0, 1, 1, 1, 1]]), 2, 5)
    static = Plan("static", home, Assignment.to_home(home), transfers_between(None, home, spec))
    counts = np.array([[[60, 50, 40, 30, 5, 5, 5, 5]] * 2], dtype=float)
    history = np.repeat(counts[None], 4, axis=0)
    return PlanningJob(
        history=history, fit_counts=history, fit_rows=measured_rows(np.full(4, 0.01), ids=True),
        settled=np.ones(4, dtype=bool), current=static, static=static,
        prior=toy_cluster(bw=1e9, flops=1e9), spec=spec, previous=selfcal.Fit(), policy="auto",
        predictor=Predictor("last"), options={}, slots=5, horizon=10, split_tokens=False,
        retarget=True,
    )  # fmt: skip


def test_auto_is_offered_its_plan_and_the_homes_kept_with_replicas() -> None:
    """From the static layout `auto` moves homes; beside it the job offers the static homes with
    the replicas that price least as they would run, which rests on no forecast."""
    result = run_job(_static_auto_job())
    moved, kept = result.candidates
    assert not moved.forecast_free and moved.plan.digest() == result.forecast.digest()
    assert kept.forecast_free and kept.plan.placement.replicas().sum() > 0
    np.testing.assert_array_equal(
        kept.plan.placement.home, _static_auto_job().current.placement.home
    )
    assert all(c.horizon == 10 and not c.exit for c in result.candidates)
    assert result.evidence is None  # the static layout in force: nothing to judge
    # replicas off (shared cores, or refuted to a ratio of 0): homes only, one candidate
    homes = run_job(replace(_static_auto_job(), replicas=False))
    assert len(homes.candidates) == 1 and not homes.forecast.placement.replicas().any()
    assert set(homes.forecast.notes["candidate_step_s"]) <= {"keep", "permute", "static"}


def test_auto_is_told_homes_only_the_switches_price_and_the_pattern_age() -> None:
    job = _static_auto_job()
    options = planning_options(replace(job, replicas=False, switch_scale=3.0), selfcal.Fit())
    assert options["auto"]["candidates"] == ["permute", "static"]
    assert options["auto"]["migration_scale"] == 3.0 and options["auto"]["held_before"] == 0
    mine = {"auto": {"candidates": ["prophet", "permute"], "horizon": 5}}
    kept = planning_options(replace(job, options=mine, replicas=False), selfcal.Fit())["auto"]
    assert kept["candidates"] == ["permute"] and kept["horizon"] == 5
    assert mine["auto"]["candidates"] == ["prophet", "permute"]  # a copy
    # the switches' scale over the fitted transfers' (a cluster whose transfers are 4x)
    fit = selfcal.Fit(k_transfer=2.0, k_replica=2.0)
    assert planning_options(replace(job, switch_scale=8.0), fit)["auto"]["migration_scale"] == 2.0
    # without calibration the prior's price: the plan depends on the loads alone
    fixed = replace(job, switch_scale=8.0, calibrate=False)
    assert planning_options(fixed, selfcal.Fit())["auto"]["migration_scale"] == 1.0


def test_the_switches_measured_price_steers_auto_only_when_calibrating() -> None:
    job = _static_auto_job()
    moves = run_job(job).forecast
    dear = run_job(replace(job, switch_scale=1e6)).forecast
    assert moves.digest() != job.static.digest() and moves.placement.replicas().sum() == 0
    assert (
        dear.placement.replicas().sum() > 0
        and (dear.placement.home == job.static.placement.home).all()
    )
    fixed = replace(job, calibrate=False)
    assert run_job(replace(fixed, switch_scale=1e6)).forecast.digest() == moves.digest()


def test_no_step_past_the_runs_end_is_credited() -> None:
    job = _static_auto_job()
    assert {c.horizon for c in run_job(replace(job, steps_left=3)).candidates} == {3}
    ending = run_job(replace(job, steps_left=3))
    assert ending.forecast.notes["horizon"] == 3.0  # `auto`'s own horizon stops there too
    carried = run_job(replace(job, held_before=70))  # 4 steps that held, and 70 before them
    assert carried.forecast.notes["pattern_age"] == 74 and carried.candidates[0].horizon == 74
    assert run_job(job).forecast.notes["pattern_age"] == 4


@pytest.mark.parametrize("transfer_s", [0.0, 1.0])
def test_the_exits_are_priced_only_where_the_evidence_refutes_the_plan(transfer_s: float) -> None:
    """`replica_case`'s replica plan in force, 4 settled steps: with no transfer seconds
    measured its model saving (4,160 ns a step) pays and no exit is priced; with 1 s of
    transfers a step it is refuted, and its exit (static: its homes are static's) is priced.
    With the guard off nothing is judged."""
    rows = measured_rows(np.full(4, 0.01), ids=True)
    rows[:, 1 + selfcal.TRANSFERS] = transfer_s
    job = replica_job(fit_rows=rows, calibrate=False)
    result = run_job(job)
    assert result.evidence.source == "model" and result.evidence.steps == 4
    assert result.evidence.refutes == (transfer_s > 0)
    exits_priced = [c.exit for c in result.candidates if c.exit]
    assert exits_priced == ([] if transfer_s == 0 else ["static"])
    assert run_job(replace(job, guarded=False)).evidence is None


def test_a_refuted_plan_on_moved_homes_drops_its_replicas_first() -> None:
    spec = toy_spec(experts=2)
    _, static, replica, _ = replica_case()
    ((name, only),) = exits(replica, static, spec)  # homes are static's already
    assert name == "static" and only.digest() == static.digest()
    swapped = Placement.from_homes(np.array([[1, 0]]), 2, 2)  # e0 on d1, e1 on d0
    moved = swapped.copy()
    moved.copies[0, 1, 1] = 1  # and a replica of e1 on d1
    plan = Plan("m", moved, Assignment.to_home(moved), transfers_between(None, moved, spec))
    (first, alone), (second, back) = exits(plan, static, spec)
    assert (first, second) == ("homes alone", "static")
    assert alone.placement.home.tolist() == [[1, 0]] and not alone.placement.replicas().any()
    assert alone.transfers.migrations is None or not len(alone.transfers.migrations)
    assert back.digest() == static.digest()
    assert back.transfers.migrations[:, 1:].tolist() == [[0, 1, 0], [1, 0, 1]]


def test_how_far_a_forecast_missed_by_hand() -> None:
    """The replica plan against static: it promises 3,648 ns a step on `replica_case`'s counts.
    On steps whose e1 ran cold it gains -4,352 ns: missed wholly (clipped to 1); on the same
    counts, not at all; on steps half and half, 1 - (-352 / 3,648) clipped to 1; on steps that
    gain half again as much... never below 0."""
    cost, static, replica, counts = replica_case()
    job = replica_job()
    same = np.stack([counts] * 3)
    cold = np.stack([np.array([[[30, 10], [40, 20]]], dtype=float)] * 3)
    assert missed(cost, job, replica, same, same) == pytest.approx(0.0, abs=1e-12)
    assert missed(cost, job, replica, same, cold) == 1.0
    assert missed(cost, job, static, same, same) is None  # promised nothing
    hotter = np.stack([np.array([[[0, 40], [20, 40]]], dtype=float)] * 3)  # more e1 on d0
    assert missed(cost, job, replica, same, hotter) == 0.0


def test_the_miss_comes_from_the_last_forecast_else_a_holdout() -> None:
    """With the last job's plan and the steps run since, its own miss; without one, the policy's
    plan from the window's older half priced on its newer half; with too short a window, 1."""
    cost, static, replica, counts = replica_case()
    cold = np.array([[[30, 10], [40, 20]]], dtype=float)
    history = np.stack([counts, counts, cold, cold])
    job = replica_job(history=history, policy="eplb", last=(replica, 2))
    cluster = job.prior
    assert forecast_miss(job, cost, cluster, {}) == 1.0  # its forecast met cold steps
    held = replace(job, history=np.stack([counts] * 4))
    assert forecast_miss(held, cost, cluster, {}) == pytest.approx(0.0, abs=1e-12)
    assert forecast_miss(replace(held, last=(replica, 0)), cost, cluster, {}) == 1.0
    holdout = replace(held, last=None, current=static)  # eplb replicates e1 from two steps
    assert forecast_miss(holdout, cost, cluster, {}) == pytest.approx(0.0, abs=1e-12)
    assert forecast_miss(replace(holdout, history=history), cost, cluster, {}) == 1.0
    assert forecast_miss(replace(holdout, history=history[:1]), cost, cluster, {}) == 1.0
    assert run_job(job).miss == 1.0 and run_job(held).miss == pytest.approx(0.0, abs=1e-12)
    assert run_job(replace(job, guarded=False)).miss == 0.0


def test_the_fit_takes_every_ranks_own_expert_seconds() -> None:
    """Calibrating, the compute is fitted on every rank's seconds where the job has them: 3 x
    the model's per device (steps scaled so that the ranks' rows differ from step to step)."""
    from poise.cost.per_step import device_compute

    cost, _, replica, counts = replica_case()
    steps = np.stack([counts * k for k in range(1, 5)])
    own = 3.0 * device_compute(cost, replica, steps)
    fitted = run_job(replica_job(fit_counts=steps, history=steps, fit_rank_experts=own)).fit
    assert fitted.k_compute == pytest.approx(3.0)
