"""What the Balancer reads from its layers before its first step (`poise.runtime.plan_inputs`):
the layers' slot count and the plan they run now, each refusal one `ConfigError` naming the
field. Real `poise.nn.MoE` layers in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poise.core.errors import ConfigError
from poise.core.spec import ModelSpec
from poise.nn import MoE, MoEConfig, apply_expert_parallel
from poise.runtime.moves.layer_state import LayerState
from poise.runtime.plan_inputs import initial_plan, layer_slots

SPEC = ModelSpec(name="t", d_model=16, d_expert=32, experts=8, top_k=2, moe_layers=2)


def _layers(*shapes: tuple[int, int]) -> list[LayerState]:
    """One expert-parallel layer (of this process alone) per `(experts, slots)`."""
    states = []
    for index, (experts, slots) in enumerate(shapes):
        model = torch.nn.Sequential(MoE(MoEConfig(16, 32, experts, 2)))
        (layer,) = apply_expert_parallel(model, None, num_slots=slots)
        states.append(LayerState(layer, index))
    return states


def test_fresh_layers_run_static_ep_with_their_spare_slots_empty() -> None:
    layers = _layers((8, 10), (8, 10))
    assert layer_slots(layers) == 10
    plan = initial_plan(layers, 10, 0, True, SPEC)
    assert plan.policy == "initial"
    assert plan.placement.slots_per_device == 10
    np.testing.assert_array_equal(plan.placement.home, np.zeros((2, 8)))  # one rank holds all
    np.testing.assert_array_equal(plan.placement.copies, np.ones((2, 1, 8)))  # no replica
    assert plan.assignment.by_counts  # each step's tokens split among holders by its counts
    assert not initial_plan(layers, 10, 0, False, SPEC).assignment.by_counts


def test_layers_that_differ_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"different slot counts \[9, 10\]") as info:
        layer_slots(_layers((8, 10), (8, 9)))
    assert info.value.field == "slots"
    with pytest.raises(ConfigError, match="different expert counts") as info:
        initial_plan(_layers((8, 10), (4, 10)), 10, 0, True, SPEC)
    assert info.value.field == "num_experts"
