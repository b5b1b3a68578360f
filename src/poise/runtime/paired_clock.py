"""The paired clock: what a plan's replicas save on this machine's clock, measured and predicted.

While a plan with replicas is in force, the Balancer runs a step now and then on the plan's
homes without its replicas (`Balancer(probe_every=)`, `poise.runtime.probe_steps`). Each such
probe step against its neighbours (one step away: the same machine speed) measures what the
replicas save, with the machine's drift cancelled (`paired_clock`); the fitted cost model
predicts the same comparison (`modelled_clock`), and the gap between the two prices the
replicas of the next plans (`replica_scale`). The do-no-harm guard (`poise.runtime.guard`)
judges the plan in force by them. NumPy only.

Each step's period (`selfcal.PERIOD`) runs from the previous step's Agg landing to its own, so a
replica step's carries its own Trans (launched at the boundary before it, waited in its forward)
and its own Agg, and a probe's neither. Ended where the Agg began instead, a probe's period held
its predecessor's Agg and the step after it lacked one: the clock read the replicas' saving
about one and a half Aggs too high.

The pairing assumes the machine's speed is the same over a probe and its two neighbours. A
shared host breaks that now and then: another process takes the cores for a few steps. On
`skewed` (2 gloo ranks, 2026-11-28) one such stall lengthened steps 29-32 by 80-420 ms, in the
static run beside auto as well; two of the four probes had a stalled neighbour, their pairs read
the replicas about -34 and -30 ms a step (by the step periods alone) where the clean two read
about +9 and +30, and the clock (-7.4 +-
12.0 ms against 53.6 modelled) sent the run back to the static layout for good. `steady_probes`
therefore leaves out a probe whose two neighbours disagree by more than noise: their
difference is an outlier among the step-to-step differences of the steps run under the plans
(the modified z-score beyond `OUTLIER_Z`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.placement import Plan
from poise.cost.model import CostModel
from poise.plan.retarget import ran_plans
from poise.runtime.moves.homes import homes_alone
from poise.runtime.selfcal.fit import PERIOD, SCALE_LIMITS, live_parts

# Iglewicz and Hoaglin, "How to Detect and Handle Outliers" (ASQC Basic References in Quality
# Control 16, 1993): an observation whose modified z-score, 0.6745 (x - median) / MAD, exceeds
# 3.5 in magnitude is labelled a potential outlier. 0.6745 / MAD is 1 / (1.4826 MAD), the
# normal-equivalent standard deviation's inverse.
OUTLIER_Z = 3.5
MAD_SIGMA = 1.4826  # the standard deviation per median absolute deviation (normal data)
MIN_STEADY_DIFFS = 5  # step-to-step differences needed to tell a neighbour's stall from noise


@dataclass(frozen=True)
class Probes:
    """Probe steps and their neighbours for the paired clock test: `counts[P, L, D, E]`,
    `measured[P, len(selfcal.MEASURED)]` (seconds) of the probe steps (the plan's
    homes without its replicas); `pair_counts[Q, ...]`, `pair_measured[Q, ...]` the settled
    steps run under plans with replicas just before and after them, `pair_of[Q]` the probe
    each belongs to (every probe has one or two); `pair_ran`: the replicas each of those ran,
    `[R, 3]` rows (`records.StepRecords.ran`; None: the plan's own)."""

    counts: np.ndarray
    measured: np.ndarray
    pair_counts: np.ndarray
    pair_measured: np.ndarray
    pair_of: np.ndarray
    pair_ran: tuple[np.ndarray, ...] | None = None

    def __len__(self) -> int:
        return int(self.counts.shape[0])

    def subset(self, keep: np.ndarray) -> Probes:
        """The probes where `keep[P]` (bool) holds, with their neighbours, re-indexed."""
        keep = np.asarray(keep, dtype=bool)
        new_index = np.cumsum(keep) - 1
        pairs = keep[self.pair_of]
        ran = None
        if self.pair_ran is not None:
            ran = tuple(r for r, k in zip(self.pair_ran, pairs, strict=True) if k)
        return Probes(
            self.counts[keep], self.measured[keep], self.pair_counts[pairs],
            self.pair_measured[pairs], new_index[self.pair_of[pairs]], ran,
        )  # fmt: skip


def residuals(cost: CostModel, static: Plan, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`r[S]`, each step's measured period less the static layout's busy seconds on its counts
    (`counts[S, L, D, E]`, `rows[S, len(selfcal.MEASURED)]`): what the static model does not
    explain (`poise.runtime.verdict`, test 2)."""
    return rows[:, PERIOD] - live_parts(cost, static, counts)[:, 0]


def robust_spread(x: np.ndarray) -> float:
    """The normal-equivalent standard deviation of `x` from its median absolute deviation:
    `MAD_SIGMA * median(|x - median(x)|)`."""
    return MAD_SIGMA * float(np.median(np.abs(x - np.median(x))))


def steady_probes(
    cost: CostModel,
    static: Plan,
    probes: Probes,
    steady_counts: np.ndarray,
    steady_rows: np.ndarray,
) -> Probes:
    """`probes` less those whose two neighbours disagree beyond the machine's step-to-step
    noise (module docstring). With `r` the `residuals` of the settled steps run under plans
    with replicas (`steady_counts[B, L, D, E]`, `steady_rows[B, len(selfcal.MEASURED)]`, in
    step order) and `diff` its successive differences, a probe goes when, for its neighbours'
    residuals `a` (before) and `b` (after),

        |b - a - median(diff)| > OUTLIER_Z * MAD_SIGMA * median(|diff - median(diff)|)

    (the modified z-score of Iglewicz and Hoaglin). Probes with one neighbour stay (nothing to
    compare it with), and so do all of them with fewer than `MIN_STEADY_DIFFS` differences or
    a spread of 0."""
    if len(probes) == 0 or len(steady_rows) < MIN_STEADY_DIFFS + 1:
        return probes
    diff = np.diff(residuals(cost, static, steady_counts, steady_rows))
    centre, spread = float(np.median(diff)), robust_spread(diff)
    if not spread > 0:
        return probes
    r_pair = residuals(cost, static, probes.pair_counts, probes.pair_measured)
    keep = np.ones(len(probes), dtype=bool)
    for i in range(len(probes)):
        around = r_pair[probes.pair_of == i]
        if len(around) == 2 and abs(around[1] - around[0] - centre) > OUTLIER_Z * spread:
            keep[i] = False
    return probes.subset(keep)


def paired_clock(cost: CostModel, static: Plan, probes: Probes) -> tuple[float, float]:
    """`(saving, se)` per step of the replicas over the same homes without them, from probe
    steps paired with their neighbours (`poise.runtime.verdict`, test 2): with `r = period -
    busy_static(counts)` on every step, `d_i = r(probe i) - mean(r(its neighbours))`; the saving
    is `mean(d)` and its standard error `std(d) / sqrt(P)`. Neighbours one step away share the
    machine's speed, so its drift, which a reference taken once cannot follow, cancels."""
    r_probe = residuals(cost, static, probes.counts, probes.measured)
    r_pair = residuals(cost, static, probes.pair_counts, probes.pair_measured)
    n = len(probes)
    sums = np.bincount(probes.pair_of, weights=r_pair, minlength=n)
    per = np.bincount(probes.pair_of, minlength=n)
    d = r_probe - sums / np.maximum(per, 1)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")


def modelled_clock_parts(cost: CostModel, current: Plan, probes: Probes) -> tuple[float, float]:
    """`(busy_saving, transfers)` per step, the parts of `modelled_clock`: on each probe step's
    counts, the busy seconds of `current`'s homes alone (`homes_alone`, the probe's layout)
    minus `current`'s, and `current`'s Trans + Agg (`selfcal.live_parts`, at `cost`'s fitted
    transfer rate); means over the probes. Where the neighbours ran other replicas than
    `current`'s own (`probes.pair_ran`: retargeted, `poise.plan.retarget`), the same on each
    neighbour's counts with what it ran (`ran_plans`), means over the neighbours."""
    alone_plan = homes_alone(current, cost.spec)
    ran = ran_plans(current, probes.pair_ran, probes.pair_counts)
    if isinstance(ran, Plan):
        alone = live_parts(cost, alone_plan, probes.counts)
        plan = live_parts(cost, current, probes.counts)
    else:
        alone = live_parts(cost, alone_plan, probes.pair_counts)
        plan = live_parts(cost, ran, probes.pair_counts)
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
    "MAD_SIGMA",
    "OUTLIER_Z",
    "Probes",
    "modelled_clock",
    "modelled_clock_parts",
    "paired_clock",
    "replica_scale",
    "residuals",
    "robust_spread",
    "steady_probes",
]
