"""The settings each policy reads from `PlanContext.options`, and their checks.

`--option POLICY.KEY=VALUE` goes through `check_option`: an unknown policy, an unknown key (the
error lists the policy's known keys) or a value of the wrong type or range is one `ConfigError`
naming the option, instead of a traceback deep in a policy or a typo silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from poise.core.errors import ConfigError

Check = Callable[[Any], Any]  # returns the value converted, or raises ValueError with the rule


def _number(lo: float, *, above: bool = False) -> Check:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a number {'>' if above else '>='} {lo}")
        v = float(value)
        if not math.isfinite(v) or v < lo or (above and v == lo):
            raise ValueError(f"must be a finite number {'>' if above else '>='} {lo}")
        return v

    return check


def _integer(lo: int) -> Check:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"must be an integer >= {lo}")
        return int(value)

    return check


def _choice(*allowed: str) -> Check:
    def check(value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return str(value)

    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _policy_list(value: Any) -> list[str]:
    from poise.plan.policies.base import REGISTRY

    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError("must be policy names, comma-separated")
    names = [n.strip() for n in names]
    unknown = [n for n in names if n not in REGISTRY or n == "auto"]
    if unknown:
        known = ", ".join(n for n in sorted(REGISTRY) if n != "auto")
        raise ValueError(f"unknown candidate(s) {', '.join(unknown)} (known: {known})")
    return names


POLICY_OPTIONS: dict[str, dict[str, Check]] = {
    "auto": {
        "candidates": _policy_list,
        "horizon": _number(0, above=True),
        "migration_scale": _number(0),
        "prune": _boolean,
    },
    "eplb": {
        "groups": _integer(1),
        "mode": _choice("auto", "hierarchical", "global"),
        "routing": _choice("balanced", "even"),
    },
    "hybrid": {"expert_domain": _integer(1)},
    "permute": {"window": _integer(1)},
    "shadow": {"shadow_cost_factor": _number(0)},
    "vexpert": {"threshold": _number(0, above=True), "max_moves": _integer(0)},
}


def check_option(policy: str, key: str, value: Any, *, source: str = "--option") -> Any:
    """`value` checked and converted for `policy.key`; else `ConfigError` naming the option and
    listing what is allowed."""
    from poise.plan.policies import registry  # noqa: F401  (fills the registry)
    from poise.plan.policies.base import REGISTRY

    field = f"{policy}.{key}"
    if policy not in REGISTRY:
        raise ConfigError(
            f"unknown policy {policy!r} (known: {', '.join(sorted(REGISTRY))})",
            source=source,
            field=field,
        )
    known = POLICY_OPTIONS.get(policy, {})
    if key not in known:
        takes = f"its keys: {', '.join(sorted(known))}" if known else "it takes no options"
        raise ConfigError(
            f"unknown key for policy {policy!r} ({takes})", source=source, field=field
        )
    try:
        return known[key](value)
    except ValueError as exc:
        raise ConfigError(f"{exc}, got {value!r}", source=source, field=field) from None
