"""Replica retargeting: at each step boundary under a plan with replicas, its replica slots go to
the experts the step just run shows hot, the plan's homes and replica count staying.

Why: a replica's weights travel every step anyway (Trans after each optimizer step, Agg of its
gradient back), so *which* expert a replica slot copies can change from one step to the next
at no cost in bytes; only homes carry weights and optimizer state that a move would migrate.
In training from scratch the router's hot experts wander: `skewed`'s layer 2 changed its
hottest expert every 3-6 steps over steps 15-60, so a replica chosen from a 10-step window's
forecast served the expert that *had been* hot. Replaying the static runs' recorded counts
with one replica a layer on the heavier rank's hottest expert, chosen from the window's mean
every 10 steps, left 10.9% of the slowest ranks' excess pairs on `skewed` and 14.6% on
`skewed-micro4`; chosen from the previous step, 2.8% and 3.6% (docs/benchmarks.md, "Replica
retargeting"). The per-step token split (`poise.core.token_split`) then levels each step as
well as the retargeted replica set allows.

One layer, `D` devices, `E` experts; `c[s, e]` the counts of the step just run (all ranks'
gathered counts), `T_e = sum_s c[s, e]`, `h(e)` the plan's home of e, `k` the plan's replicas
in the layer, `free[d]` device d's slots less its homes. With `x[e, d]` the tokens of e device
d computes (at first all of `T_e` on `h(e)`) and `load[d] = sum_e x[e, d]`, up to `k` times:

    d_hi = argmax_d load[d],   e* = argmax_e x[e, d_hi]
    d_lo = argmin load[d] over devices with free[d] > 0 that hold no copy of e*
    stop where there is no such d_lo or load[d_hi] <= load[d_lo]; else a replica of e* on d_lo,
    moving m = min(x[e*, d_hi], (load[d_hi] - load[d_lo]) / 2) of e*'s tokens to it

(ties: the lowest index). So a layer whose last step was balanced keeps fewer replicas than the
plan (fewer bytes in Trans and Agg), never more. The same counts give the same plan on every
rank: no agreement is needed beyond the gather every step already makes. NumPy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec


def layer_replicas(
    counts: np.ndarray, home: np.ndarray, slots: int, k: int
) -> list[tuple[int, int]]:
    """`[(expert, device)]`: at most `k` replicas for one layer's `counts[D, E]` of the step just
    run, the homes `home[E]` fixed, `slots` per device (the module docstring's greedy)."""
    D, E = counts.shape
    x = np.zeros((E, D))
    x[np.arange(E), home] = counts.sum(axis=0)
    held = np.zeros((E, D), dtype=bool)
    held[np.arange(E), home] = True
    free = slots - np.bincount(home, minlength=D)
    chosen: list[tuple[int, int]] = []
    for _ in range(k):
        load = x.sum(axis=0)
        d_hi = int(np.argmax(load))
        e = int(np.argmax(x[:, d_hi]))
        open_ = np.flatnonzero((free > 0) & ~held[e])
        if not open_.size or x[e, d_hi] <= 0:
            break
        d_lo = int(open_[np.argmin(load[open_])])
        if load[d_hi] <= load[d_lo]:
            break
        m = min(x[e, d_hi], (load[d_hi] - load[d_lo]) / 2)
        x[e, d_hi] -= m
        x[e, d_lo] += m
        held[e, d_lo] = True
        free[d_lo] -= 1
        chosen.append((e, d_lo))
    return chosen


def retargeted(plan: Plan, counts: np.ndarray, spec: ModelSpec) -> Plan:
    """`plan` with each layer's replicas re-chosen from `counts[L, D, E]`, the counts of the step
    just run (`layer_replicas`, as many as `plan` has in the layer at most); its homes, policy and
    per-step splitting kept, its remote tokens split to level `counts` (`Assignment.balanced`),
    its transfers against `plan` (no home moves: replicas only). `plan` itself where it has no
    replicas, routes by groups (HybridEP), or the replicas come out the same."""
    p = plan.placement
    replicas = p.replicas()
    if not replicas.any() or plan.assignment.grouped:
        return plan
    copies = np.zeros_like(p.copies)
    L, E = p.home.shape
    copies[np.arange(L)[:, None], p.home, np.arange(E)[None, :]] = 1
    for layer in range(L):
        k = int(replicas[layer].sum())
        for e, d in layer_replicas(counts[layer], p.home[layer], p.slots_per_device, k):
            copies[layer, d, e] = 1
    if np.array_equal(copies, p.copies):
        return plan
    placement = Placement(home=p.home.copy(), copies=copies, slots_per_device=p.slots_per_device)
    assignment = Assignment.balanced(placement, counts).with_split(plan.assignment.by_counts)
    return dataclasses.replace(
        plan,
        placement=placement,
        assignment=assignment,
        transfers=transfers_between(p, placement, spec),
        cost=None,
    )


__all__ = ["layer_replicas", "retargeted"]
