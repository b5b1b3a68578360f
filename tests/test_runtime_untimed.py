"""Free balancing's intervals (`poise.runtime.untimed`) in one process: disabled, they cost
nothing and record nothing; enabled, each records the seconds from its start to its end."""

from __future__ import annotations

import time

import pytest

from poise.core.errors import ConfigError
from poise.runtime.stats import StepStats
from poise.runtime.untimed import UNTIMED, UntimedWindows, free_settings


def test_disabled_windows_record_nothing() -> None:
    windows = UntimedWindows(False, None)
    stats = StepStats(step=1, policy="eplb")
    started = windows.start()
    assert started is None
    time.sleep(0.01)
    windows.end(stats, started)
    assert UNTIMED not in stats.seconds


def test_enabled_windows_add_up_their_seconds() -> None:
    windows = UntimedWindows(True, None)  # no process group: nothing to wait for
    stats = StepStats(step=1, policy="eplb")
    for pause in (0.02, 0.03):
        started = windows.start()
        assert started is not None
        time.sleep(pause)
        windows.end(stats, started)
    assert 0.05 <= stats.seconds[UNTIMED] < 0.5


def test_free_settings_move_everything_to_the_boundary() -> None:
    assert free_settings(False, True, True, 1) == (True, 1)  # a normal run keeps its own
    assert free_settings(True, False, True, 1) == (False, 0)
    with pytest.raises(ConfigError, match="turn the guard off") as info:
        free_settings(True, True, True, 1)
    assert info.value.field == "free_balancing"
