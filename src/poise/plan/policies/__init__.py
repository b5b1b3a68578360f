"""Balancing policies, one module each, collected in one registry.

`base` holds the shared types (`PlanContext`, `register`, `REGISTRY`); each policy module
registers itself on import; `registry` imports them all and gives `get_policy(name)` and
`make_plan(name, loads, previous, ctx)`:

    from poise.plan.policies.registry import make_plan
    plan = make_plan("auto", loads, previous=None, ctx=ctx)   # loads: [L, D, E]
"""

from poise.plan.policies.base import REGISTRY, PlanContext
from poise.plan.policies.registry import get_policy, make_plan

__all__ = ["REGISTRY", "PlanContext", "get_policy", "make_plan"]
