"""Balancing policies, one module each, collected in one registry (`base.REGISTRY`)."""

from poise.policies import static  # noqa: F401
from poise.policies.base import REGISTRY, PlanContext, get_policy, make_plan

__all__ = ["REGISTRY", "PlanContext", "get_policy", "make_plan"]
