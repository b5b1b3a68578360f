"""Benchmark instruments in one process (`poise.train.instruments`): free balancing's intervals
record the seconds from `enter` to `leave`, and its settings move the Balancer's work to the
step boundary; a run without instruments plugs none in."""

from __future__ import annotations

import time

import pytest

from poise.core.errors import ConfigError
from poise.runtime.config import BalancerConfig
from poise.runtime.stats import StepStats
from poise.train.instruments import UNTIMED, FreeBalancing


def test_free_balancing_adds_up_its_intervals() -> None:
    free = FreeBalancing(None)  # no process group: nothing to wait for
    stats = StepStats(step=1, policy="eplb")
    free.before_step(1)
    for point, pause in (("reduce", 0.02), ("step", 0.03)):
        free.enter(point)
        time.sleep(pause)
        free.leave(point, stats)
    assert 0.05 <= stats.seconds[UNTIMED] < 0.5
    assert free.untimed_s == pytest.approx(stats.seconds[UNTIMED])
    free.before_step(2)  # each step's own
    assert free.untimed_s == 0.0


def test_free_settings_move_everything_to_the_boundary() -> None:
    config = FreeBalancing.settings(BalancerConfig(guard=False))
    assert (config.overlap, config.plan_lag) == (False, 0)
    with pytest.raises(ConfigError, match="turn the guard off") as info:
        FreeBalancing.settings(BalancerConfig())
    assert info.value.field == "free_balancing"
