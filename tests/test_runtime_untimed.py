"""Free balancing's intervals (`poise.runtime.untimed`) in one process: disabled, they cost
nothing and record nothing; enabled, each records the seconds from its start to its end."""

from __future__ import annotations

import time

from poise.runtime.stats import StepStats
from poise.runtime.untimed import UNTIMED, UntimedWindows


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
