"""The paired clock: what a plan's replicas save on this machine's clock, measured and modelled.

Now and then a step runs on the plan's homes without its replicas (a *probe step*,
`runtime.probe_steps`). With `r = period - busy_static(counts)` on every step, each probe
against its neighbours, `d_i = r(probe i) - mean(r(neighbours))`, measures what the replicas save
with the machine's drift cancelled (`paired_clock`: mean and standard error of `d`). The fitted
model's figure for it (`modelled_clock_parts`) and the gap price the next plans' replicas
(`replica_scale`). A neighbour that straddles a stall of the host measures the stall, so
`steady_probes` leaves out a probe whose neighbours differ by an outlier among the
step-to-step differences (modified z-score beyond `OUTLIER_Z`). NumPy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.placement import Plan
from poise.cost.model import CostModel
from poise.cost.per_step import live_parts
from poise.plan.retarget import ran_plans
from poise.runtime.moves.homes import homes_alone
from poise.runtime.selfcal.fit import PERIOD, SCALE_LIMITS

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
    `[R, 3]` rows (`StepRecords.ran`; None: the plan's own)."""

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
    explain."""
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
    steps paired with their neighbours (module docstring): the mean of `d` and its standard
    error `std(d) / sqrt(P)` (inf with one probe)."""
    r_probe = residuals(cost, static, probes.counts, probes.measured)
    r_pair = residuals(cost, static, probes.pair_counts, probes.pair_measured)
    n = len(probes)
    sums = np.bincount(probes.pair_of, weights=r_pair, minlength=n)
    per = np.bincount(probes.pair_of, minlength=n)
    d = r_probe - sums / np.maximum(per, 1)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")


def modelled_clock_parts(cost: CostModel, current: Plan, probes: Probes) -> tuple[float, float]:
    """`(busy_saving, transfers)` per step, the model's figure for `paired_clock` being
    `busy_saving - transfers`: on each probe step's
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


def replica_scale(cost: CostModel, current: Plan, probes: Probes, clock_s: float) -> float:
    """How much dearer the paired clock found `current`'s replicas than their modelled Trans +
    Agg: with `B`, `T` = `modelled_clock_parts` and the clock's saving `C` (`clock_s`; the
    planning job passes the clock's upper bound, so that its noise alone does not make replicas
    dearer), the replicas cost `B - C` a step as measured, and the factor is `(B - C) / T`, at
    least 1 (a clock above `B - T` is the busy model's error, not the transfers') and within
    `SCALE_LIMITS`; 1 where `current` has no Trans. A replica costs a step more than its bytes
    (the holder's extra slot, the dispatcher's extra counts, the hooks' launches), and every
    replica moves the same bytes, so the extra scales like its transfers."""
    busy_saving, transfers = modelled_clock_parts(cost, current, probes)
    if not transfers > 0:
        return 1.0
    return float(np.clip((busy_saving - clock_s) / transfers, 1.0, SCALE_LIMITS[1]))
