"""Balancing policies, one module each, collected in one registry (`base.REGISTRY`).

Importing this package imports every policy module, so each registers itself."""

import importlib
import pkgutil

from poise.plan.policies.base import REGISTRY, PlanContext, get_policy, make_plan

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTRY", "PlanContext", "get_policy", "make_plan"]
