"""Each system as designed in the scenarios: memory-bound slots for the systems without a slot
limit, and a plan fixed before training for HybridEP."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.errors import ConfigError
from poise.core.presets import GIB
from poise.plan.memory_slots import memory_bound_slots
from poise.plan.policies.base import PlanContext, PlanMemo
from poise.plan.policies.registry import make_plan
from poise.sim.simulator import simulate
from poise.trace.generate import generate

from .helpers import toy_cluster, toy_spec


def skewed_trace(steps: int = 12, devices: int = 4, experts: int = 8):
    return generate(
        "drift",
        steps=steps,
        layers=1,
        devices=devices,
        experts=experts,
        top_k=2,
        tokens_per_device=2048,
        seed=5,
        s=1.5,
        rate=0.05,
    )


def test_memory_bound_slots_hand_computed() -> None:
    """toy expert: 2 x 4 x 8 = 64 params; 8 experts on 4 devices: 2 homes. With M bytes, homes
    and dense state take L (2 x 64 + P_d)(4 + 8) and each further slot 2 L 64 x 4."""
    spec = toy_spec(experts=8, layers=2, d_model=4, d_expert=8)  # non_moe 0: P_d = 0
    assert spec.optimizer_bytes_per_param == 8.0
    resident = 2 * (2 * 64) * (4 + 8)  # 3,072 bytes
    per_slot = 2 * 2 * 64 * 4  # 1,024 bytes
    cluster = dataclasses.replace(toy_cluster(2, 2), memory_bytes=resident + 3.5 * per_slot)
    assert memory_bound_slots(cluster, spec) == 2 + 3
    # never above E, never below the homes
    big = dataclasses.replace(cluster, memory_bytes=80 * GIB)
    assert memory_bound_slots(big, spec) == 8
    tiny = dataclasses.replace(cluster, memory_bytes=100.0)
    assert memory_bound_slots(tiny, spec) == 2


def test_policy_slots_give_one_policy_its_own_room() -> None:
    """One spare slot caps FasterMoE's shadowing at one expert a layer (a shadow takes a slot on
    every device); its own memory-bound slots let it shadow as its greedy wants, while the
    other policies keep the replay's slots."""
    trace = skewed_trace()
    cluster = toy_cluster(4, 1, bw=2e9, lat=1e-6, flops=2e11)
    spec = toy_spec(experts=4, layers=1, d_model=64, d_expert=128, tokens=2048)
    trace = skewed_trace(experts=4)
    capped = simulate(trace, cluster, spec, ["shadow", "vexpert"], "sync", 4, count_planning=False)
    free = simulate(
        trace,
        cluster,
        spec,
        ["shadow", "vexpert"],
        "sync",
        4,
        count_planning=False,
        policy_slots={"shadow": 4},
    )
    shadowed = [len(s) for s in free.runs["shadow"].last_plan.notes["shadowed"]]
    capped_shadowed = [len(s) for s in capped.runs["shadow"].last_plan.notes["shadowed"]]
    assert max(capped_shadowed) <= 1 < max(shadowed)
    assert free.runs["shadow"].last_plan.placement.slots_per_device == 4
    assert free.runs["vexpert"].last_plan.placement.slots_per_device == 2  # ceil(4/4) + 1
    assert free.runs["shadow"].step_s[4:].mean() < capped.runs["shadow"].step_s[4:].mean()


def test_plan_memo_keeps_plans_of_other_slot_budgets_apart() -> None:
    """`auto` plans its candidates in its own context through the replay's shared memo: a
    shadow plan made with 4 slots must not be handed to a caller with 2."""
    cluster = toy_cluster(4, 1, bw=2e9, lat=1e-6, flops=2e11)
    spec = toy_spec(experts=4, layers=1, d_model=64, d_expert=128, tokens=2048)
    loads = skewed_trace(experts=4).counts[0].astype(float)
    memo = PlanMemo(loads)
    wide = dataclasses.replace(PlanContext.create(cluster, spec, slots_per_device=4), memo=memo)
    narrow = dataclasses.replace(wide, slots_per_device=2)
    made_wide, _ = memo.plan("shadow", loads, None, wide)
    made_narrow, _ = memo.plan("shadow", loads, None, narrow)
    assert made_wide.placement.slots_per_device == 4
    assert made_narrow.placement.slots_per_device == 2
    assert made_narrow.placement.copies.sum(axis=-1).max() <= 2


def test_fixed_plan_is_made_once_before_any_load_is_seen() -> None:
    """HybridEP fixes p before training: its plan is made at step 0 on the even split and kept;
    re-planned every 4 steps it would plan 3 times on 12 steps."""
    trace = skewed_trace()
    cluster = toy_cluster(2, 1, 2, bw=5e9, wan_bw=1e8, lat=1e-6, flops=1e12)
    spec = toy_spec(experts=8, layers=1, d_model=64, d_expert=128, tokens=2048)
    kept = simulate(trace, cluster, spec, ["hybrid", "static"], "hybrid", 4, fixed_plans=["hybrid"])
    moving = simulate(trace, cluster, spec, ["hybrid", "static"], "hybrid", 4)
    assert len(kept.runs["hybrid"].plan_ms) == 1 and len(moving.runs["hybrid"].plan_ms) == 3
    assert len(kept.runs["static"].plan_ms) == 3  # the others re-plan as before
    assert kept.runs["hybrid"].skipped_replans == []
    # the plan made on the even split: every layer's loads the same per cell
    L, D, E = 1, 4, 8
    even = np.full((L, D, E), trace.counts[0].sum() / (D * E))
    first = kept.runs["hybrid"].last_plan
    ctx = PlanContext.create(cluster, spec, slots_per_device=3)
    again = make_plan("hybrid", even, None, ctx)
    assert np.array_equal(first.placement.copies, again.placement.copies)


def test_own_slots_and_fixed_plans_name_policies_of_the_run() -> None:
    trace = skewed_trace(steps=2)
    cluster = toy_cluster(4, 1)
    spec = toy_spec(experts=8, layers=1)
    with pytest.raises(ConfigError, match="policy_slots"):
        simulate(trace, cluster, spec, ["static"], policy_slots={"shadow": 3})
    with pytest.raises(ConfigError, match="fixed_plans"):
        simulate(trace, cluster, spec, ["static"], fixed_plans=["hybrid"])
    with pytest.raises(ConfigError, match="slots"):
        simulate(trace, cluster, spec, ["shadow"], policy_slots={"shadow": 1})
