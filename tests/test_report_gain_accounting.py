"""`poise.report.gain_accounting`: where the ideal's gain went, on a hand-made round."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from poise.report.gain_accounting import CAUSES, gain_accounting


def _run(slowest: list[float], step_ms: list[float], balance_ms: float, **kw) -> SimpleNamespace:
    """8 steps of 1 layer on 2 ranks sharing 8 pairs: `slowest` on one, the rest on the
    other; rank 0's `balance` phase `balance_ms` every step."""
    n = len(step_ms)
    return SimpleNamespace(
        steps=np.arange(1, n + 1),
        step_s=np.array(step_ms) / 1e3,
        device_tokens=np.array([[[x, 8.0 - x]] for x in slowest]),
        phases={"balance": np.full(n, balance_ms / 1e3)},
        moe_phases={k: np.full(n, v / 1e3) for k, v in kw.get("moe_ms", {}).items()},
        probe_steps=np.array(kw.get("probes", [False] * n)),
        switches=kw.get("switches", []),
        layouts=kw.get("layouts", []),
    )


def test_a_hand_made_round_charged_step_by_step() -> None:
    """c = 1 ms a pair. Static: (6, 2) every step, 20 ms: 2 ms of excess a step, 12 ms over the
    6 measured steps (skip 2). Auto, steps 3-8 (its first two, 50 ms, are not measured):
    step 3 on the static layout (20.5 ms, 2.5 lost); step 4 switches to the first plan (23 ms,
    5 lost). Step 5 under the plan at (5, 3): 19.5 ms, so
    1.5 lost = 1 ms residual imbalance + 0.5 of transfers (0.3 inside compute, balance 1.2
    against static's 1.0) + 0 other. Step 6 a probe (20.2 ms, 2.2 lost); step 7 switches again
    (22 ms, 4 lost); step 8 balanced (4, 4) at 18.8 ms: 0.8 lost = 0 + 0.5 + 0.3 other."""
    static = _run([6] * 8, [20] * 8, 1.0)
    auto = _run(
        [6, 6, 6, 6, 5, 6, 5, 4],
        [50, 50, 20.5, 23, 19.5, 20.2, 22, 18.8],
        1.2,
        moe_ms={"transfers_in_compute": 0.3, "transfers": 0.9},
        probes=[False] * 5 + [True, False, False],
        switches=[4, 7],
    )
    got = gain_accounting(static, auto, 1e-3, skip=2)
    assert got["ideal_gain_ms"] == pytest.approx(2.0)
    assert got["achieved"] == pytest.approx(-4.0 / 12, abs=1e-3)
    expected = {
        "static_layout": 2.5, "probe_steps": 2.2, "switch_steps": 9.0,
        "residual_imbalance": 1.0, "transfers": 1.0, "other": 0.3,
    }  # fmt: skip
    assert set(got["lost"]) == set(CAUSES)
    for cause, ms in expected.items():
        assert got["lost"][cause] == pytest.approx(ms / 12, abs=1e-3), cause
    assert got["achieved"] + sum(got["lost"].values()) == pytest.approx(1.0, abs=5e-3)
    assert got["steps"] == {
        "static_layout": 1, "probe_steps": 1, "switch_steps": 2, "under_plans": 2,
    }  # fmt: skip
    # the same round with each step's layout logged: as the first switch told it
    named = ["static"] * 4 + ["replicas", "probe", "replicas", "replicas"]
    auto.layouts = named
    assert gain_accounting(static, auto, 1e-3, skip=2) == got


def test_steps_back_on_the_static_layout_are_charged_to_it() -> None:
    """A fallback at step 5's boundary: steps 6-8 run the static layout again (20 ms, 2 ms
    lost each), which the layouts logged tell apart from a plan's residual imbalance."""
    static = _run([6] * 8, [20] * 8, 1.0)
    layouts = ["static"] * 3 + ["replicas", "replicas"] + ["static"] * 3
    auto = _run(
        [6, 6, 6, 4, 4, 6, 6, 6], [50, 50, 20, 18, 21, 20, 20, 20], 1.0,
        switches=[3, 5], layouts=layouts,
    )  # fmt: skip
    got = gain_accounting(static, auto, 1e-3, skip=2)
    assert got["steps"] == {
        "static_layout": 3, "probe_steps": 0, "switch_steps": 2, "under_plans": 1,
    }  # fmt: skip
    assert got["lost"]["static_layout"] == pytest.approx(6 / 12, abs=1e-3)
    assert got["lost"]["residual_imbalance"] == 0.0
    assert got["achieved"] == pytest.approx(1 / 12, abs=1e-3)
    # without the layouts, those steps count as under plans, and their excess as left by them
    auto.layouts = []
    blind = gain_accounting(static, auto, 1e-3, skip=2)
    assert blind["lost"]["residual_imbalance"] == pytest.approx(6 / 12, abs=1e-3)


def test_a_run_that_never_switched_lost_it_all_on_the_static_layout() -> None:
    static = _run([6] * 8, [20] * 8, 1.0)
    same = _run([6] * 8, [20] * 8, 1.0)
    got = gain_accounting(static, same, 1e-3, skip=2)
    assert got["achieved"] == 0.0 and got["lost"]["static_layout"] == 1.0
    assert got["steps"]["under_plans"] == 0
    # nothing to gain: no shares
    flat = _run([4] * 8, [20] * 8, 1.0)
    assert gain_accounting(flat, flat, 1e-3, skip=2)["achieved"] is None


def test_runs_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="steps differ"):
        gain_accounting(_run([6] * 8, [20] * 8, 1.0), _run([6] * 7, [20] * 7, 1.0), 1e-3, 2)


def test_a_first_plan_before_the_measured_steps_leaves_none_before_it() -> None:
    """The first switch at step 2, inside the skipped warm-up: every measured step is under the
    plan (4, 4) at 19 ms, 1 of the 2 ms saved, 1 lost to `other`."""
    static = _run([6] * 8, [20] * 8, 1.0)
    auto = _run([6, 6] + [4] * 6, [50, 50] + [19] * 6, 1.0, switches=[2])
    got = gain_accounting(static, auto, 1e-3, skip=2)
    assert got["steps"]["static_layout"] == 0 and got["steps"]["under_plans"] == 6
    assert got["achieved"] == 0.5 and got["lost"]["other"] == 0.5
