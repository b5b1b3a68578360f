"""A candidate plan priced against the plan in force, for the guard's adoption test.

`assess` prices both plans with the cost model on the forecast loads (their steps, their live
parts: the busy seconds balancing can shorten and the transfers it adds, `selfcal.live_parts`)
and, given the recent steps' counts, on each of those steps; the switch (homes moved) on the
cost model the guard measures switches against. `Assessment` holds the figures and the
per-step gain the guard credits (`live_gain_s`: the smaller of the forecast's and the recent
steps' mean) with its standard error from the recent steps' spread (`recent_gain_se_s`).
`poise.runtime.guard` decides on them (`SwitchGuard.decide`, `exit_choice`). Where the runtime
retargets replicas (`retarget`), the recent steps are priced as the plans would run them:
their own replicas on the first, then re-chosen from the step before (`poise.plan.retarget.
as_run`), not kept where the forecast put them. NumPy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.placement import Plan
from poise.cost.model import CostModel, PlanCost
from poise.plan.retarget import as_run
from poise.runtime.selfcal.fit import busy_and_transfers, live_parts


@dataclass(frozen=True)
class Assessment:
    """A candidate priced against the plan in force on the forecast, model seconds:
    `current_s`, `candidate_s` per step (the cost model's step), `switch_s` the one-off
    migration; `*_busy_s`, `*_transfers_s` the live parts per step (module docstring); `same`:
    the candidate's placement and assignment equal the current ones. `recent_busy_gain_s`,
    `recent_transfers_gain_s` (None without recent steps): the same per-step differences
    (current minus candidate), averaged over the recent steps' actual counts;
    `recent_gain_cov`: the covariance `[var busy, var transfers, cov]` of those two means over
    the steps (their sample covariance over the number of steps; None with fewer than two),
    for the standard error of the gain (`recent_gain_se_s`)."""

    same: bool
    current_s: float = 0.0
    candidate_s: float = 0.0
    switch_s: float = 0.0
    current_busy_s: float = 0.0
    candidate_busy_s: float = 0.0
    current_transfers_s: float = 0.0
    candidate_transfers_s: float = 0.0
    recent_busy_gain_s: float | None = None
    recent_transfers_gain_s: float | None = None
    recent_gain_cov: tuple[float, float, float] | None = None

    def recent_gain_se_s(self, k_transfer: float = 1.0) -> float:
        """The standard error of the recent steps' mean gain per step, `busy + k_transfer *
        transfers` (0 where fewer than two steps were priced): how far the mean of those steps'
        own gains could lie from what the plan earns a step, from their spread alone."""
        if self.recent_gain_cov is None:
            return 0.0
        var_b, var_t, cov = self.recent_gain_cov
        return float(np.sqrt(max(0.0, var_b + k_transfer**2 * var_t + 2 * k_transfer * cov)))

    def live_gain_s(self, k_transfer: float = 1.0) -> float:
        """`live_s(current) - live_s(candidate)` per step: on the forecast, and no more than on
        the recent steps' actual counts when those were priced (module docstring)."""
        busy = self.current_busy_s - self.candidate_busy_s
        gain = busy + k_transfer * (self.current_transfers_s - self.candidate_transfers_s)
        if self.recent_busy_gain_s is None or self.recent_transfers_gain_s is None:
            return gain
        return min(gain, self.recent_busy_gain_s + k_transfer * self.recent_transfers_gain_s)


def assess(
    cost: CostModel,
    current: Plan,
    candidate: Plan,
    loads: np.ndarray,
    switch_cost: CostModel | None = None,
    recent: np.ndarray | None = None,
    retarget: bool = False,
) -> Assessment:
    """Price `candidate` (with its migrations from `current`) and `current` on `loads[L, D, E]`;
    the switch on `switch_cost` (default `cost`: the live Balancer passes the prior cluster's,
    so that `k_switch`, measured against it, keeps one meaning while the fit moves); with
    `recent[S, L, D, E]`, both plans also on each of those steps' counts, with `retarget` as
    they would run them (module docstring). NumPy only (runs on the planner's thread)."""
    if current.digest() == candidate.digest():
        return Assessment(same=True)
    cur_phases, cur_load = cost.phases(current.placement, current.assignment, loads)
    new_phases, new_load = cost.phases(candidate.placement, candidate.assignment, loads)
    now = PlanCost.under(cost.schedule, cur_phases, cur_load)
    new = PlanCost.under(cost.schedule, new_phases, new_load)
    migrations = candidate.transfers.migrations if candidate.transfers is not None else None
    phases, _ = (switch_cost or cost).phases(
        candidate.placement, candidate.assignment, loads, migrations
    )
    switch = float(phases.migrate_s.sum())  # homes moved (the fill is the first step's Trans)
    cur_busy, cur_tr = busy_and_transfers(cur_phases)
    new_busy, new_tr = busy_and_transfers(new_phases)
    recent_gain: tuple[float | None, float | None] = (None, None)
    cov: tuple[float, float, float] | None = None
    if recent is not None and len(recent):
        now_ran, new_ran = current, candidate
        if retarget:
            now_ran, new_ran = (
                as_run(current, recent, cost.spec),
                as_run(candidate, recent, cost.spec),
            )
        steps = live_parts(cost, now_ran, recent) - live_parts(cost, new_ran, recent)  # [S, 2]
        recent_gain = (float(steps[:, 0].mean()), float(steps[:, 1].mean()))
        if len(steps) > 1:
            c = np.cov(steps, rowvar=False) / len(steps)  # of the means
            cov = (float(c[0, 0]), float(c[1, 1]), float(c[0, 1]))
    return Assessment(
        False, now.step_s, new.step_s, switch, cur_busy, new_busy, cur_tr, new_tr, *recent_gain,
        cov,
    )  # fmt: skip


__all__ = ["Assessment", "assess"]
