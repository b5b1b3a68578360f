"""`static`: the GShard / DeepSpeed-MoE placement, never moved (`poise.core.static_ep`).

With no more devices than experts: experts in contiguous blocks, one copy each, remote tokens
to the home. With more devices than experts (E dividing D): DeepSpeed-MoE's expert-parallel
groups (deepspeed/utils/groups.py, `_get_expert_parallel_ranks`): device d holds expert d mod E
and a token goes only to the copy inside its own group of E consecutive devices. Otherwise
(E not dividing D, which DeepSpeed refuses) a block of devices per expert with the remote
tokens split evenly over all its copies. `notes["ep_group_size"]`: E with DeepSpeed's groups,
else 0."""

from __future__ import annotations

import numpy as np

from poise.core.placement import Plan
from poise.core.static_ep import ep_group_size, static_assignment, static_placement
from poise.plan.policies.base import PlanContext, finish_plan, register


@register("static", builds_on=None)
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    placement = static_placement(loads.shape[0], ctx.experts, ctx.devices, ctx.slots_per_device)
    notes = {"ep_group_size": ep_group_size(ctx.experts, ctx.devices)}
    return finish_plan(
        "static", placement, static_assignment(placement), loads, previous, ctx, notes
    )
