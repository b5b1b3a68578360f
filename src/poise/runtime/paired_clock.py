"""The paired clock: what a plan's replicas save on this machine's clock, measured and predicted.

While a plan with replicas is in force, the Balancer runs a step now and then on the plan's
homes without its replicas (`Balancer(probe_every=)`, `poise.runtime.probe_steps`). Each such
probe step against its neighbours (one step away: the same machine speed) measures what the
replicas save, with the machine's drift cancelled (`paired_clock`); the fitted cost model
predicts the same comparison (`modelled_clock`), and the gap between the two prices the
replicas of the next plans (`replica_scale`). The do-no-harm guard (`poise.runtime.guard`)
judges the plan in force by them. NumPy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.placement import Plan
from poise.cost.model import CostModel
from poise.runtime.homes import homes_alone
from poise.runtime.selfcal import PERIOD, SCALE_LIMITS, live_parts


@dataclass(frozen=True)
class Probes:
    """Probe steps and their neighbours for the paired clock test: `counts[P, L, D, E]`,
    `measured[P, len(selfcal.MEASURED)]` (seconds) of the probe steps (the plan's
    homes without its replicas); `pair_counts[Q, ...]`, `pair_measured[Q, ...]` the settled
    steps run under plans with replicas just before and after them, `pair_of[Q]` the probe
    each belongs to (every probe has one or two)."""

    counts: np.ndarray
    measured: np.ndarray
    pair_counts: np.ndarray
    pair_measured: np.ndarray
    pair_of: np.ndarray

    def __len__(self) -> int:
        return int(self.counts.shape[0])


def paired_clock(cost: CostModel, static: Plan, probes: Probes) -> tuple[float, float]:
    """`(saving, se)` per step of the replicas over the same homes without them, from probe
    steps paired with their neighbours (`poise.runtime.verdict`, test 2): with `r = period -
    busy_static(counts)` on every step, `d_i = r(probe i) - mean(r(its neighbours))`; the saving
    is `mean(d)` and its standard error `std(d) / sqrt(P)`. Neighbours one step away share the
    machine's speed, so its drift, which a reference taken once cannot follow, cancels."""
    r_probe = probes.measured[:, PERIOD] - live_parts(cost, static, probes.counts)[:, 0]
    r_pair = probes.pair_measured[:, PERIOD] - live_parts(cost, static, probes.pair_counts)[:, 0]
    n = len(probes)
    sums = np.bincount(probes.pair_of, weights=r_pair, minlength=n)
    per = np.bincount(probes.pair_of, minlength=n)
    d = r_probe - sums / np.maximum(per, 1)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")


def modelled_clock_parts(cost: CostModel, current: Plan, probes: Probes) -> tuple[float, float]:
    """`(busy_saving, transfers)` per step, the parts of `modelled_clock`: on each probe step's
    counts, the busy seconds of `current`'s homes alone (`homes_alone`, the probe's layout)
    minus `current`'s, and `current`'s Trans + Agg (`selfcal.live_parts`, at `cost`'s fitted
    transfer rate); means over the probes."""
    alone = live_parts(cost, homes_alone(current, cost.spec), probes.counts)
    plan = live_parts(cost, current, probes.counts)
    return float((alone[:, 0] - plan[:, 0]).mean()), float(plan[:, 1].mean())


def modelled_clock(cost: CostModel, current: Plan, probes: Probes) -> float:
    """The cost model's figure for what `paired_clock` measures, per step: the busy seconds
    the replicas save less their Trans + Agg (`modelled_clock_parts`)."""
    busy_saving, transfers = modelled_clock_parts(cost, current, probes)
    return busy_saving - transfers


def replica_scale(cost: CostModel, current: Plan, probes: Probes, wall_saving_s: float) -> float:
    """How much dearer the paired clock found `current`'s replicas than their modelled Trans +
    Agg: with `B`, `T` = `modelled_clock_parts` and the clock's saving `C` (`wall_saving_s`, as
    the caller reads it: the planning job passes `verdict.clock_ceiling`, so that the clock's
    noise alone does not make replicas dearer), the replicas' step
    cost as measured is `B - C` (what the busy model says they save, less what they saved),
    and the factor is `(B - C) / T`, at least 1 (a clock above `B - T` is the busy model's
    error, not the transfers': it does not make them cheaper than they measured) and within
    `selfcal.SCALE_LIMITS`. 1 where `current` has no Trans (no replicas to price).

    What it stands for: a replica costs a step more than the bytes of its Trans and Agg (the
    holder's extra slot in forward and backward, the counts it adds to the dispatcher's work,
    the launches inside the autograd hooks; measured per phase on `skewed`, docs/benchmarks.md),
    and every replica moves the same bytes (one expert's weights, then its gradients), so a
    per-replica cost scales like its transfers. The live planner prices replicas with it
    (`planning_job.run_job`): plans keep only the replicas whose saving exceeds what replicas
    measured to cost in this run."""
    busy_saving, transfers = modelled_clock_parts(cost, current, probes)
    if not transfers > 0:
        return 1.0
    return float(np.clip((busy_saving - wall_saving_s) / transfers, 1.0, SCALE_LIMITS[1]))


__all__ = [
    "Probes",
    "modelled_clock",
    "modelled_clock_parts",
    "paired_clock",
    "replica_scale",
]
