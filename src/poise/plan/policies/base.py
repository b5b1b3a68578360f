"""What every balancing policy shares: the context it plans in, the registry, plan assembly.

A policy is a pure, deterministic function

    plan(loads, previous, ctx) -> Plan

- `loads`: predicted token-to-expert assignments `[L, D, E]` for the steps the plan will serve;
- `previous`: the plan in force (None at the start of training);
- `ctx`: cluster, model, cost model, slots per device, recent history and per-policy options.

It never knows whether the live runtime or the simulator called it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.core.static_ep import static_homes, static_placement
from poise.cost.model import CostModel, PlanCost, array_key

PolicyFn = Callable[[np.ndarray, "Plan | None", "PlanContext"], Plan]

REGISTRY: dict[str, PolicyFn] = {}
# What of the plan in force (`previous`) a policy builds its plan on: its whole placement
# (`vexpert`'s local search), or only its homes (`permute`, `prophet`, `hybrid`, `shadow`).
# Nothing else of `previous` shapes the plan, only its price (the migrations); from plans in
# force that agree on that part a policy makes the same plan. Policies not listed (`static`,
# `eplb`) plan from the loads alone.
BUILDS_ON: dict[str, str] = {}
BUILDS_ON_CHOICES = ("placement", "homes", None)


def register(name: str, *, builds_on: str | None = "placement") -> Callable[[PolicyFn], PolicyFn]:
    """Add a policy to `REGISTRY`, declaring what of the plan in force it builds on
    (`BUILDS_ON`; `tests/test_policy_trails.py` checks every declaration)."""
    if builds_on not in BUILDS_ON_CHOICES:
        raise ValueError(f"builds_on must be one of {BUILDS_ON_CHOICES}, got {builds_on!r}")

    def wrap(fn: PolicyFn) -> PolicyFn:
        REGISTRY[name] = fn
        BUILDS_ON.pop(name, None)
        if builds_on is not None:
            BUILDS_ON[name] = builds_on
        return fn

    return wrap


@dataclass
class PlanContext:
    """Everything a policy may look at besides the loads.

    `history[S, L, E]`: tokens routed to each expert (summed over sources) in the last observed
    steps, oldest first (may be empty);
    `options[policy][key]`: per-policy settings (thresholds, windows);
    `split_tokens`: the executor splits each step's tokens of replicated experts by that step's
    counts (`Assignment.by_counts`, `poise.core.token_split`): every plan's assignment is
    marked so (`finish_plan`) and priced as the executor runs it;
    `memo`: plans already made on these loads in this context, shared by the callers that plan
    on the same forecast (`PlanMemo`; the simulator's replays of one re-planning step), or None
    (every call plans afresh)."""

    cluster: Cluster
    spec: ModelSpec
    cost: CostModel
    slots_per_device: int
    history: np.ndarray | None = None
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    split_tokens: bool = False
    memo: PlanMemo | None = None

    @classmethod
    def create(
        cls,
        cluster: Cluster,
        spec: ModelSpec,
        *,
        slots_per_device: int | None = None,
        cost: CostModel | None = None,
        history: np.ndarray | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        split_tokens: bool = False,
    ) -> PlanContext:
        D, E = cluster.num_devices, spec.experts
        needed = max(1, math.ceil(E / D))
        slots = needed if slots_per_device is None else slots_per_device
        if slots < needed:
            raise ConfigError(
                f"{E} experts on {D} devices need at least {needed} slots per device, got {slots}",
                source=cluster.name,
                field="slots",
            )
        return cls(
            cluster=cluster,
            spec=spec,
            cost=cost or CostModel(cluster, spec),
            slots_per_device=slots,
            history=history,
            options=options or {},
            split_tokens=split_tokens,
        )

    @property
    def devices(self) -> int:
        return self.cluster.num_devices

    @property
    def experts(self) -> int:
        return self.spec.experts

    def option(self, policy: str, key: str, default: Any) -> Any:
        return self.options.get(policy, {}).get(key, default)


# `Plan.notes` key: CPU seconds a policy spent in helper threads (`auto` on large problems), to
# be added to the planning thread's own CPU time when planning is charged.
HELPER_CPU_NOTE = "helper_cpu_s"


@dataclass
class PlanMemo:
    """The plans made on one forecast `loads[L, D, E]` in one `PlanContext`, for the callers
    that plan on it: the simulator's replays of one re-planning step, and `auto`'s candidates
    within them.

    A policy is a pure function of the loads, the context and, of `previous`, only what it
    builds on (`BUILDS_ON`: the placement or its homes; the homes price the migrations of
    every policy, `transfers_between`), so a call that agrees with an earlier one on those gets
    the earlier call's plan. Each entry keeps the CPU seconds its making took, which a call
    that reuses it reports (`PlanMemo.plan`), so each caller's planning time is what it would
    spend planning alone."""

    loads: np.ndarray
    # keyed by (policy, slots per device, what it builds on of `previous`)
    entries: dict[tuple[str, int, Any], tuple[Plan, float]] = field(default_factory=dict)

    def plan(
        self, name: str, loads: np.ndarray, previous: Plan | None, ctx: PlanContext
    ) -> tuple[Plan, float]:
        """`REGISTRY[name](loads, previous, ctx)` and the CPU seconds of its making that this
        call did not spend (0 where this call made it; its maker thread's CPU seconds where it
        reused an earlier call's plan, whose notes keep any helper threads' seconds,
        `HELPER_CPU_NOTE`). Loads other than the memo's are planned afresh.

        A policy that builds on nothing of `previous` (not in `BUILDS_ON`: it plans from the
        loads alone) makes the same placement and assignment from any plan in force: from
        another one than an earlier call's, its plan is the earlier one's finished from this
        `previous` (`finish_plan`: the transfers and the price of the migrations from it),
        reported as taking the earlier one's making (a finishing more than it took)."""
        fn = REGISTRY[name]
        if loads is not self.loads and not np.array_equal(loads, self.loads):
            return fn(loads, previous, ctx), 0.0
        key = (name, ctx.slots_per_device, previous_key(name, previous))
        found = self.entries.get(key)
        if found is not None:
            return found
        alone = self.entries.get((name, ctx.slots_per_device, LOADS_ONLY))
        if alone is not None:
            made, cpu = alone
            plan = finish_plan(
                name, made.placement, made.assignment, loads, previous, ctx, dict(made.notes)
            )
            self.entries.setdefault(key, (plan, cpu))
            return plan, cpu
        t0 = time.thread_time()
        plan = fn(loads, previous, ctx)
        cpu = time.thread_time() - t0
        self.entries.setdefault(key, (plan, cpu))  # (threads may race: their plans are equal)
        if name not in BUILDS_ON:
            self.entries.setdefault((name, ctx.slots_per_device, LOADS_ONLY), (plan, cpu))
        return plan, 0.0


LOADS_ONLY = "loads only"  # `PlanMemo` key of the first plan of a policy that builds on nothing


def previous_key(name: str, previous: Plan | None) -> tuple[Any, ...] | None:
    """An exact key of what policy `name`'s plan depends on of the plan in force (`PlanMemo`):
    its homes (the migrations' price, and what `homes` policies build on), its devices and
    slots, and its copies for a policy that builds on the whole placement; None without one."""
    if previous is None:
        return None
    p = previous.placement
    copies = array_key(p.copies) if BUILDS_ON.get(name) == "placement" else None
    return (array_key(p.home), p.devices, p.slots_per_device, copies)


def run_policy(
    name: str, loads: np.ndarray, previous: Plan | None, ctx: PlanContext
) -> tuple[Plan, float]:
    """`REGISTRY[name](loads, previous, ctx)`, through `ctx.memo` where it is set, and the CPU
    seconds of a reused plan's making (`PlanMemo.plan`; 0 without a memo)."""
    if ctx.memo is None:
        return REGISTRY[name](loads, previous, ctx), 0.0
    return ctx.memo.plan(name, loads, previous, ctx)


# The static baseline's homes and placement (GShard's blocks; DeepSpeed-MoE's expert-parallel
# groups with more devices than experts) live in `poise.core.static_ep`, shared with the live
# runtime's static routing (`poise.nn.dispatch.RankRouting.static`).


def start_placement(previous: Plan | None, ctx: PlanContext, layers: int) -> Placement:
    """The placement a policy starts from: the previous one, or the static placement
    (`poise.core.static_ep.static_placement`)."""
    if (
        previous is not None
        and previous.placement.home.shape == (layers, ctx.experts)
        and previous.placement.devices == ctx.devices
    ):
        return previous.placement.copy()
    return static_placement(layers, ctx.experts, ctx.devices, ctx.slots_per_device)


def start_homes(previous: Plan | None, ctx: PlanContext, layers: int) -> np.ndarray:
    """`start_placement(previous, ctx, layers).home` (`[L, E]`) without building its copies."""
    if (
        previous is not None
        and previous.placement.home.shape == (layers, ctx.experts)
        and previous.placement.devices == ctx.devices
    ):
        return previous.placement.home.copy()
    return static_homes(layers, ctx.experts, ctx.devices)


def finish_plan(
    name: str,
    placement: Placement,
    assignment: Assignment,
    loads: np.ndarray,
    previous: Plan | None,
    ctx: PlanContext,
    notes: dict[str, Any] | None = None,
    cost: PlanCost | None = None,
) -> Plan:
    """Check the invariants, work out the transfers from `previous`, price on `loads` (unless
    the policy already priced the plan, migrations from `previous` included: `cost`). Under
    `ctx.split_tokens` the assignment splits by counts and is priced so (a policy's own price
    of its fixed split is dropped)."""
    if ctx.split_tokens and not assignment.by_counts:
        assignment, cost = assignment.with_split(), None
    placement.slots_per_device = ctx.slots_per_device
    placement.validate()
    assignment.validate(placement)
    prev_placement = previous.placement if previous is not None else None
    transfers = transfers_between(prev_placement, placement, ctx.spec)
    if cost is None:
        cost = ctx.cost.price(placement, assignment, loads, transfers.migrations)
    return Plan(
        policy=name,
        placement=placement,
        assignment=assignment,
        transfers=transfers,
        cost=cost,
        notes=notes or {},
    )


def check_loads(loads: np.ndarray, ctx: PlanContext) -> np.ndarray:
    return ctx.cost.check_loads(loads)
