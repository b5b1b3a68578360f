"""A candidate plan priced against the plan in force: its gain a step, its noise, its switch.

Per step, with the live parts of `poise.cost.per_step` on the fitted cluster and `gain` the plan
in force's `busy + transfers` less the candidate's (the non-MoE work cancels):

    gain_s = min(gain on the forecast, mean gain on the recent steps)
    se_s   = std(gain on each recent step) / sqrt(S)

on the recent steps as the plans would run them (`poise.plan.retarget.as_run`): a plan fitted to
a smoothed forecast looks better on it than on any real step. A switch costs what this run's
switches measured (`SwitchPrice`):

    switch_s = k_switch * migration_s + relay_s + wait_s

with `migration_s` the modelled migration of the homes that move (on the prior cluster, so that
`k_switch` keeps one meaning while the fit moves), `k_switch` the measured over modelled seconds
of the migrations so far (before any, the start-up switch probe's), `relay_s` the mean of what
switches cost beyond their migration, `wait_s` the boundary's wait for the planner. NumPy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.errors import ConfigError
from poise.core.fields import get_number
from poise.core.placement import Plan
from poise.cost.model import CostModel, PlanCost
from poise.cost.per_step import busy_and_transfers, live_parts
from poise.plan.retarget import as_run
from poise.runtime.selfcal.fit import MIGRATE, exposed_transfers_s


@dataclass(frozen=True)
class Priced:
    """A candidate `plan` against the plan in force (module docstring), seconds a step:
    `forecast_gain_s` on the forecast, `recent_gain_s` the mean over `n_recent` recent steps
    (None without), `se_s` its standard error; `migration_s` the modelled migration;
    `step_s`, `current_step_s` the fitted model's steps of both; `transfers_s` the candidate's
    Trans + Agg; `horizon` the steps its gain is credited over; `forecast_free`: it keeps the
    homes in force and its replicas follow the router, so no forecast error applies; `exit`: a
    fallback target, `static` or `homes alone` (the plan in force without its replicas);
    `same`: it is the plan in force; `switch_s`: its switch's price, set by the decision."""

    plan: Plan
    same: bool = False
    forecast_gain_s: float = 0.0
    recent_gain_s: float | None = None
    se_s: float = 0.0
    n_recent: int = 0
    migration_s: float = 0.0
    step_s: float = 0.0
    current_step_s: float = 0.0
    transfers_s: float = 0.0
    horizon: int = 1
    forecast_free: bool = False
    exit: str = ""
    switch_s: float = 0.0

    @property
    def gain_s(self) -> float:
        """The smaller of the forecast's and the recent steps' gain a step."""
        if self.recent_gain_s is None:
            return self.forecast_gain_s
        return min(self.forecast_gain_s, self.recent_gain_s)

    @property
    def kind(self) -> str:
        """`replicas` where the plan holds a replica, else `homes`."""
        return "replicas" if self.plan.placement.replicas().any() else "homes"


def price(
    cost: CostModel,
    current: Plan,
    candidate: Plan,
    loads: np.ndarray,
    *,
    switch_cost: CostModel | None = None,
    recent: np.ndarray | None = None,
    retarget: bool = False,
    horizon: int = 1,
    forecast_free: bool = False,
    exit: str = "",
) -> Priced:
    """`candidate` priced against `current` on the forecast `loads[L, D, E]` and, with
    `recent[S, L, D, E]`, on each of those steps (`retarget`: as the plans would run them); its
    migration on `switch_cost` (default `cost`)."""
    if current.digest() == candidate.digest():
        return Priced(candidate, same=True, horizon=horizon, forecast_free=forecast_free, exit=exit)
    cur_phases, cur_load = cost.phases(current.placement, current.assignment, loads)
    new_phases, new_load = cost.phases(candidate.placement, candidate.assignment, loads)
    migrations = candidate.transfers.migrations if candidate.transfers is not None else None
    phases, _ = (switch_cost or cost).phases(
        candidate.placement, candidate.assignment, loads, migrations
    )
    cur_busy, cur_tr = busy_and_transfers(cur_phases)
    new_busy, new_tr = busy_and_transfers(new_phases)
    recent_gain, se, n = None, 0.0, 0
    if recent is not None and len(recent):
        now_ran, new_ran = current, candidate
        if retarget:
            now_ran, new_ran = (
                as_run(current, recent, cost.spec),
                as_run(candidate, recent, cost.spec),
            )
        steps = (live_parts(cost, now_ran, recent) - live_parts(cost, new_ran, recent)).sum(axis=1)
        n = len(steps)
        recent_gain = float(steps.mean())
        se = float(steps.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
    return Priced(
        candidate,
        forecast_gain_s=(cur_busy + cur_tr) - (new_busy + new_tr),
        recent_gain_s=recent_gain,
        se_s=se,
        n_recent=n,
        migration_s=float(phases.migrate_s.sum()),
        step_s=PlanCost.under(cost.schedule, new_phases, new_load).step_s,
        current_step_s=PlanCost.under(cost.schedule, cur_phases, cur_load).step_s,
        transfers_s=new_tr,
        horizon=horizon,
        forecast_free=forecast_free,
        exit=exit,
    )


def switch_seconds(rows: np.ndarray, step: int, wait_s: float) -> float | None:
    """The measured seconds of the switch made at boundary `step`, from measured rows
    `rows[n, 1 + len(MEASURED)]` (step, then seconds): the exposed transfer seconds of the step
    that carried it less their median over the steps after it (which pay the same Trans and
    Agg) and less the planner wait; None until that step and one after it were measured."""
    ids = rows[:, 0]
    carried, after = rows[ids == step, 1:], rows[ids > step, 1:]
    if len(carried) != 1 or len(after) == 0:
        return None
    steady = float(np.median(exposed_transfers_s(after)))
    return float(exposed_transfers_s(carried)[0]) - steady - max(0.0, wait_s)


def migration_seconds(rows: np.ndarray, step: int) -> float | None:
    """The seconds the switch at boundary `step` spent migrating homes; None while unmeasured."""
    carried = rows[rows[:, 0] == step, 1:]
    return float(carried[0, MIGRATE]) if len(carried) == 1 else None


class SwitchPrice:
    """What a switch costs in this run (module docstring), learned from the switches measured;
    `prior`: `k_switch` before any (the start-up switch probe's, else 1)."""

    FIELDS = ("k_switch", "migrated_s", "modelled_s", "switches", "relay_s", "relays")

    def __init__(self, prior: float = 1.0) -> None:
        self.prior = float(prior)
        self.k_switch = self.prior
        self.migrated_s = self.modelled_s = self.relay_s = 0.0
        self.switches = self.relays = 0

    def cost(self, migration_s: float, wait_s: float = 0.0) -> float:
        """Seconds a switch whose migration is modelled at `migration_s` costs."""
        return self.k_switch * migration_s + self.relay_s + max(0.0, wait_s)

    def record(self, measured_s: float, modelled_s: float, migrate_s: float | None) -> None:
        """A switch's measured seconds (`switch_seconds`), its modelled migration and the seconds
        its migration took (None: not known). `k_switch` is the migrations' measured over
        modelled seconds, summed over the switches that moved homes (a large migration weighs
        by its size); what a switch cost beyond its migration counts towards `relay_s`."""
        if not np.isfinite(measured_s):
            return
        moved = modelled_s > 0
        known = migrate_s is not None and np.isfinite(migrate_s)
        if not moved or known:
            beyond = measured_s - (migrate_s if moved and known else 0.0)
            self.relays += 1
            self.relay_s += (max(0.0, beyond) - self.relay_s) / self.relays
        seconds = migrate_s if known else measured_s
        if not moved or not seconds > 0:
            return
        self.switches += 1
        self.migrated_s += seconds
        self.modelled_s += modelled_s
        self.k_switch = self.migrated_s / self.modelled_s

    def state(self) -> dict[str, float | int]:
        """What it learned, as plain values for a checkpoint."""
        return {name: getattr(self, name) for name in self.FIELDS}

    def restore(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        """Take back `state()`; one `ConfigError` naming `source` and the entry otherwise."""
        if set(state) != set(self.FIELDS):
            raise ConfigError(f"expected {list(self.FIELDS)}", source=source, field="switch")
        for name in self.FIELDS:
            v = get_number(state, name, source, prefix="switch.")
            setattr(self, name, type(getattr(self, name))(v))
