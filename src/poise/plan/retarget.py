"""Replica retargeting: at each step boundary under a plan with replicas, its replica slots go to
the experts the step just run shows hot, the plan's homes and its number of replicas staying.

Why: a replica's weights travel every step anyway (Trans after each optimizer step, Agg of its
gradient back), so *which* expert a replica slot copies can change from one step to the next at no
cost in bytes; only homes carry weights and optimizer state that a move would migrate. In training
from scratch the router's hot experts wander: in `skewed-micro4`'s static run layer 2 changed its
hottest expert every 3-6 steps over steps 15-60, so a replica chosen from a 10-step window's
forecast served the expert that *had been* hot. Replaying the static runs' recorded counts with one
replica a layer on the heavier rank's hottest expert, chosen from the window's mean every 10 steps,
left 10.9% of the slowest ranks' excess pairs on `skewed` and 14.6% on `skewed-micro4`; chosen from
the previous step, 2.8% and 3.6% (docs/benchmarks.md, "Replica retargeting"). The per-step token
split (`poise.core.token_split`) then levels each step as well as the retargeted replica set allows.

Layers `l`, `D` devices, `E` experts; `c[l, s, e]` the counts of the step just run (all
ranks' gathered counts), `T[l, e] = sum_s c[l, s, e]`, `h(l, e)` the plan's home of e, `K` the
plan's replicas over all layers, `free[l, d]` device d's slots in layer l less its homes. With
`x[l, e, d]` the tokens of e device d computes in layer l (at first all of `T[l, e]` on its
home) and `load[l, d] = sum_e x[l, e, d]`, each layer's next replica is the one that moves the
most tokens off its heaviest device `d_hi = argmax_d load[l, d]`:

    m_l = max over (e, d) of  min(x[l, e, d_hi], (load[l, d_hi] - load[l, d]) / 2)
          over devices d with free[l, d] > 0 that hold no copy of e (0 where there is none)

and up to `K` times the layer with the largest `m_l` takes its replica (`m_l` of e's tokens
moved to d), stopping where every `m_l` is 0 (ties: the lowest index: layer, expert, device). Every
layer's experts have the same size, so a replica costs the same bytes in any layer: the plan's
`K` replicas (what its cost check paid for) go where the step just run needed them, a layer
balanced last step lending its replica to one that was not; never more than `K`, fewer where
the step was balanced (fewer bytes in Trans and Agg). The same counts give the same plan on
every rank: no agreement is needed beyond the gather every step already makes. NumPy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec


class _Layer:
    """One layer's greedy state (module docstring): `x[e, d]` the tokens of e device d computes,
    which devices hold e, and each device's free slots."""

    def __init__(self, counts: np.ndarray, home: np.ndarray, slots: int) -> None:
        D, E = counts.shape
        self.x = np.zeros((E, D))
        self.x[np.arange(E), home] = counts.sum(axis=0)
        self.held = np.zeros((E, D), dtype=bool)
        self.held[np.arange(E), home] = True
        self.free = slots - np.bincount(home, minlength=D)

    def best(self) -> tuple[float, int, int, int]:
        """`(m, e, d_hi, d_lo)`: the next replica's tokens moved off the heaviest device, its
        expert and devices (module docstring); `m` 0 where no replica would lower it."""
        load = self.x.sum(axis=0)
        d_hi = int(np.argmax(load))
        # [E, D]: what a replica of e on d would move off d_hi; only onto free slots of devices
        # that do not hold e yet
        gain = np.minimum(self.x[:, d_hi, None], (load[d_hi] - load)[None, :] / 2)
        gain = np.where(self.held | (self.free <= 0)[None, :], 0.0, gain)
        e, d_lo = np.unravel_index(int(np.argmax(gain)), gain.shape)
        return max(float(gain[e, d_lo]), 0.0), int(e), d_hi, int(d_lo)

    def add(self, m: float, e: int, d_hi: int, d_lo: int) -> None:
        self.x[e, d_hi] -= m
        self.x[e, d_lo] += m
        self.held[e, d_lo] = True
        self.free[d_lo] -= 1


def replica_picks(
    counts: np.ndarray, home: np.ndarray, slots: int, k: int
) -> list[tuple[int, int, int]]:
    """`[(layer, expert, device)]`: at most `k` replicas over all layers for `counts[L, D, E]`
    of the step just run, the homes `home[L, E]` fixed, `slots` per device in every layer (the
    module docstring's greedy: each next replica where it moves the most tokens off a layer's
    heaviest device)."""
    layers = [_Layer(counts[i], home[i], slots) for i in range(len(home))]
    best = [layer.best() for layer in layers]
    chosen: list[tuple[int, int, int]] = []
    for _ in range(k):
        i = max(range(len(layers)), key=lambda j: (best[j][0], -j))
        m, e, d_hi, d_lo = best[i]
        if m <= 0:
            break
        layers[i].add(m, e, d_hi, d_lo)
        chosen.append((i, e, d_lo))
        best[i] = layers[i].best()
    return chosen


def free_slots(home: np.ndarray, slots: int, devices: int) -> np.ndarray:
    """`[L, D]` each device's slots in each layer less the homes `home[L, E]` it holds."""
    return slots - np.stack([np.bincount(h, minlength=devices) for h in home])


def homes_with(p: Placement, picks: Sequence[tuple[int, int, int]]) -> Placement:
    """`p`'s homes with the replicas `picks`, `(layer, expert, device)` each, and no other."""
    copies = np.zeros_like(p.copies)
    L, E = p.home.shape
    copies[np.arange(L)[:, None], p.home, np.arange(E)[None, :]] = 1
    for layer, e, d in picks:
        copies[layer, d, e] = 1
    return Placement(home=p.home.copy(), copies=copies, slots_per_device=p.slots_per_device)


def retargeted(plan: Plan, counts: np.ndarray, spec: ModelSpec) -> Plan:
    """`plan` with its replicas re-chosen from `counts[L, D, E]`, the counts of the step just run
    (`replica_picks`, as many as `plan` has over all layers at most); its homes, policy and
    per-step splitting kept, its remote tokens split to level `counts` (`Assignment.balanced`),
    its transfers against `plan` (no home moves: replicas only; `spec` gives their bytes, so
    only its shapes matter). `plan` itself where it has no replicas, routes by groups
    (HybridEP), or the replicas come out the same."""
    p = plan.placement
    replicas = p.replicas()
    if not replicas.any() or plan.assignment.grouped:
        return plan
    picks = replica_picks(counts, p.home, p.slots_per_device, int(replicas.sum()))
    placement = homes_with(p, picks)
    if np.array_equal(placement.copies, p.copies):
        return plan
    return with_placement(plan, placement, counts, p, spec)


def with_placement(
    plan: Plan, placement: Placement, counts: np.ndarray, since: Placement, spec: ModelSpec
) -> Plan:
    """`plan` on `placement` (its homes with other replicas, `homes_with`), its tokens split to
    level `counts[L, D, E]` (`Assignment.balanced`, by counts where `plan` splits so), its
    transfers from the placement `since` (`spec` gives their bytes)."""
    assignment = Assignment.balanced(placement, counts).with_split(plan.assignment.by_counts)
    return dataclasses.replace(
        plan,
        placement=placement,
        assignment=assignment,
        transfers=transfers_between(since, placement, spec),
        cost=None,
    )


def as_run(plan: Plan, counts: np.ndarray, spec: ModelSpec) -> Plan | list[Plan]:
    """What `plan` would run on each step of `counts[S, L, D, E]` had it been adopted before
    the first with retargeting on: its own replicas on step 0 (a switch's step runs them), step
    s's re-chosen from step s-1's counts (`retargeted`, as each later boundary does); `plan`
    itself where it has no replicas (retargeting never acts) or routes by groups. How a plan
    with replicas is priced on recent steps where the runtime retargets: on its own replicas
    alone, a plan made from a window's forecast is priced as if its replicas stayed on the
    experts that were hot, not on those each step ran."""
    if not plan.placement.replicas().any() or plan.assignment.grouped:
        return plan
    return [plan] + [retargeted(plan, counts[s - 1], spec) for s in range(1, len(counts))]


def ran_plans(
    plan: Plan, ran: Sequence[np.ndarray] | None, counts: np.ndarray
) -> Plan | list[Plan]:
    """What steps run under `plan` ran, to price them on it: `plan` itself where `ran` is None
    or every step ran `plan`'s own replicas; else one plan per step of `counts[S, L, D, E]`,
    `plan`'s homes with the step's replicas `ran[s]` (`[R, 3]` rows `(layer, device, expert)`,
    as `StepRecords.ran` keeps them), its tokens split as the runtime's per-step split starts
    from (`Assignment.balanced` on the step's counts, splitting by counts where `plan` does),
    and `plan` itself on the steps that ran its own."""
    own = np.argwhere(plan.placement.replicas())
    if ran is None or all(np.array_equal(r, own) for r in ran):
        return plan
    out = []
    for rows, step_counts in zip(ran, counts, strict=True):
        if np.array_equal(rows, own):
            out.append(plan)
            continue
        rows = np.asarray(rows, np.int64).reshape(-1, 3)
        placement = homes_with(plan.placement, [(int(i), int(e), int(d)) for i, d, e in rows])
        assignment = Assignment.balanced(placement, step_counts).with_split(
            plan.assignment.by_counts
        )
        out.append(dataclasses.replace(plan, placement=placement, assignment=assignment, cost=None))
    return out


__all__ = [
    "as_run",
    "free_slots",
    "homes_with",
    "ran_plans",
    "replica_picks",
    "retargeted",
    "with_placement",
]
