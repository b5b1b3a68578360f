"""A candidate priced against the plan in force, and a switch priced as the run measured its
switches (`poise.runtime.control.pricing`), by hand on `tests.helpers.replica_case`."""

from __future__ import annotations

import numpy as np
import pytest

from poise.runtime.control.pricing import SwitchPrice, migration_seconds, price, switch_seconds
from poise.runtime.selfcal import fit as selfcal
from tests.helpers import replica_case


def test_a_candidate_is_priced_by_its_live_parts() -> None:
    """Static's busy 27,840 ns against the replica's 23,680 + 512 ns of Trans + Agg: 3,648 ns a
    step; no home moves (the replica's fill is its first Trans, priced in its step). On steps
    where e1 ran cold ([[30, 10], [40, 20]]: static 28,160 ns, the replica 32,000 + 512) the
    recent gain is -4,352 ns, and the candidate's gain is the smaller of the two."""
    cost, static, replica, counts = replica_case()
    p = price(cost, static, replica, counts)
    assert p.forecast_gain_s == pytest.approx(4_160e-9 - 512e-9)
    assert p.gain_s == p.forecast_gain_s and p.recent_gain_s is None
    assert p.transfers_s == pytest.approx(512e-9) and p.kind == "replicas"
    assert p.migration_s == 0.0 and not p.same
    cold = np.array([[[[30, 10], [40, 20]]]], dtype=float)  # [S, L, D, E]
    q = price(cost, static, replica, counts, recent=cold)
    assert q.recent_gain_s == pytest.approx(-4_352e-9) and q.gain_s == q.recent_gain_s
    same = price(cost, static, replica, counts, recent=np.stack([counts, counts]))
    assert same.gain_s == pytest.approx(p.gain_s) and same.se_s == 0.0  # no spread
    assert price(cost, static, static, counts).same
    assert price(cost, replica, static, counts).kind == "homes"


def test_the_recent_steps_spread_gives_the_gains_standard_error() -> None:
    """A hot step gains 3,648 ns, a cold one -4,352: their mean's standard error is the sample
    standard deviation over sqrt(2)."""
    cost, static, replica, counts = replica_case()
    cold = np.array([[[30, 10], [40, 20]]], dtype=float)
    mixed = price(cost, static, replica, counts, recent=np.stack([counts, cold]))
    gains = np.array([3_648e-9, -4_352e-9])
    assert mixed.recent_gain_s == pytest.approx(gains.mean())
    assert mixed.se_s == pytest.approx(gains.std(ddof=1) / np.sqrt(2))
    assert mixed.n_recent == 2


def test_a_switch_is_measured_beyond_the_plans_steady_steps() -> None:
    """`switch_seconds` by hand: the switch at step 4 exposed 0.30 s of boundary and 0.12 s of
    transfers; the steps after it expose 0.02 + 0.03, 0.02 + 0.05 and 0.02 + 0.04 s (median
    0.06 s); 0.05 s of the boundary was the planner's wait: 0.42 - 0.06 - 0.05 = 0.31 s."""
    rows = np.zeros((5, 1 + len(selfcal.MEASURED)))
    rows[:, 0] = [3, 4, 5, 6, 7]
    rows[:, 1 + selfcal.BOUNDARY] = [0.01, 0.30, 0.02, 0.02, 0.02]
    rows[:, 1 + selfcal.TRANSFERS] = [0.0, 0.12, 0.03, 0.05, 0.04]
    rows[:, 1 + selfcal.MIGRATE] = [0.0, 0.25, 0.0, 0.0, 0.0]
    assert switch_seconds(rows, 4, 0.05) == pytest.approx(0.31)
    assert switch_seconds(rows[:2], 4, 0.05) is None  # no settled step after it yet
    assert switch_seconds(rows[2:], 4, 0.05) is None  # its row is gone
    assert migration_seconds(rows, 4) == pytest.approx(0.25)
    assert migration_seconds(rows[2:], 4) is None


def test_a_switch_is_priced_as_the_runs_switches_measured() -> None:
    """A first switch that moved one home (0.62 ms modelled, 5 ms migrating) and exposed 31 ms:
    `k_switch` 5 / 0.62 from the migration alone, the other 26 ms a switch's fixed part
    (`relay_s`), so a migration 10 times larger costs 8.06 x 6.2 + 26 = 76 ms, not 50 x 6.2."""
    price_ = SwitchPrice(prior=4.0)
    assert price_.cost(0.5) == pytest.approx(2.0)  # before any: the prior's scale
    assert price_.cost(0.5, wait_s=0.1) == pytest.approx(2.1)  # the planner's wait counts
    price_.record(measured_s=0.031, modelled_s=0.00062, migrate_s=0.005)
    assert price_.k_switch == pytest.approx(0.005 / 0.00062) and price_.switches == 1
    assert (price_.relays, price_.relay_s) == (1, pytest.approx(0.026))
    assert price_.cost(0.0062) == pytest.approx(0.005 / 0.00062 * 0.0062 + 0.026)
    whole = SwitchPrice()  # the migration not timed: the whole switch's ratio
    whole.record(measured_s=0.031, modelled_s=0.00062, migrate_s=None)
    assert whole.k_switch == pytest.approx(50.0) and whole.relays == 0
    # a migration that outlasted the switch's exposure leaves no fixed part
    price_.record(measured_s=0.010, modelled_s=0.001, migrate_s=0.012)
    assert price_.relays == 2 and price_.relay_s == pytest.approx(0.013)
    assert price_.k_switch == pytest.approx(0.017 / 0.00162)  # weighed by size
    # a switch that moved no home is all fixed part (one measured below 0 counts as 0)
    price_.record(measured_s=-0.02, modelled_s=0.0, migrate_s=0.0)
    assert price_.relays == 3 and price_.relay_s == pytest.approx(0.026 / 3)
    assert price_.switches == 2
    again = SwitchPrice()
    again.restore(price_.state())
    assert again.state() == price_.state()
