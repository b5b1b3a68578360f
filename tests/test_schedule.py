"""Schedules on hand-made phase times: overlap bounds, Pro-Prophet's hidden Trans/Agg (eq. 8),
HybridEP's all-gather under pre-expert compute, and which schedules hide planning."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.errors import ConfigError
from poise.cost.phases import PhaseTimes
from poise.cost.schedule import Schedule, parse_schedule


def phases(a2a: float, fec: float, fnec: float, trans: float, mig: float = 0.0) -> PhaseTimes:
    one = lambda x: np.array([float(x)])  # noqa: E731
    return PhaseTimes.from_parts(one(a2a), one(fec), one(fnec), one(trans), one(mig))


def test_sync_is_the_plain_sum() -> None:
    # 3 computations (FEC + BEC = 3 FEC), 4 all-to-alls, non-MoE fwd + bwd, Trans + Agg, Mig.
    t = Schedule("sync").layer_time(phases(a2a=2, fec=1, fnec=5, trans=3, mig=7))[0]
    assert t == pytest.approx(4 * 2 + 3 * 1 + 3 * 5 + 2 * 3 + 7)


def test_pipelined_bounds() -> None:
    p = phases(a2a=4, fec=1, fnec=0, trans=0)
    for n in (1, 2, 4, 16, 1024):
        t = parse_schedule(f"pipelined({n})").layer_time(p)[0]
        # Dispatch and combine share the links (4 + 4 = 8 s a pass against 1 and 2 s of
        # experts). Forward: (4 + 1 + 4) / n + (n - 1) / n * 8; backward: (4 + 2 + 4) / n + ...
        assert t == pytest.approx((9 + 10) / n + 2 * (n - 1) / n * 8)
        assert 2 * 8 <= t <= 4 * 4 + 3 * 1  # max(links, compute) per pass <= t <= sync
    # Many chunks: tends to the busier resource of each pass (the links, 8 s, twice).
    assert parse_schedule("pipelined(100000)").layer_time(p)[0] == pytest.approx(16, rel=1e-3)


def test_prophet_hides_trans_under_forward_and_agg_under_backward_compute() -> None:
    sync = Schedule("sync")
    prophet = Schedule("prophet")
    # Trans 3 < FEC 1 + FNEC 2: hidden; Agg 3 <= BEC 2 + BNEC 4: hidden.
    p = phases(a2a=1, fec=1, fnec=2, trans=3)
    assert prophet.layer_time(p)[0] == pytest.approx(sync.layer_time(p)[0] - 6)
    # Trans 10: max(0, 10 - 1 - 2) = 7 exposed forward, max(0, 10 - 2 - 4) = 4 backward.
    p = phases(a2a=1, fec=1, fnec=2, trans=10)
    assert prophet.layer_time(p)[0] == pytest.approx(4 * 1 + 3 * 1 + 3 * 2 + 7 + 4)


def test_hybrid_hides_all_gather_under_pre_expert_compute() -> None:
    hybrid = Schedule("hybrid")
    p = phases(a2a=1, fec=1, fnec=2, trans=3)
    # Exposed: max(0, 3 - FNEC 2) = 1 forward, max(0, 3 - BNEC 4) = 0 backward.
    assert hybrid.layer_time(p)[0] == pytest.approx(4 * 1 + 3 * 1 + 3 * 2 + 1)
    assert parse_schedule("hybrid") == hybrid


def test_planning_hidden_only_under_prophet() -> None:
    assert Schedule("sync").planning_s(0.5, 2.0) == 0.5
    assert Schedule("hybrid").planning_s(0.5, 2.0) == 0.5
    assert Schedule("prophet").planning_s(0.5, 2.0) == 0.0
    assert Schedule("prophet").planning_s(3.0, 2.0) == pytest.approx(1.0)


def test_bad_schedule_names_the_field() -> None:
    with pytest.raises(ConfigError, match="unknown schedule") as info:
        parse_schedule("overlapped")
    assert info.value.field == "schedule"
