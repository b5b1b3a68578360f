"""`static`: the GShard / DeepSpeed-MoE placement. Experts in contiguous blocks, never moved, no
replicas (except DeepSpeed's expert-data-parallel copies when devices outnumber experts).
Remote tokens go to the home (or split evenly over the expert-data-parallel copies)."""

from __future__ import annotations

import numpy as np

from poise.core.placement import Assignment, Plan
from poise.plan.policies.base import PlanContext, finish_plan, register, static_placement


@register("static", builds_on=None)
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    placement = static_placement(loads.shape[0], ctx.experts, ctx.devices, ctx.slots_per_device)
    return finish_plan("static", placement, Assignment.even(placement), loads, previous, ctx)
