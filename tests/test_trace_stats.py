"""Trace statistics on small cases computed by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from rich.console import Console

from poise.core.errors import ConfigError
from poise.trace.generate import generate
from poise.trace.stats import (
    device_loads,
    drift_at_lag,
    gini,
    static_device_of,
    stats_table,
    trace_stats,
    tv_distance,
)
from poise.trace.trace import Trace


def trace_from_loads(loads: list[list[list[int]]], devices: int = 1) -> Trace:
    """`loads [S, L, E]` all sent by device 0 (other devices send nothing)."""
    load = np.array(loads, dtype=np.int64)
    S, L, E = load.shape
    counts = np.zeros((S, L, devices, E), dtype=np.int64)
    counts[:, :, 0, :] = load
    return Trace(counts, np.arange(S), top_k=1, tokens_per_device=int(load.sum(-1).max()) or 1)


def test_gini_hand_cases() -> None:
    assert gini(np.array([0, 0, 0, 1])) == pytest.approx(0.75)
    assert gini(np.array([1, 1, 1, 1])) == pytest.approx(0.0)
    # sorted [1, 2, 3]: sum((2i - 4) x_i) = -2 + 0 + 6 = 4; / (3 * 6) = 2/9
    assert gini(np.array([3, 1, 2])) == pytest.approx(2 / 9)
    assert math.isnan(float(gini(np.array([0, 0]))))
    np.testing.assert_allclose(gini(np.array([[0, 0, 0, 1], [1, 1, 1, 1]])), [0.75, 0.0])


def test_tv_hand_cases() -> None:
    assert tv_distance(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(1.0)
    assert tv_distance(np.array([0.5, 0.5]), np.array([0.75, 0.25])) == pytest.approx(0.25)
    assert tv_distance(np.array([0.2, 0.8]), np.array([0.2, 0.8])) == pytest.approx(0.0)


def test_drift_at_lag_hand_case() -> None:
    # one layer, E = 2: distributions [1,0], [1,0], [0.5,0.5], [0,1]
    load = np.array([[[4, 0]], [[2, 0]], [[3, 3]], [[0, 5]]])
    # lag 1: TV 0, 0.5, 0.5 -> mean 1/3
    assert drift_at_lag(load, 1) == pytest.approx(1 / 3)
    # lag 2: TV 0.5, 1.0 -> 0.75; lag 3: 1.0
    assert drift_at_lag(load, 2) == pytest.approx(0.75)
    assert drift_at_lag(load, 3) == pytest.approx(1.0)
    assert drift_at_lag(load, 4) is None
    with pytest.raises(ConfigError):
        drift_at_lag(load, 0)


def test_static_device_of_and_device_loads() -> None:
    assert static_device_of(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert static_device_of(4, 3).tolist() == [0, 0, 1, 2]
    assert static_device_of(2, 4).tolist() == [0, 2]  # more devices than experts: some idle
    load = np.array([[[1, 2, 3, 4]]])
    np.testing.assert_array_equal(device_loads(load, static_device_of(4, 2), 2), [[[3, 7]]])


def test_trace_stats_hand_case() -> None:
    # S=2, L=2, E=4
    t = trace_from_loads([[[4, 0, 0, 0], [1, 1, 1, 1]], [[0, 4, 0, 0], [2, 2, 2, 2]]], devices=2)
    s = trace_stats(t)
    assert s["shape"] == [2, 2, 2, 4]
    assert s["total_assignments"] == 4 + 4 + 4 + 8
    skew = s["skew"]
    assert skew["max_over_mean"] == pytest.approx([4.0, 1.0])
    assert skew["gini"] == pytest.approx([0.75, 0.0])
    assert skew["top_share"] == pytest.approx([1.0, 0.25])
    assert skew["summary"]["max_over_mean"] == pytest.approx({"mean": 2.5, "max": 4.0})
    # layer 0 moves its only expert (TV 1), layer 1 keeps a uniform distribution (TV 0)
    assert s["drift"][1] == pytest.approx(0.5)
    assert s["drift"][10] is None and s["drift"][100] is None
    # static placement on D=2: experts {0,1} -> device 0, {2,3} -> device 1
    dev = s["device_imbalance"]
    assert dev["devices"] == 2
    assert dev["per_layer"] == pytest.approx([2.0, 1.0])  # layer 0: loads [4, 0] -> 4/2
    assert dev["mean"] == pytest.approx(1.5) and dev["max"] == pytest.approx(2.0)


def test_trace_stats_layout_options() -> None:
    t = trace_from_loads([[[1, 2, 3, 6]]])
    assert trace_stats(t)["device_imbalance"]["per_layer"] == pytest.approx([1.0])
    four = trace_stats(t, 4)["device_imbalance"]
    assert four["devices"] == 4 and four["per_layer"] == pytest.approx([6 / 3])
    explicit = trace_stats(t, np.array([0, 1, 1, 0]))["device_imbalance"]
    assert explicit["per_layer"] == pytest.approx([7 / 6])  # loads [7, 5]
    with pytest.raises(ConfigError):
        trace_stats(t, 0)
    with pytest.raises(ConfigError):
        trace_stats(t, np.array([0, 1]))
    with pytest.raises(ConfigError):
        trace_stats(t, np.array([0, -1, 0, 0]))


def test_empty_layer_is_left_out() -> None:
    t = trace_from_loads([[[2, 2], [0, 0]]])
    s = trace_stats(t)
    assert s["skew"]["gini"][1] is None
    assert s["skew"]["summary"]["gini"]["mean"] == pytest.approx(0.0)


def test_stats_json_ready_and_table() -> None:
    t = generate("zipf", steps=12, layers=3, devices=4, experts=8, tokens_per_device=32)
    s = trace_stats(t)
    back = json.loads(json.dumps(s))
    assert back["drift"]["1"] is not None and back["drift"]["100"] is None
    console = Console(width=120, record=True)
    console.print(stats_table(s))
    text = console.export_text()
    assert "Gini" in text and "lag 100: -" in text
    assert "zipf" in text
