"""How many replicas an `auto` plan keeps where the Balancer retargets them: priced as they run.

`auto` (`poise.plan.policies.auto`) prices each layer's candidates on the forecast, the window's
mean loads. Where the router's hot experts wander, that mean is smoother than any step, so a
replica looks worth less than it is once it follows the router (`poise.plan.retarget`): its
bytes are the same whichever expert it copies, and each step it serves the expert the step
before ran hot. Under retargeting only two things of a plan matter to the steps it runs: its
homes and its number of replicas `K` over all layers.

So, with the plan's homes fixed, `replica_budget` prices `K = 0, 1, ..., K_max` replicas as
they would run on the recent steps `c[s]` (`poise.plan.retarget.as_run`: the plan's own on the
first step, each later one re-chosen from the step before) and keeps the `K` of the least mean
modelled step part

    live(K) = 1/S * sum_s (busy[K, s] + transfers[K, s])

(`poise.runtime.selfcal.live_parts` on the fitted cluster, whose transfers carry the fitted
`k_transfer` and the paired clock's `k_replica`: what the guard prices a plan with). The plan
with `K` replicas holds the first `K` of `budget_picks`: the greedy of
`poise.plan.retarget.replica_picks` on the newest step (what the step after the switch would
retarget from), then those of the older steps, newest first, that still find a free slot. So
`K_max` is the most replicas any recent step would have used, not those of the window's summed
counts (a hot expert that wandered evenly between two ranks sums to a balanced layer). Ties,
within `TIE_REL` of the least, go to the fewest replicas; `auto`'s own plan competes as it is,
and is kept unless another `K` is priced below it. Homes never move here, so no `K` costs a
migration the others do not.
NumPy only (runs in the planning job).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.cost.model import CostModel
from poise.plan.retarget import as_run, homes_with, replica_picks
from poise.runtime.selfcal import live_parts

TIE_REL = 1e-3  # budgets priced within this share of the least tie


def with_replicas(
    plan: Plan, picks: list[tuple[int, int, int]], counts: np.ndarray, current: Placement,
    spec: ModelSpec,
) -> Plan:  # fmt: skip
    """`plan`'s homes with the replicas `picks` (`(layer, expert, device)`), its tokens split to
    level `counts[L, D, E]` (by counts where `plan` splits so), its transfers from `current`."""
    placement = homes_with(plan.placement, picks)
    assignment = Assignment.balanced(placement, counts).with_split(plan.assignment.by_counts)
    return dataclasses.replace(
        plan,
        placement=placement,
        assignment=assignment,
        transfers=transfers_between(current, placement, spec),
        cost=None,
        notes={**plan.notes, "replica_budget": len(picks)},
    )


def budget_prices(cost: CostModel, plans: list[Plan], recent: np.ndarray) -> np.ndarray:
    """`[len(plans)]` mean modelled `busy + transfers` per step of each plan as it would run
    `recent[S, L, D, E]` with retargeting (module docstring)."""
    return np.array(
        [live_parts(cost, as_run(p, recent, cost.spec), recent).sum(axis=1).mean() for p in plans]
    )


def budget_picks(recent: np.ndarray, home: np.ndarray, slots: int) -> list[tuple[int, int, int]]:
    """`[(layer, expert, device)]` in the order the budget takes them (module docstring): the
    greedy on the newest step of `recent[S, L, D, E]` (homes `home[L, E]`, `slots` a device and
    layer), then each older step's, newest first, where its replica is new and its device still
    has a free slot in that layer."""
    D = recent.shape[2]
    free = slots - np.stack([np.bincount(h, minlength=D) for h in home])  # [L, D]
    out: list[tuple[int, int, int]] = []
    for counts in recent[::-1]:
        for layer, e, d in replica_picks(counts, home, slots, int(free.clip(min=0).sum())):
            if free[layer, d] > 0 and (layer, e, d) not in out:
                out.append((layer, e, d))
                free[layer, d] -= 1
    return out


def replica_budget(cost: CostModel, plan: Plan, recent: np.ndarray, current: Placement) -> Plan:
    """`plan` (an `auto` plan) with the number of replicas that prices least as run on
    `recent[S, L, D, E]` (module docstring); `plan` itself where it routes by groups, there are
    no recent steps, or no other number prices below it."""
    if len(recent) == 0 or plan.assignment.grouped:
        return plan
    picks = budget_picks(recent, plan.placement.home, plan.placement.slots_per_device)
    options = [plan] + [
        with_replicas(plan, picks[:k], recent[-1], current, cost.spec)
        for k in range(len(picks) + 1)
    ]
    prices = budget_prices(cost, options, recent)
    least = float(prices.min())
    if prices[0] <= least + TIE_REL * abs(least):
        return plan
    # the fewest replicas among those tied with the least (options[k + 1] holds k)
    best = next(i for i in range(1, len(options)) if prices[i] <= least + TIE_REL * abs(least))
    return options[best]


__all__ = ["TIE_REL", "budget_picks", "budget_prices", "replica_budget", "with_replicas"]
