"""Synthetic trace generators: shapes, exact row sums, determinism and each kind's property."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.errors import ConfigError
from poise.trace.generate import (
    GENERATORS,
    cap_probabilities,
    generate,
    generator_params,
    zipf_weights,
)
from poise.trace.stats import distributions, drift_at_lag, tv_distance

SHAPE = {"steps": 6, "layers": 3, "devices": 4, "experts": 16, "top_k": 2, "tokens_per_device": 64}


def max_over_mean(trace) -> np.ndarray:
    load = trace.expert_load()
    return load.max(axis=-1) / load.mean(axis=-1)


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_shape_row_sums_and_bounds(kind: str) -> None:
    t = generate(kind, seed=3, **SHAPE)
    assert t.counts.shape == (6, 3, 4, 16)
    assert t.counts.dtype == np.int64
    assert (t.counts.sum(axis=3) == 2 * 64).all()
    assert t.counts.min() >= 0
    assert t.counts.max() <= 64  # top-k picks distinct experts
    assert t.step_ids.tolist() == list(range(6))
    assert t.meta["generator"] == kind and t.meta["seed"] == 3
    assert t.name == kind


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_deterministic_by_seed(kind: str) -> None:
    a = generate(kind, seed=11, **SHAPE)
    b = generate(kind, seed=11, **SHAPE)
    c = generate(kind, seed=12, **SHAPE)
    np.testing.assert_array_equal(a.counts, b.counts)
    assert a.meta == b.meta
    assert not np.array_equal(a.counts, c.counts)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(GENERATORS)),
    steps=st.integers(1, 5),
    layers=st.integers(1, 3),
    devices=st.integers(1, 4),
    experts=st.integers(1, 12),
    k=st.integers(1, 12),
    tokens=st.integers(1, 40),
    seed=st.integers(0, 2**32),
)
def test_random_shapes_conserve_rows(
    kind: str, steps: int, layers: int, devices: int, experts: int, k: int, tokens: int, seed: int
) -> None:
    top_k = min(k, experts)
    t = generate(
        kind,
        steps=steps,
        layers=layers,
        devices=devices,
        experts=experts,
        top_k=top_k,
        tokens_per_device=tokens,
        seed=seed,
    )
    assert t.counts.shape == (steps, layers, devices, experts)
    assert (t.counts.sum(axis=3) == top_k * tokens).all()
    assert t.counts.min() >= 0 and t.counts.max() <= tokens


def test_uniform_is_flat() -> None:
    t = generate("uniform", steps=4, layers=2, devices=8, experts=16, tokens_per_device=2048)
    assert max_over_mean(t).max() < 1.2


def test_zipf_is_skewed_with_a_ranking_per_layer() -> None:
    t = generate("zipf", steps=4, layers=4, devices=8, experts=32, tokens_per_device=1024, s=1.2)
    assert max_over_mean(t).min() > 4.0
    tops = t.expert_load().sum(axis=0).argmax(axis=-1)  # [L] most popular expert
    assert len(set(tops.tolist())) > 1
    flat = generate("zipf", steps=4, layers=4, devices=8, experts=32, tokens_per_device=1024, s=0.0)
    assert max_over_mean(flat).max() < 1.3


def test_zipf_weights() -> None:
    w = zipf_weights(4, 1.0)
    np.testing.assert_allclose(w, np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    np.testing.assert_allclose(zipf_weights(5, 0.0), 0.2)


def test_drift_drifts_slowly() -> None:
    kw = {
        "steps": 60,
        "layers": 2,
        "devices": 4,
        "experts": 16,
        "tokens_per_device": 4096,
        "seed": 5,
    }
    t = generate("drift", rate=0.05, **kw)
    load = t.expert_load()
    lag1, lag50 = drift_at_lag(load, 1), drift_at_lag(load, 50)
    assert lag1 is not None and lag50 is not None
    assert lag1 < 0.05
    assert lag50 > 2.5 * lag1
    still = generate("zipf", **kw).expert_load()
    s1, s50 = drift_at_lag(still, 1), drift_at_lag(still, 50)
    assert s50 < 1.5 * s1  # only sampling noise without drift


def test_drift_rate_zero_is_static_and_revert_bounds_walk() -> None:
    t = generate(
        "drift", steps=40, layers=1, devices=2, experts=8, tokens_per_device=4096, rate=0.0
    )
    load = t.expert_load()
    assert drift_at_lag(load, 30) < 0.05
    free = generate("drift", steps=200, layers=2, devices=2, experts=8, rate=0.2, revert=0.0)
    pulled = generate("drift", steps=200, layers=2, devices=2, experts=8, rate=0.2, revert=0.5)
    assert drift_at_lag(pulled.expert_load(), 100) < drift_at_lag(free.expert_load(), 100)


def test_hot_set_share() -> None:
    t = generate(
        "hot_set",
        steps=3,
        layers=2,
        devices=4,
        experts=32,
        tokens_per_device=2048,
        hot=3,
        share=0.6,
    )
    hot = np.array(t.meta["hot_experts"])  # [L, hot]
    assert hot.shape == (2, 3)
    load = t.expert_load().sum(axis=0)  # [L, E]
    frac = np.take_along_axis(load, hot, axis=1).sum(axis=1) / load.sum(axis=1)
    np.testing.assert_allclose(frac, 0.6, atol=0.02)


def test_hot_rank_device_differs() -> None:
    t = generate(
        "hot_rank",
        steps=3,
        layers=2,
        devices=6,
        experts=16,
        tokens_per_device=2048,
        device=2,
        hot=2,
        share=0.8,
    )
    p = distributions(t.counts.sum(axis=0))  # [L, D, E]
    others = [d for d in range(6) if d != 2]
    hot_vs_other = tv_distance(p[:, 2], p[:, others[0]])
    other_vs_other = tv_distance(p[:, others[1]], p[:, others[2]])
    assert (hot_vs_other > 0.5).all()
    assert (other_vs_other < 0.1).all()
    hot = np.array(t.meta["hot_experts"])
    for layer in range(2):
        assert set(np.argsort(p[layer, 2])[-2:].tolist()) == set(hot[layer].tolist())


def test_rotating_moves_every_period() -> None:
    E, period = 8, 3
    t = generate(
        "rotating",
        steps=12,
        layers=2,
        devices=4,
        experts=E,
        tokens_per_device=1024,
        period=period,
        width=1,
        share=0.6,
    )
    top = t.expert_load().argmax(axis=-1)  # [S, L]
    start = np.array(t.meta["start"])
    expected = (start[None, :] + (np.arange(12) // period)[:, None]) % E
    np.testing.assert_array_equal(top, expected)
    assert len(set(top[:, 0].tolist())) == 4


def test_rotating_width_window() -> None:
    t = generate(
        "rotating",
        steps=4,
        layers=1,
        devices=2,
        experts=12,
        tokens_per_device=2048,
        period=2,
        width=3,
        share=0.9,
    )
    load = t.expert_load()[:, 0]  # [S, E]
    start = t.meta["start"][0]
    for s in range(4):
        window = [(start + (s // 2) * 3 + i) % 12 for i in range(3)]
        assert set(np.argsort(load[s])[-3:].tolist()) == set(window)


def test_bursts_spike_on_listed_steps() -> None:
    t = generate(
        "bursts",
        steps=60,
        layers=2,
        devices=4,
        experts=16,
        tokens_per_device=1024,
        prob=0.2,
        share=0.5,
        seed=2,
    )
    bursts = t.meta["burst_steps"]
    assert 0 < len(bursts) < 60
    share = t.expert_load().max(axis=-1) / t.expert_load().sum(axis=-1)  # [S, L]
    quiet = [s for s in range(60) if s not in bursts]
    assert share[bursts].min() > 0.4
    assert share[quiet].max() < 0.2
    experts = np.array(t.meta["burst_experts"])  # [bursts, L]
    np.testing.assert_array_equal(t.expert_load()[bursts].argmax(axis=-1), experts)


def test_cap_probabilities() -> None:
    p = np.array([[0.9, 0.05, 0.05, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = cap_probabilities(p, 0.5)
    np.testing.assert_allclose(q.sum(axis=1), 1.0)
    assert q.max() <= 0.5 + 1e-12
    np.testing.assert_allclose(q[0], [0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(q[1], 0.25)
    np.testing.assert_allclose(cap_probabilities(np.array([[1.0, 0, 0, 0]]), 0.25), 0.25)


def test_generator_params_lists_defaults() -> None:
    assert generator_params("zipf") == {"s": 1.0}
    assert generator_params("uniform") == {}
    assert "period" in generator_params("rotating")


def test_dispatch_accepts_dashes() -> None:
    t = generate("hot-set", steps=1, layers=1, devices=1, experts=4, tokens_per_device=4)
    assert t.meta["generator"] == "hot_set"


@pytest.mark.parametrize(
    ("kind", "kwargs", "field"),
    [
        ("nope", {}, "kind"),
        ("zipf", {"s": -0.5}, "s"),
        ("zipf", {"steps": 0}, "steps"),
        ("zipf", {"experts": 0}, "experts"),
        ("zipf", {"top_k": 17}, "top_k"),
        ("zipf", {"tokens_per_device": 0}, "tokens_per_device"),
        ("zipf", {"seed": -1}, "seed"),
        ("zipf", {"steps": 2.5}, "steps"),
        ("zipf", {"s": "big"}, "s"),
        ("zipf", {"s": float("nan")}, "s"),
        ("zipf", {"bogus": 1}, "bogus"),
        ("uniform", {"s": 1.0}, "s"),
        ("drift", {"rate": -1.0}, "rate"),
        ("drift", {"revert": 2.0}, "revert"),
        ("hot_set", {"hot": 0}, "hot"),
        ("hot_set", {"hot": 17}, "hot"),
        ("hot_set", {"share": 1.5}, "share"),
        ("hot_rank", {"device": 4}, "device"),
        ("hot_rank", {"device": True}, "device"),
        ("rotating", {"period": 0}, "period"),
        ("bursts", {"prob": -0.1}, "prob"),
    ],
)
def test_bad_parameters(kind: str, kwargs: dict, field: str) -> None:
    args = {"steps": 2, "layers": 1, "devices": 4, "experts": 16, **kwargs}
    with pytest.raises(ConfigError) as exc:
        generate(kind, **args)
    assert exc.value.field == field


def test_fast_enough() -> None:
    start = time.perf_counter()
    t = generate("zipf", steps=100, layers=8, devices=32, experts=256, tokens_per_device=1024)
    elapsed = time.perf_counter() - start
    assert t.counts.shape == (100, 8, 32, 256)
    assert elapsed < 3.0  # typically ~0.3 s; loose for slow CI machines
