"""The policy registry, full: importing this module imports every policy module (each adds
itself to `base.REGISTRY` with `base.register`), so `get_policy` and `make_plan` know them all."""

from __future__ import annotations

import numpy as np

from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Plan
from poise.plan.policies import (  # noqa: F401  (each module registers its policy on import)
    auto,
    eplb,
    hybrid,
    permute,
    prophet,
    shadow,
    static,
    vexpert,
)
from poise.plan.policies.base import REGISTRY, PlanContext, PolicyFn, check_loads, run_policy


def get_policy(name: str) -> PolicyFn:
    if name not in REGISTRY:
        raise ConfigError(
            f"unknown policy (known: {', '.join(sorted(REGISTRY))})", source=name, field="policy"
        )
    return REGISTRY[name]


def make_plan(name: str, loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """Run policy `name`; any policy bug that breaks an invariant surfaces as PlanError."""
    return make_plan_reusing(name, loads, previous, ctx)[0]


def make_plan_reusing(
    name: str, loads: np.ndarray, previous: Plan | None, ctx: PlanContext
) -> tuple[Plan, float]:
    """`make_plan`, and the CPU seconds of the plan's making that this call did not spend: a
    plan reused from `ctx.memo` (`base.PlanMemo`) took its maker that long; 0 otherwise."""
    get_policy(name)
    plan, reused_cpu_s = run_policy(name, check_loads(loads, ctx), previous, ctx)
    if not isinstance(plan, Plan):
        raise PlanError(f"policy returned {type(plan).__name__}, not a Plan", source=name)
    return plan, reused_cpu_s
