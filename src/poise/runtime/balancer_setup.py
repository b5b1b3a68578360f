"""What the Balancer checks and reads from the layers before its first step: its settings
(`check_settings`), the layers' slot count (`layer_slots`) and the plan they run now
(`initial_plan`). Each raises one `ConfigError` naming the field."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.nn.slots import slot_maps
from poise.plan.policies.registry import get_policy
from poise.runtime.moves.layer_state import LayerState


def check_settings(
    policy: str,
    replan_every: int,
    plan_lag: int,
    probe_every: int,
    max_probes: int,
    total_steps: int | None,
) -> None:
    """The Balancer's settings that no tensor is needed to judge: one `ConfigError` naming the
    field for the first that is out of range (an unknown policy: `get_policy`'s)."""
    if replan_every < 1:
        raise ConfigError(f"must be >= 1, got {replan_every}", field="replan_every")
    if probe_every == 1 or probe_every < 0:
        raise ConfigError(f"must be 0 (off) or >= 2, got {probe_every}", field="probe_every")
    if max_probes < 1:
        raise ConfigError(f"must be >= 1, got {max_probes}", field="max_probes")
    if total_steps is not None and total_steps < 0:
        raise ConfigError(f"must be >= 0, got {total_steps}", field="total_steps")
    if not 0 <= plan_lag <= replan_every:
        raise ConfigError(
            f"must be in [0, replan_every = {replan_every}], got {plan_lag}", field="plan_lag"
        )
    get_policy(policy)  # unknown names fail here


def layer_slots(layers: Sequence[LayerState]) -> int:
    """The expert slots each MoE layer holds on this rank (the first dimension of its expert
    tensors), the same in every layer."""
    slots = {int(s.params[0].shape[0]) for s in layers}
    if len(slots) != 1:
        raise ConfigError(f"MoE layers have different slot counts {sorted(slots)}", field="slots")
    return slots.pop()


def initial_plan(
    layers: Sequence[LayerState], slots: int, rank: int, split_tokens: bool, spec: ModelSpec
) -> Plan:
    """The plan `layers` run now (their `routing`: static EP's for fresh layers), `slots` a
    rank, as rank `rank` sees it; its assignment splits replicated experts' tokens by each
    step's counts where `split_tokens`.

    A routing's weights are this rank's source shares, so this assumes plain (not group-local)
    routing, which is all a layer's own default routing uses."""
    routings = [s.layer.routing for s in layers]
    if len({x.num_experts for x in routings}) != 1:
        raise ConfigError("MoE layers have different expert counts", field="num_experts")
    placement = Placement(
        home=np.stack([x.home for x in routings]).astype(np.int64),
        copies=np.stack([x.copies for x in routings]).astype(np.int32),
        slots_per_device=slots,
    )
    placement.validate()
    assignment = Assignment(np.stack([x.weights for x in routings]).astype(np.float64))
    assignment = assignment.with_split(split_tokens)
    for state, routing in zip(layers, routings, strict=True):
        mine = slot_maps(placement, state.index, slots)[rank]
        if not np.array_equal(mine.expert, routing.slots.expert):
            raise ConfigError(
                f"MoE layer {state.index}'s slots are not in the order slot_maps derives "
                "from its placement (homes, then replicas, then empty)",
                field="routing.slots",
            )
    return Plan(
        policy="initial",
        placement=placement,
        assignment=assignment,
        transfers=transfers_between(None, placement, spec),
    )


__all__ = ["check_settings", "initial_plan", "layer_slots"]
