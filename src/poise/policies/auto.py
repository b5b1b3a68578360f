"""`auto`: price every candidate policy per layer with the cost model and keep the cheapest.

For each layer l and candidate c (every registered policy, plus `keep`: the placement in force),
the cost over the next K steps (K = `horizon`, default the re-planning interval) is

    total[c, l] = K * (layer_s[c, l] - migrate_s[c, l]) + migrate_s[c, l]

i.e. K steps of the candidate's recurring time plus its one-off migration from the placement in
force. `auto` keeps, per layer, the candidate with the least total; so it moves only when the
gain over the next K steps exceeds the cost of moving. Layers are priced independently (the
step time is a sum over layers), so with no placement in force the result is never slower than
any candidate. Candidates within relative `TIE_REL` of the least total tie; ties go to `keep`,
then to the layout with the fewest copies (it leaves the most free slots for later re-planning:
a uniform forecast, as at the first step, makes every layout price alike, and a replica-filled
one would leave local searches such as `vexpert` no room), then to the candidate order.

Pruning (option `prune`, default on): a candidate with a registered lower bound
(`policies.bounds`: `static` and `permute`, one copy per expert) runs after the others, and
only if `horizon * bound` is inside the least total's tie window in at least one layer; a
candidate skipped so could neither be kept nor tie, so the plan is the same as without pruning
(`tests/test_policy_auto_prune.py`). The notes list skipped candidates with their bound.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from poise.cost import PHASE_NAMES, PhaseTimes, PlanCost
from poise.placement import Assignment, Placement, Plan, transfers_between
from poise.policies.base import HELPER_CPU_NOTE, REGISTRY, PlanContext, register
from poise.policies.bounds import BOUNDS

DEFAULT_HORIZON = 10
PARALLEL_CELLS = 2**21  # from this many load cells (L * D * E) candidates plan in threads
TIE_REL = 1e-9  # totals this close (relative) count as equal
BOUND_MARGIN = 1e-12  # relative slack for float rounding when pruning by a bound


def candidate_names(ctx: PlanContext) -> list[str]:
    names = ctx.option("auto", "candidates", None)
    if names is None:
        names = [n for n in sorted(REGISTRY) if n != "auto"]
    return list(names)


def run_candidates(
    names: list[str], loads: np.ndarray, previous: Plan | None, ctx: PlanContext
) -> tuple[list[Plan], float]:
    """Each candidate's plan, in `names` order, and the CPU seconds spent in helper threads.
    Policies are pure, so on large problems (at least `PARALLEL_CELLS` load cells, where
    NumPy's array work releases the GIL) they run in threads, one per CPU; small ones run one
    after the other in the caller's thread (threads would only contend)."""
    threads = min(len(names), os.cpu_count() or 1)
    if loads.size < PARALLEL_CELLS or threads < 2:
        return [REGISTRY[n](loads, previous, ctx) for n in names], 0.0

    def one(name: str) -> tuple[Plan, float]:
        t0 = time.thread_time()
        plan = REGISTRY[name](loads, previous, ctx)
        return plan, time.thread_time() - t0

    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(one, names))
    return [p for p, _ in done], sum(t for _, t in done)


@register("auto")
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    horizon = float(ctx.option("auto", "horizon", DEFAULT_HORIZON))
    L = loads.shape[0]
    plans: list[Plan] = []
    names: list[str] = []
    if (
        previous is not None
        and previous.placement.home.shape == (L, ctx.experts)
        and previous.placement.devices == ctx.devices
    ):
        keep_cost = ctx.cost.price(previous.placement, previous.assignment, loads)
        plans.append(
            Plan("keep", previous.placement, previous.assignment, previous.transfers, keep_cost)
        )
        names.append("keep")
    candidates = candidate_names(ctx)
    prune = bool(ctx.option("auto", "prune", True))
    bounded = [n for n in candidates if prune and n in BOUNDS]
    first = [n for n in candidates if n not in bounded]
    made, helper_cpu_s = run_candidates(first, loads, previous, ctx)
    by_name = dict(zip(first, made, strict=True))
    best = _least_total(plans + made, horizon)
    pruned: dict[str, float] = {}
    bounds: dict[object, np.ndarray | None] = {}  # candidates may share one bound function
    for name in bounded:
        if BOUNDS[name] not in bounds:
            bounds[BOUNDS[name]] = BOUNDS[name](loads, ctx)
        bound = bounds[BOUNDS[name]]
        if bound is not None and best is not None and _cannot_win(horizon * bound, best):
            pruned[name] = float(bound.sum())
            continue
        by_name[name] = REGISTRY[name](loads, previous, ctx)
        best = _least_total([by_name[name]], horizon, best)
    kept = [n for n in candidates if n in by_name]
    names += kept
    plans += [by_name[n] for n in kept]
    total = _totals(plans, horizon)
    layers = np.arange(L)
    choice = _choose(total, plans, names)
    home = np.stack([plans[c].placement.home[layer] for layer, c in enumerate(choice)])
    copies = np.stack([plans[c].placement.copies[layer] for layer, c in enumerate(choice)])
    # from_layers keeps group-local routing (hybrid) of the layers it picks.
    assignment = Assignment.from_layers(
        [(plans[c].assignment, layer) for layer, c in enumerate(choice)]
    )
    placement = Placement(home, copies, ctx.slots_per_device)
    chosen = [names[c] for c in choice]
    notes: dict[str, Any] = {
        "chosen": chosen,
        "candidate_step_s": {n: float(p.cost.step_s) for n, p in zip(names, plans, strict=True)},
        "pruned_bound_step_s": pruned,
        HELPER_CPU_NOTE: helper_cpu_s,
    }
    for p in plans:
        for key, value in p.notes.items():
            notes.setdefault(f"{p.policy}.{key}", value)
    placement.validate()
    assignment.validate(placement)
    prev_placement = previous.placement if previous is not None else None
    transfers = transfers_between(prev_placement, placement, ctx.spec)
    # Layers are priced independently and each candidate was priced (with its migrations from
    # `previous`, per layer too) on these loads, so the plan's cost is the chosen layers' costs.
    costs = [p.cost for p in plans]

    def pick(get: Callable[[PlanCost], np.ndarray]) -> np.ndarray:
        """`[L, ...]` the chosen candidate's row of `get(cost)` for each layer."""
        return np.stack([get(c) for c in costs])[choice, layers]

    phases = PhaseTimes(
        **{name: pick(lambda c, n=name: getattr(c.phases, n)) for name in PHASE_NAMES}
    )
    cost = PlanCost(
        phases=phases,
        layer_s=pick(lambda c: c.layer_s),
        schedule=ctx.cost.schedule.name,
        device_load=pick(lambda c: c.device_load),
    )
    return Plan(
        policy="auto",
        placement=placement,
        assignment=assignment,
        transfers=transfers,
        cost=cost,
        notes=notes,
    )


def _totals(plans: list[Plan], horizon: float) -> np.ndarray:
    """`[C, L]` each plan's cost over the horizon: K steps of its recurring time plus its
    one-off migration."""
    recurring = np.stack([p.cost.layer_s - p.cost.phases.migrate_s for p in plans])
    return horizon * recurring + np.stack([p.cost.phases.migrate_s for p in plans])


def _least_total(
    plans: list[Plan], horizon: float, best: np.ndarray | None = None
) -> np.ndarray | None:
    """`[L]` the least total over `plans` and `best` (None: no plan yet)."""
    if not plans:
        return best
    least = _totals(plans, horizon).min(axis=0)
    return least if best is None else np.minimum(best, least)


def _cannot_win(lower: np.ndarray, best: np.ndarray) -> bool:
    """Whether a candidate whose totals are at least `lower[L]` is, in every layer, above the
    tie window of `best[L]` (which only falls as candidates are added), with a margin for the
    bound's float rounding."""
    window = (best + TIE_REL * np.abs(best)) * (1.0 + BOUND_MARGIN)
    return bool(np.all(lower > window))


def _choose(total: np.ndarray, plans: list[Plan], names: list[str]) -> np.ndarray:
    """`[L]` index of the candidate kept per layer: the least `total[C, L]`; among those within
    `TIE_REL` of it, `keep` first, then the fewest copies, then the candidate order."""
    best = total.min(axis=0)
    tied = total <= best + TIE_REL * np.abs(best)
    copies = np.stack([p.placement.copies.sum(axis=(1, 2)) for p in plans])  # [C, L]
    is_keep = np.array([n == "keep" for n in names])[:, None]
    # Lexicographic: not keep, then copies, then order (argmin takes the first of equal keys).
    key = np.where(tied, (~is_keep) * (copies.max() + 1.0) + copies, np.inf)
    return np.argmin(key, axis=0)
