"""The `padded` schedule: DeepSpeed-MoE's dropless dispatcher, which pads every (rank, expert)
buffer to the world's largest expert count (`cost.traffic.padded_counts`)."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement
from poise.cost.model import CostModel
from poise.cost.schedule import parse_schedule
from poise.cost.traffic import padded_counts
from poise.sim.simulator import simulate

from .helpers import toy_cluster, toy_spec


def test_padded_counts_by_hand() -> None:
    counts = np.array([[[1.0, 5.0], [2.0, 0.0]], [[3.0, 3.0], [0.0, 1.0]]])  # [L=2, D=2, E=2]
    want = np.array([[[5.0, 5.0], [5.0, 5.0]], [[3.0, 3.0], [3.0, 3.0]]])
    assert np.array_equal(padded_counts(counts), want)
    assert np.array_equal(padded_counts(want), want)  # idempotent


def test_padded_static_step_by_hand() -> None:
    # 2 devices of one node, 1e9 B/s, no latency, 1e12 FLOP/s; expert e homed on device e.
    # fp32 experts 64 -> 128 -> 64: B_t = 256 B, F_t = 2 * 2 * 64 * 128 = 32768 FLOP.
    # Device 0 sends 90 tokens to expert 1 and keeps 10 for expert 0; device 1 sends 4 to
    # expert 0 and keeps 6. Padded, every pair carries C = 90 tokens: each device sends and
    # receives 90 tokens (A = 90 * 256 / 1e9) and computes 180 rows (FEC = 180 * F_t / 1e12).
    cluster = toy_cluster(2, 1, 1, bw=1e9, flops=1e12)
    spec = toy_spec(experts=2, d_model=64, d_expert=128)
    counts = np.array([[[10.0, 90.0], [4.0, 6.0]]])
    placement = Placement.from_homes(np.array([[0, 1]]), 2, 1)
    a2a, fec = 90 * 256 / 1e9, 180 * 32768 / 1e12
    padded = CostModel(cluster, spec, parse_schedule("padded"))
    priced = padded.price(placement, Assignment.to_home(placement), counts)
    assert priced.phases.dispatch_s[0] == pytest.approx(a2a, rel=1e-12)
    assert priced.phases.expert_fwd_s[0] == pytest.approx(fec, rel=1e-12)
    # sync timing: 4 all-to-alls, forward + backward compute (BEC = 2 FEC)
    assert priced.layer_s[0] == pytest.approx(4 * a2a + 3 * fec, rel=1e-12)
    # Unpadded, the busiest device sends 90 tokens and device 1 computes 96 rows.
    plain = CostModel(cluster, spec, parse_schedule("sync"))
    unpadded = plain.price(placement, Assignment.to_home(placement), counts)
    assert unpadded.layer_s[0] == pytest.approx(4 * a2a + 3 * 96 * 32768 / 1e12, rel=1e-12)


def test_simulate_under_padded_prices_and_plans_the_padded_loads() -> None:
    # The replay's steps are padded before anyone sees them: static under `padded` costs what
    # static under `sync` costs on the padded trace, and a balancing policy finds nothing to
    # balance (every pair of a layer carries the same count).
    cluster = toy_cluster(4, 2, 1, bw=1e10, inter_bw=1e9, flops=1e13)
    spec = toy_spec(experts=8, layers=2, d_model=64, d_expert=128, tokens=400)
    rng = np.random.default_rng(0)
    trace = rng.multinomial(400, np.arange(1, 9) / 36, size=(6, 2, 8)).astype(float)
    padded = simulate(trace, cluster, spec, ["static", "prophet"], "padded", dense_params=0)
    by_hand = simulate(padded_counts(trace), cluster, spec, ["static"], "sync", dense_params=0)
    plain = simulate(trace, cluster, spec, ["static"], "sync", dense_params=0)
    static = padded.runs["static"].step_s - padded.runs["static"].plan_s
    want = by_hand.runs["static"].step_s - by_hand.runs["static"].plan_s
    np.testing.assert_allclose(static, want, rtol=1e-12)
    assert (static > plain.runs["static"].step_s - plain.runs["static"].plan_s).all()
    prophet = padded.runs["prophet"].step_s - padded.runs["prophet"].plan_s
    assert (prophet >= static * (1 - 1e-12)).all()


def test_planners_under_padded_see_the_padded_loads() -> None:
    # Replaying a trace under `padded` is replaying its padded form: the planners' forecasts
    # come from the padded steps too, so every policy's priced steps are the same numbers.
    cluster = toy_cluster(4, 2, 1, bw=1e10, inter_bw=1e9, flops=1e13)
    spec = toy_spec(experts=8, layers=2, d_model=64, d_expert=512, tokens=400)
    rng = np.random.default_rng(1)
    share = rng.dirichlet(np.full(8, 0.3), size=(6, 2, 8))  # [S, L, D, E] skewed per source
    trace = np.floor(share * 400)
    names = ["static", "prophet", "eplb", "vexpert"]
    a = simulate(trace, cluster, spec, names, "padded", 2, dense_params=0)
    b = simulate(padded_counts(trace), cluster, spec, names, "padded", 2, dense_params=0)
    for name in names:
        priced_a = a.runs[name].step_s - a.runs[name].plan_s
        priced_b = b.runs[name].step_s - b.runs[name].plan_s
        np.testing.assert_allclose(priced_a, priced_b, rtol=1e-12, err_msg=name)
