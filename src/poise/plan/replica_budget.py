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

(`poise.cost.per_step.live_parts`, on the cluster the live runtime fitted to the run). The plan
with `K` replicas holds the first `K` of `budget_picks`: the greedy of
`poise.plan.retarget.replica_picks` on the newest step (what the step after the switch would
retarget from), then those of the older steps, newest first, that still find a free slot;
`K_max` is the most replicas any one recent step's greedy took (a larger `K` would change the
switch's own step alone), not what the window's summed counts need (a hot expert that wandered
evenly between two ranks sums to a balanced layer). Ties,
within `TIE_REL` of the least, go to the fewest replicas; `auto`'s own plan competes as it is,
and is kept unless another `K` is priced below it. Homes never move here, so no `K` costs a
migration the others do not.
NumPy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from poise.core.placement import Assignment, Placement, Plan
from poise.core.spec import ModelSpec
from poise.cost.model import CostModel
from poise.cost.per_step import live_parts
from poise.plan.retarget import as_run, free_slots, homes_with, replica_picks, with_placement

TIE_REL = 1e-3  # budgets priced within this share of the least tie


def with_replicas(
    plan: Plan, picks: list[tuple[int, int, int]], counts: np.ndarray, current: Placement,
    spec: ModelSpec,
) -> Plan:  # fmt: skip
    """`plan`'s homes with the replicas `picks` (`(layer, expert, device)`), its tokens split to
    level `counts[L, D, E]` (by counts where `plan` splits so), its transfers from `current`;
    its notes say how many (`replica_budget`)."""
    out = with_placement(plan, homes_with(plan.placement, picks), counts, current, spec)
    return dataclasses.replace(out, notes={**plan.notes, "replica_budget": len(picks)})


def budget_prices(
    cost: CostModel, options: list[Plan | list[Plan]], recent: np.ndarray
) -> np.ndarray:
    """`[len(options)]` the mean modelled `busy + transfers` per step of each option on
    `recent[S, L, D, E]`: an option is one plan per step (what it runs each step) or one plan
    for all; every option priced in one call, the steps laid end to end."""
    S = len(recent)
    steps = [q for o in options for q in (o if isinstance(o, list) else [o] * S)]
    parts = live_parts(cost, steps, np.tile(recent, (len(options), 1, 1, 1)))  # [n * S, 2]
    return parts.sum(axis=1).reshape(len(options), S).mean(axis=1)


def greedy_by_step(
    recent: np.ndarray, home: np.ndarray, slots: int
) -> list[list[tuple[int, int, int]]]:
    """Per step of `recent[S, L, D, E]`, the retargeting greedy's picks with no limit on their
    number (`replica_picks`): with a limit `K`, the greedy takes the first `K` of them."""
    free = int(free_slots(home, slots, recent.shape[2]).clip(min=0).sum())
    return [replica_picks(counts, home, slots, free) for counts in recent]


def budget_picks(
    greedy: list[list[tuple[int, int, int]]], home: np.ndarray, slots: int, devices: int
) -> list[tuple[int, int, int]]:
    """`[(layer, expert, device)]` in the order the budget takes them (module docstring): the
    newest step's greedy picks (`greedy_by_step`), then each older step's, newest first, where
    its replica is new and its device still has a free slot in that layer (homes `home[L, E]`,
    `slots` a device and layer)."""
    free = free_slots(home, slots, devices)  # [L, D]
    out: list[tuple[int, int, int]] = []
    for picks in greedy[::-1]:
        for layer, e, d in picks:
            if free[layer, d] > 0 and (layer, e, d) not in out:
                out.append((layer, e, d))
                free[layer, d] -= 1
    return out


def budget_options(
    plan: Plan, recent: np.ndarray, current: Placement, spec: ModelSpec
) -> list[tuple[Plan, list[Plan]]]:
    """`[(plan_K, runs_K)]` for `K = 0 .. K_max`: `plan`'s homes with the first `K` of
    `budget_picks` (`with_replicas`), and what it runs on each step of `recent[S, L, D, E]`
    with retargeting, as `poise.plan.retarget.as_run` gives it: itself on step 0, step s's
    replicas the first `K` of step s-1's greedy (the same plans, each step's built once for
    every `K` it serves). `K_max`: the most replicas any recent step's greedy took, at most
    the picks there are (a larger `K` changes step 0 alone)."""
    p = plan.placement
    greedy = greedy_by_step(recent, p.home, p.slots_per_device)
    picks = budget_picks(greedy, p.home, p.slots_per_device, p.devices)
    top = min(len(picks), max((len(g) for g in greedy), default=0))
    built: dict[tuple[int, int], Plan] = {}
    out = []
    for k in range(top + 1):
        own = with_replicas(plan, picks[:k], recent[-1], current, spec)
        runs = [own]
        for s in range(1, len(recent)):
            n = min(k, len(greedy[s - 1]))
            placement = homes_with(p, greedy[s - 1][:n])
            if np.array_equal(placement.copies, own.placement.copies):
                runs.append(own)  # `retargeted` changes nothing
                continue
            if (s, n) not in built:
                split = Assignment.balanced(placement, recent[s - 1]).with_split(
                    plan.assignment.by_counts
                )
                built[s, n] = dataclasses.replace(
                    own, placement=placement, assignment=split, transfers=None
                )
            runs.append(built[s, n])
        out.append((own, runs))
    return out


def replica_budget(cost: CostModel, plan: Plan, recent: np.ndarray, current: Placement) -> Plan:
    """`plan` (an `auto` plan) with the number of replicas that prices least as run on
    `recent[S, L, D, E]` (module docstring); `plan` itself where it routes by groups, there are
    no recent steps, or no other number prices below it."""
    if len(recent) == 0 or plan.assignment.grouped:
        return plan
    options = budget_options(plan, recent, current, cost.spec)
    runs: list[Plan | list[Plan]] = [as_run(plan, recent, cost.spec)]
    prices = budget_prices(cost, runs + [r for _, r in options], recent)
    least = float(prices.min())
    tied = prices <= least + TIE_REL * abs(least)
    if tied[0]:
        return plan
    return options[int(np.argmax(tied[1:]))][0]  # the fewest replicas among the tied


__all__ = [
    "TIE_REL",
    "budget_options",
    "budget_picks",
    "budget_prices",
    "greedy_by_step",
    "replica_budget",
    "with_replicas",
]
