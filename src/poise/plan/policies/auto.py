"""`auto`: price every candidate policy per layer with the cost model and keep the cheapest.

For each layer l and candidate c (every registered policy, plus `keep`: the placement in force),
the cost over the next K steps is

    total[c, l] = K * (layer_s[c, l] - migrate_s[c, l]) + m * migrate_s[c, l]

i.e. K steps of the candidate's recurring time plus its one-off migration from the placement in
force, `m` (option `migration_scale`, default 1) times the model's: the live Balancer sets it to
what its switches measured against the model (moving homes with their optimizer moments in one
burst at a step boundary costs more per byte than the steady Trans and Agg the links are fitted
to); `m = inf` allows no migration (replicas only). K is option `horizon` where it is set, else
the steps the load pattern is expected to last (`auto_horizon`, `poise.plan.persistence`: at
least option `base_horizon`, which the live Balancer and the simulator set to the re-planning
interval, and as many steps as the forecast has held in the history, and before it where the
whole history held: option `held_before`, which the live Balancer and the simulator carry from
plan to plan; the plan's notes say `horizon` and `pattern_age`), and never more than option
`steps_left` where it is set: the steps the run has left for the plan to serve (the live
Balancer sets it from the run's length, the simulator from the trace's), so a migration is paid
back over steps the run will take, not over steps past its end. `auto` keeps, per layer, the
candidate with the least total; so it moves only when the gain over the next K steps exceeds the
cost of moving. Layers are priced independently (the step time is a sum over layers), so with no
placement in force the result is never slower than any candidate. Candidates within relative
`TIE_REL` of the least total tie; ties go to `keep`, then to the placement with the fewest
copies (it leaves the most free slots for later re-planning: a uniform forecast, as at the first
step, makes every placement price alike, and a replica-filled one would leave local searches
such as `vexpert` no room), then to the candidate order.

Rivals' own trails (`Plan.trails`). A candidate that builds on the placement in force
(`BUILDS_ON`: `vexpert`'s local search on the whole placement; `permute`, `prophet`, `hybrid`
and `shadow` on its homes) runs from `auto`'s placement, so once `auto` has taken another
placement its candidates are not the plans the rival makes alone: on a long replay `auto` took
`eplb`'s placement early and `vexpert`'s local search from there never reached the placements
`vexpert` alone reached from the static one (3.8% slower than `vexpert` over 200 steps of
FlexMoE's BERT-MoE).
So `auto`'s plan carries, per such rival, the rival's own latest plan, and each call continues
it: where the trail differs from the placement in force in what the rival builds on, the rival
also runs from its trail, and that plan (label `name:alone`) is priced with its migrations
from the placement in force like any candidate. Where they agree, the run from the placement in
force is the trail's continuation (the rival sees nothing else of `previous`), so the extra run
costs nothing while `auto` follows a rival. In a replay each trail equals the rival's own plans
(`tests/test_policy_trails.py`).

Pruning (option `prune`, default on): a candidate with a registered lower bound
(`policies.bounds`: `static` and `permute`, one copy per expert) runs after the others, and
only if `horizon * bound` is inside the least total's tie window in at least one layer; a
candidate skipped so could neither be kept nor tie, so the plan is the same as without pruning
(`tests/test_policy_auto_prune.py`; the bound holds for its trail's plan too, and a skipped
candidate's trail waits where it was). The same inputs give the same plan; a replay with
pruning can still part from one without at a later call, where a rival pruned earlier has no
trail (or an older one) to continue while the unpruned replay continues the rival's newer plan.
The notes list skipped candidates with their bound, and
under `alone` the rivals that also ran from their trails.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.cost.model import PlanCost
from poise.cost.phases import PHASE_NAMES, PhaseTimes
from poise.plan.persistence import horizon_for_age, pattern_age
from poise.plan.policies.base import (
    BUILDS_ON,
    HELPER_CPU_NOTE,
    REGISTRY,
    PlanContext,
    finish_plan,
    register,
    run_policy,
)
from poise.plan.policies.bounds import BOUNDS

DEFAULT_HORIZON = 10
PARALLEL_CELLS = 2**21  # from this many load cells (L * D * E) candidates plan in threads
TIE_REL = 1e-9  # totals this close (relative) count as equal
BOUND_MARGIN = 1e-12  # relative slack for float rounding when pruning by a bound
ALONE = ":alone"  # label suffix of a candidate continued from its own trail


def candidate_names(ctx: PlanContext) -> list[str]:
    names = ctx.option("auto", "candidates", None)
    if names is None:
        names = [n for n in sorted(REGISTRY) if n != "auto"]
    return list(names)


Job = tuple[str, "Plan | None"]  # a candidate policy and the plan in force it plans from


def run_candidates(
    jobs: list[Job], loads: np.ndarray, ctx: PlanContext
) -> tuple[list[Plan], float]:
    """Each job's plan (`REGISTRY[name](loads, previous, ctx)`, through `ctx.memo` where set:
    `base.run_policy`), in `jobs` order, and the CPU seconds spent in helper threads (with
    those of the plans reused from the memo, as their making took them). Policies are pure,
    so on large problems (at least `PARALLEL_CELLS` load cells, where NumPy's array work
    releases the GIL) they run in threads, one per CPU; small ones run one after the other in
    the caller's thread (threads would only contend)."""
    threads = min(len(jobs), os.cpu_count() or 1)
    if loads.size < PARALLEL_CELLS or threads < 2:
        made = [run_policy(n, loads, prev, ctx) for n, prev in jobs]
        return [p for p, _ in made], sum(cpu for _, cpu in made)

    def one(job: Job) -> tuple[Plan, float]:
        t0 = time.thread_time()
        plan, reused_cpu_s = run_policy(job[0], loads, job[1], ctx)
        return plan, time.thread_time() - t0 + reused_cpu_s

    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(one, jobs))
    return [p for p, _ in done], sum(t for _, t in done)


def _fits(plan: Plan | None, ctx: PlanContext, layers: int) -> bool:
    return (
        plan is not None
        and plan.placement.home.shape == (layers, ctx.experts)
        and plan.placement.devices == ctx.devices
    )


def _agree(a: Placement, b: Placement, on: str) -> bool:
    """Whether two placements agree on what a policy builds on (`BUILDS_ON`)."""
    same_homes = np.array_equal(a.home, b.home)
    return same_homes if on == "homes" else same_homes and np.array_equal(a.copies, b.copies)


class Candidates:
    """The candidates of one `auto` call as they are made: labels, plans, the least total so
    far (for pruning) and each trailing policy's continued trail.

    A policy in `BUILDS_ON` runs from the placement in force (label = its name). If its own
    trail (`previous.trails[name]`) differs from it in what the policy builds on (the
    placement, or only its homes), it also runs from the trail (label `name + ALONE`): that
    plan, which the policy would make had it run alone, is priced with its migrations from the
    placement in force and becomes the policy's new trail. If they agree, the first run is the
    trail's continuation too (the policy sees nothing else of `previous`)."""

    def __init__(
        self, previous: Plan | None, loads: np.ndarray, ctx: PlanContext, horizon: float
    ) -> None:
        self.previous, self.loads, self.ctx, self.horizon = previous, loads, ctx, horizon
        self.migration_scale = float(ctx.option("auto", "migration_scale", 1.0))
        L = loads.shape[0]
        fits = _fits(previous, ctx, L)
        self.trails_in: dict[str, Plan] = dict(previous.trails) if fits and previous else {}
        self.trails: dict[str, Plan] = {}
        self.labels: list[str] = []
        self.plans: list[Plan] = []
        self.alone: list[str] = []  # policies whose trail ran apart from the placement in force
        self.helper_cpu_s = 0.0
        self.best: np.ndarray | None = None
        if fits:
            assert previous is not None
            keep_cost = ctx.cost.price(previous.placement, previous.assignment, loads)
            keep = Plan("keep", previous.placement, previous.assignment, previous.transfers)
            keep.cost = keep_cost
            self._add(["keep"], [keep])

    def trail_of(self, name: str) -> Plan | None:
        """`name`'s own trail if it differs from the placement in force in what `name` builds
        on, else None."""
        trail = self.trails_in.get(name)
        if name not in BUILDS_ON or trail is None or self.previous is None:
            return None
        if not _fits(trail, self.ctx, self.loads.shape[0]):
            return None
        if trail.placement.slots_per_device != self.ctx.slots_per_device:
            return None  # the slots changed since: the trail cannot be continued
        on = BUILDS_ON[name]
        return None if _agree(trail.placement, self.previous.placement, on) else trail

    def run(self, names: list[str]) -> None:
        """Plan `names` (with their trails where those left the placement in force)."""
        trails = {n: self.trail_of(n) for n in names}
        apart = [n for n in names if trails[n] is not None]
        jobs: list[Job] = [(n, self.previous) for n in names] + [(n, trails[n]) for n in apart]
        made, cpu = run_candidates(jobs, self.loads, self.ctx)
        self.helper_cpu_s += cpu
        plans = made[: len(names)]
        for name, plan in zip(names, plans, strict=True):
            if name in BUILDS_ON:
                self.trails[name] = plan
        labels = list(names)
        for name, own in zip(apart, made[len(names) :], strict=True):
            self.trails[name] = own
            self.alone.append(name)
            labels.append(name + ALONE)
            plans.append(
                finish_plan(
                    name + ALONE,
                    own.placement,
                    own.assignment,
                    self.loads,
                    self.previous,
                    self.ctx,
                    dict(own.notes),
                )
            )
        self._add(labels, plans)

    def skip(self, name: str) -> None:
        """`name` was pruned: its trail stays where it was (it could not have been chosen)."""
        if name in self.trails_in:
            self.trails[name] = self.trails_in[name]

    def ordered(self, candidates: list[str]) -> tuple[list[str], list[Plan]]:
        """Labels and plans in the order ties are broken in, whatever order they ran in:
        `keep`, the candidates in `candidates` order, then their trails' plans in that order."""
        rank = {"keep": -1} | {n: i for i, n in enumerate(candidates)}
        rank |= {n + ALONE: len(candidates) + i for i, n in enumerate(candidates)}
        order = sorted(range(len(self.labels)), key=lambda i: rank[self.labels[i]])
        return [self.labels[i] for i in order], [self.plans[i] for i in order]

    def _add(self, labels: list[str], plans: list[Plan]) -> None:
        self.labels += labels
        self.plans += plans
        self.best = _least_total(plans, self.horizon, self.best, self.migration_scale)


@register("auto")
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    age = auto_pattern_age(loads, ctx)
    horizon = auto_horizon(loads, ctx, age)
    L = loads.shape[0]
    made = Candidates(previous, loads, ctx, horizon)
    candidates = candidate_names(ctx)
    prune = bool(ctx.option("auto", "prune", True))
    bounded = [n for n in candidates if prune and n in BOUNDS]
    made.run([n for n in candidates if n not in bounded])
    pruned: dict[str, float] = {}
    bounds: dict[object, np.ndarray | None] = {}  # candidates may share one bound function
    for name in bounded:
        if BOUNDS[name] not in bounds:
            bounds[BOUNDS[name]] = BOUNDS[name](loads, ctx)
        bound = bounds[BOUNDS[name]]
        # The bound holds for any plan of the policy, its trail's included.
        if bound is not None and made.best is not None and _cannot_win(horizon * bound, made.best):
            pruned[name] = float(bound.sum())
            made.skip(name)
            continue
        made.run([name])
    names, plans = made.ordered(candidates)
    total = _totals(plans, horizon, made.migration_scale)
    layers = np.arange(L)
    choice = _one_group_size(total, plans, names)
    home = np.stack([plans[c].placement.home[layer] for layer, c in enumerate(choice)])
    copies = np.stack([plans[c].placement.copies[layer] for layer, c in enumerate(choice)])
    # from_layers keeps group-local routing (hybrid's domains, static's EP groups) of the
    # layers it picks (one group size: `_one_group_size`).
    assignment = Assignment.from_layers(
        [(plans[c].assignment, layer) for layer, c in enumerate(choice)]
    )
    placement = Placement(home, copies, ctx.slots_per_device)
    chosen = [names[c] for c in choice]
    notes: dict[str, Any] = {
        "chosen": chosen,
        "candidate_step_s": {n: float(p.cost.step_s) for n, p in zip(names, plans, strict=True)},
        "pruned_bound_step_s": pruned,
        "alone": made.alone,
        "horizon": horizon,
        "pattern_age": age,
        HELPER_CPU_NOTE: made.helper_cpu_s,
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
    # [C, phases + 1, L]: each candidate's phase times and layer seconds, gathered at once
    table = np.stack([[getattr(c.phases, n) for n in PHASE_NAMES] + [c.layer_s] for c in costs])
    chosen_rows = table[choice, :, layers]  # [L, phases + 1]
    phases = PhaseTimes(**{n: chosen_rows[:, i].copy() for i, n in enumerate(PHASE_NAMES)})
    cost = PlanCost(
        phases=phases,
        layer_s=chosen_rows[:, -1].copy(),
        schedule=ctx.cost.schedule.name,
        device_load=np.stack([c.device_load for c in costs])[choice, layers],
    )
    return Plan(
        policy="auto",
        placement=placement,
        assignment=assignment,
        transfers=transfers,
        cost=cost,
        notes=notes,
        trails=made.trails,
    )


def auto_pattern_age(loads: np.ndarray, ctx: PlanContext) -> int | None:
    """How many steps the forecast `loads[L, D, E]`'s pattern has held
    (`poise.plan.persistence.pattern_age` over the context's history, `recent` = option
    `base_horizon`, plus option `held_before` where the whole history held: the steps it had
    held before the history's window, which the caller carries from plan to plan,
    `persistence.carried_age`); None where the horizon is fixed (option `horizon`) or there
    is no history."""
    if ctx.option("auto", "horizon", None) is not None:
        return None
    if ctx.history is None or not len(ctx.history):
        return None
    base = int(ctx.option("auto", "base_horizon", DEFAULT_HORIZON))
    held_before = int(ctx.option("auto", "held_before", 0))
    return pattern_age(ctx.history, loads.sum(axis=1), base, held_before)


def auto_horizon(loads: np.ndarray, ctx: PlanContext, age: int | None = None) -> float:
    """K: option `horizon` where set (a fixed number of steps); else the load pattern's
    persistence: at least option `base_horizon` (default `DEFAULT_HORIZON`), longer as the
    forecast `loads[L, D, E]` has held (`age`, `auto_pattern_age`'s where not given;
    `poise.plan.persistence`); either at most option `steps_left` (the steps the run has left
    for the plan, >= 1) where it is set."""
    fixed = ctx.option("auto", "horizon", None)
    if fixed is not None:
        horizon = float(fixed)
    else:
        base = int(ctx.option("auto", "base_horizon", DEFAULT_HORIZON))
        age = auto_pattern_age(loads, ctx) if age is None else age
        horizon = float(horizon_for_age(0 if age is None else age, base))
    left = ctx.option("auto", "steps_left", None)
    return horizon if left is None else min(horizon, float(max(1, left)))


def with_steps_left(
    options: Mapping[str, Mapping[str, Any]], steps_left: int | None
) -> dict[str, dict[str, Any]]:
    """A copy of `options` with `auto.steps_left` (`auto_horizon`'s cap: the steps a plan made
    now can serve before the run or the replayed trace ends, at least 1) unless the caller set
    it; unchanged where `steps_left` is None (the end is not known). The live planning job and
    the simulator both set it."""
    out = {k: dict(v) for k, v in options.items()}
    if steps_left is not None:
        out.setdefault("auto", {}).setdefault("steps_left", max(1, int(steps_left)))
    return out


def _totals(plans: list[Plan], horizon: float, migration_scale: float = 1.0) -> np.ndarray:
    """`[C, L]` each plan's cost over the horizon: K steps of its recurring time plus its
    one-off migration, `migration_scale` times the model's."""
    recurring = np.stack([p.cost.layer_s - p.cost.phases.migrate_s for p in plans])
    migrate = np.stack([p.cost.phases.migrate_s for p in plans])
    if np.isinf(migration_scale):  # migrations not allowed (0 * inf would be NaN)
        return horizon * recurring + np.where(migrate > 0, np.inf, 0.0)
    return horizon * recurring + migration_scale * migrate


def _least_total(
    plans: list[Plan],
    horizon: float,
    best: np.ndarray | None = None,
    migration_scale: float = 1.0,
) -> np.ndarray | None:
    """`[L]` the least total over `plans` and `best` (None: no plan yet)."""
    if not plans:
        return best
    least = _totals(plans, horizon, migration_scale).min(axis=0)
    return least if best is None else np.minimum(best, least)


def _cannot_win(lower: np.ndarray, best: np.ndarray) -> bool:
    """Whether a candidate whose totals are at least `lower[L]` is, in every layer, above the
    tie window of `best[L]` (which only falls as candidates are added), with a margin for the
    bound's float rounding."""
    window = (best + TIE_REL * np.abs(best)) * (1.0 + BOUND_MARGIN)
    return bool(np.all(lower > window))


def _one_group_size(total: np.ndarray, plans: list[Plan], names: list[str]) -> np.ndarray:
    """`_choose`, with the layers' picks sharing one group size: an assignment has one
    (`Assignment.from_layers`), and layers of static's DeepSpeed EP groups (E devices, more
    devices than experts) and of `hybrid`'s domains cannot stack. Where the per-layer best
    mixes sizes, each size in turn is allowed alongside the ungrouped candidates and the
    choice with the least total over the layers is kept (the smaller size on ties)."""
    sizes = [p.assignment.group_size if p.assignment.grouped else 0 for p in plans]
    choice = _choose(total, plans, names)
    mixed = sorted({sizes[c] for c in choice.tolist()} - {0})
    if len(mixed) < 2:
        return choice
    layers = np.arange(total.shape[1])
    best: tuple[float, np.ndarray] | None = None
    for size in mixed:
        keep = [i for i, s in enumerate(sizes) if s in (0, size)]
        sub = np.array(keep)[
            _choose(total[keep], [plans[i] for i in keep], [names[i] for i in keep])
        ]
        summed = float(total[sub, layers].sum())
        if best is None or summed < best[0]:
            best = (summed, sub)
    assert best is not None
    return best[1]


def _choose(total: np.ndarray, plans: list[Plan], names: list[str]) -> np.ndarray:
    """`[L]` index of the candidate kept per layer: the least `total[C, L]`; among those within
    `TIE_REL` of it, `keep` first, then the fewest copies, then the candidate order."""
    best = total.min(axis=0)
    tied = total <= best + TIE_REL * np.abs(best)
    # [C, L] (einsum sums in the copies' integer type: several times faster than .sum here)
    copies = np.stack([np.einsum("lde->l", p.placement.copies) for p in plans])
    is_keep = np.array([n == "keep" for n in names])[:, None]
    # Lexicographic: not keep, then copies, then order (argmin takes the first of equal keys).
    key = np.where(tied, (~is_keep) * (copies.max() + 1.0) + copies, np.inf)
    return np.argmin(key, axis=0)
