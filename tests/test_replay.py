"""The replay loop: plans from history, prices on actual loads, counts what it moves."""

from __future__ import annotations

import numpy as np
import pytest

from poise.cost.model import CostModel
from poise.plan.policies.base import PlanContext
from poise.plan.policies.registry import make_plan
from poise.plan.predict import Predictor
from poise.sim.simulator import replay
from poise.trace.generate import generate

from .helpers import toy_cluster, toy_spec


def test_replay_prices_actual_loads_and_beats_static_on_drift() -> None:
    trace = generate(
        "drift",
        steps=12,
        layers=2,
        devices=8,
        experts=8,
        top_k=2,
        tokens_per_device=512,
        seed=3,
        s=1.5,
        rate=0.05,
    )
    cluster = toy_cluster(4, 2, bw=5e9, inter_bw=2e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=2, d_model=256, d_expert=512, tokens=512)
    ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=CostModel(cluster, spec))
    runs = replay(
        trace.counts, ctx, ["static", "auto"], replan_every=3, predictor=Predictor("last")
    )
    static = make_plan("static", np.ones((2, 8, 8)), None, ctx)
    for s in range(trace.steps):
        expected = ctx.cost.price(static.placement, static.assignment, trace.counts[s]).step_s
        assert runs["static"].step_s[s] == pytest.approx(expected)
    assert len(runs["auto"].plan_ms) == 4  # steps 0, 3, 6, 9
    assert runs["auto"].mean_step_s < runs["static"].mean_step_s
    assert np.all(runs["static"].bytes_moved == 0)
