"""`poise.plan.persistence`: how long a load pattern has held, and the horizon it earns.

References: hand-computed distances on small histories; a stationary trace against one whose
hot expert moved; `auto`'s choice between replicas and a re-placement as the horizon grows."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.errors import ConfigError
from poise.plan.persistence import BAND, carried_age, pattern_age, persistence_horizon


def _steps(rows: list[list[float]]) -> np.ndarray:
    """`[S, 1, E]` from one row of per-expert tokens a step."""
    return np.asarray(rows, dtype=np.float64)[:, None, :]


def test_a_stationary_history_holds_for_all_of_it():
    history = _steps([[30, 10, 10, 10]] * 12)
    assert pattern_age(history, history[-1], recent=4) == 12
    assert persistence_horizon(history, history[-1], base=4) == 12
    assert persistence_horizon(history[:3], history[-1], base=4) == 4  # never below base


def test_the_age_ends_at_the_newest_step_outside_the_band():
    """Forecast [20, 20] (40 tokens). Steps 2-5 alternate [21, 19] / [19, 21]: consecutive
    distance 4 / 40 = 0.1, so tau = 0.1 and the band is BAND * 0.1 = 0.2; each lies 0.05 from
    the forecast (inside). Step 1, [30, 10], lies 0.5 from it (outside); step 0 is back on the
    forecast but not counted: the pattern is the newest run of steps within the band."""
    assert BAND == 2.0
    history = _steps([[20, 20], [30, 10], [21, 19], [19, 21], [21, 19], [19, 21]])
    forecast = np.array([[20.0, 20.0]])
    assert pattern_age(history, forecast, recent=3) == 4
    assert persistence_horizon(history, forecast, base=3) == 4
    assert persistence_horizon(history, forecast, base=5) == 5
    assert pattern_age(history[-1:], history[-1], recent=3) == 1  # one step: itself


def test_a_pattern_that_moved_is_as_young_as_the_move():
    before = [[40, 5, 5, 5]] * 20
    after = [[5, 5, 40, 5]] * 6
    history = _steps(before + after)
    assert pattern_age(history, history[-1], recent=4) == 6


def test_noise_about_a_steady_pattern_does_not_end_it():
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    history = rng.multinomial(1000, p, size=50)[:, None, :].astype(np.float64)
    forecast = history[-5:].mean(axis=0)
    assert pattern_age(history, forecast, recent=5) >= 40  # sampling noise stays in the band
    moved = history.copy()
    moved[:25] = rng.multinomial(1000, p[::-1], size=25)[:, None, :]
    assert pattern_age(moved, forecast, recent=5) <= 25


def test_a_pattern_that_held_the_whole_window_counts_the_steps_before_it():
    """`held_before` adds to the age only where every step of the window held: a stationary
    window of 12 with 40 steps held before is 52 steps old; the moved window of 26 steps is
    6 old whatever came before. `carried_age` by hand: the last plan at step 100 saw a pattern
    of age 100; at step 110, a window of 100 steps (11-110) overlaps it, and the pattern has
    held since step 1: 110 steps, 10 of them before the window."""
    history = _steps([[30, 10, 10, 10]] * 12)
    assert pattern_age(history, history[-1], recent=4, held_before=40) == 52
    assert persistence_horizon(history, history[-1], base=4, held_before=40) == 52
    moved = _steps([[40, 5, 5, 5]] * 20 + [[5, 5, 40, 5]] * 6)
    assert pattern_age(moved, moved[-1], recent=4, held_before=40) == 6
    assert carried_age((100, 100), 110, 100) == 10
    assert carried_age((100, 250), 110, 100) == 160  # 250 + 10 - 100
    assert carried_age((100, 30), 110, 100) == 0  # it began inside this window
    assert carried_age((5, 100), 110, 100) == 0  # no overlap: the window began after it
    assert carried_age(None, 110, 100) == 0
    with pytest.raises(ConfigError, match="held_before"):
        pattern_age(history, history[-1], recent=4, held_before=-1)


def test_bad_shapes_and_bases_are_refused():
    with pytest.raises(ConfigError, match="history"):
        pattern_age(np.zeros((3, 4)), np.zeros((1, 4)), recent=2)
    with pytest.raises(ConfigError, match="recent"):
        pattern_age(np.zeros((3, 1, 4)), np.zeros((1, 4)), recent=0)
    with pytest.raises(ConfigError, match="horizon"):
        persistence_horizon(np.zeros((3, 1, 4)), np.zeros((1, 4)), base=0)
    assert pattern_age(np.zeros((0, 1, 4)), np.ones((1, 4)), recent=2) == 0
    assert pattern_age(np.ones((3, 1, 4)), np.zeros((1, 4)), recent=2) == 0


def _zipf_case() -> tuple[np.ndarray, np.ndarray, object, object]:
    """2 layers of 32 zipf(1.2) experts on the `cpu-2` cluster, the same loads for 30 steps."""
    from poise.core.presets import get_cluster

    from .helpers import toy_spec

    cluster = get_cluster("cpu-2")
    spec = toy_spec(experts=32, layers=2, d_model=128, d_expert=1024, top_k=2, tokens=1024)
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 33) ** 1.2
    p /= p.sum()
    loads = np.zeros((2, 2, 32))
    for layer in range(2):
        loads[layer, :, rng.permutation(32)] = (2048 * p)[:, None]
    history = np.repeat(loads.sum(axis=1)[None], 30, axis=0)
    return loads, history, cluster, spec


def _auto(options: dict) -> tuple[object, object]:
    from poise.cost.model import CostModel
    from poise.plan.policies import PlanContext, make_plan

    loads, history, cluster, spec = _zipf_case()
    ctx = PlanContext.create(
        cluster, spec, slots_per_device=18, history=history, options=options,
        cost=CostModel(cluster, spec),
    )  # fmt: skip
    static = make_plan("static", loads, None, ctx)
    return make_plan("auto", loads, static, ctx), static


def test_auto_prices_a_lasting_pattern_over_its_age():
    """A pattern that held all 30 steps of the history earns a 30-step horizon from a base of 5:
    the plan is the one a fixed horizon of 30 makes, and, with migration priced 3 times the
    model (as a run's measured switches set it), it moves homes where 5 steps of horizon keep
    replicas instead."""
    grown, static = _auto({"auto": {"base_horizon": 5, "migration_scale": 3.0}})
    fixed30, _ = _auto({"auto": {"horizon": 30, "migration_scale": 3.0}})
    fixed5, _ = _auto({"auto": {"horizon": 5, "migration_scale": 3.0}})
    assert grown.notes["horizon"] == 30.0 and fixed5.notes["horizon"] == 5.0
    assert grown.digest() == fixed30.digest()

    def moved(plan) -> int:
        return int((plan.placement.home != static.placement.home).sum())

    assert moved(grown) > 0 == moved(fixed5)
    assert grown.placement.replicas().sum() < fixed5.placement.replicas().sum()


def test_auto_stops_its_horizon_at_the_runs_end():
    """Option `steps_left` caps the horizon, grown or fixed: with 5 steps left the lasting
    pattern's plan is the one 5 steps of horizon make (replicas, no home moved), with more
    left than the pattern's age nothing changes, and no horizon falls below one step."""
    grown, _ = _auto({"auto": {"base_horizon": 5, "migration_scale": 3.0}})
    fixed5, static = _auto({"auto": {"horizon": 5, "migration_scale": 3.0}})
    ending, _ = _auto({"auto": {"base_horizon": 5, "migration_scale": 3.0, "steps_left": 5}})
    assert ending.notes["horizon"] == 5.0 and ending.digest() == fixed5.digest()
    assert not (ending.placement.home != static.placement.home).any()
    later, _ = _auto({"auto": {"base_horizon": 5, "migration_scale": 3.0, "steps_left": 40}})
    assert later.notes["horizon"] == 30.0 and later.digest() == grown.digest()
    fixed, _ = _auto({"auto": {"horizon": 30, "migration_scale": 3.0, "steps_left": 5}})
    assert fixed.notes["horizon"] == 5.0 and fixed.digest() == fixed5.digest()
    last, _ = _auto({"auto": {"horizon": 30, "migration_scale": 3.0, "steps_left": 0}})
    assert last.notes["horizon"] == 1.0


def test_auto_prices_a_pattern_older_than_its_window_over_its_whole_age():
    """The 30-step window held throughout and the caller says the pattern held 70 steps
    before it: the horizon is 100, as a fixed horizon of 100 makes it, and the note says the
    age. Where the window did not hold throughout, `held_before` adds nothing."""
    grown, _ = _auto({"auto": {"base_horizon": 5, "migration_scale": 3.0, "held_before": 70}})
    fixed, _ = _auto({"auto": {"horizon": 100, "migration_scale": 3.0}})
    assert grown.notes["horizon"] == 100.0 and grown.notes["pattern_age"] == 100
    assert grown.digest() == fixed.digest()
    assert fixed.notes["pattern_age"] is None  # a fixed horizon reads no age


def test_the_simulator_carries_a_patterns_age_past_its_window():
    """A stationary trace of 250 steps replayed with re-plans every 10: the simulator's
    window is 100 steps, and `auto`'s last plan (made at step 240 from steps 140-239) still
    reads the pattern's whole age, 240 steps, as a live run would."""
    from poise.sim.simulator import HISTORY_STEPS, simulate

    from .helpers import toy_cluster, toy_spec

    assert HISTORY_STEPS == 100
    counts = np.zeros((250, 1, 2, 8), dtype=np.int64)
    counts[:, 0, :, :] = [40, 20, 10, 10, 5, 5, 5, 5]
    result = simulate(counts, toy_cluster(2), toy_spec(experts=8, layers=1), ["auto"],
                      replan_every=10)  # fmt: skip
    assert result.runs["auto"].last_plan.notes["pattern_age"] == 240


def test_the_guard_credits_a_plan_over_the_horizon_it_was_made_for():
    """`plan_horizon` takes an `auto` plan's own horizon where it is longer than the job's, and
    the controller credits the saving over it: a switch that 5 steps of saving do not pay, 30
    do."""
    from dataclasses import replace

    from poise.runtime.control.controller import Adopt, Controller, Keep
    from poise.runtime.control.job import plan_horizon
    from poise.runtime.control.pricing import Priced
    from tests.helpers import replica_job

    grown, static = _auto({"auto": {"base_horizon": 5, "migration_scale": 3.0}})
    job = replica_job(horizon=5)
    assert plan_horizon(grown, job) == 30 and plan_horizon(grown, replace(job, horizon=40)) == 40
    assert plan_horizon(static, job) == 5  # no note: the job's own
    assert plan_horizon(grown, replace(job, steps_left=12)) == 12  # never past the run's end
    c = Priced(grown, forecast_gain_s=0.01, switch_s=0.1, forecast_free=True, horizon=5)
    assert isinstance(Controller(margin=0.0).decide([c], None, None), Keep)  # 5 x 10 ms < 100
    over = Controller(margin=0.0).decide([replace(c, horizon=30)], None, None)
    assert isinstance(over, Adopt) and over.gain_s == pytest.approx(0.3)  # 30 x 10 ms
