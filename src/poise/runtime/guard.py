"""Do no harm: adopt a plan only when it pays, and fall back to the static layout when it does
not.

Adoption (`SwitchGuard.decide`). A candidate plan is priced against the plan in force on the
forecast loads by the (self-calibrated, `poise.runtime.selfcal`) cost model:

    gain   = (step_s(current) - step_s(candidate)) * horizon          seconds saved
    switch = k_switch * (migrate_s + fill_s)(candidate) + wait_s      seconds the switch costs

with `horizon` the steps the plan serves before the next re-plan, `migrate_s + fill_s` the
modelled one-off transfers (homes moved with their optimizer state, new replicas filled),
`k_switch` the measured / modelled ratio of the switches this run already made (1 before the
first), and `wait_s` the seconds the boundary waited for the planner. The plan is adopted iff
`gain > (1 + margin) * switch` and `gain > 0`. A candidate equal to the plan in force (same
placement and assignment) is skipped outright: no transfer, no routing change.

Keeping it (`SwitchGuard.pays`). After a switch the Balancer keeps measuring the step period
(the slowest rank's wall time between two step boundaries). At the next decision, the median
period under the new plan (the first step after the switch, which carries the migration, left
out) is compared with the median of the steps before it under the previous plan; when the new
plan is not faster, the Balancer goes back to the static layout and skips the next `backoff`
re-plans (doubling after each fallback in a row, up to `max_backoff`).

Every input is identical on every rank (gathered measurements, the same plan from the same
loads); the Balancer still takes a vote across ranks (any rank refusing refuses), so a rank's
own planner timings cannot split the decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.errors import ConfigError
from poise.core.placement import Plan
from poise.cost.model import CostModel


@dataclass(frozen=True)
class Assessment:
    """A candidate priced against the plan in force on the forecast, model seconds:
    `current_s`, `candidate_s` per step, `switch_s` the one-off transfers; `same`: the
    candidate's placement and assignment equal the current ones."""

    same: bool
    current_s: float = 0.0
    candidate_s: float = 0.0
    switch_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    """What the guard decided: `adopt`, why (`reason`: adopt, same, no-gain, off), and the
    figures it compared (seconds): `gain_s` over the horizon, `switch_s` the switch's cost."""

    adopt: bool
    reason: str
    gain_s: float = 0.0
    switch_s: float = 0.0


def assess(cost: CostModel, current: Plan, candidate: Plan, loads: np.ndarray) -> Assessment:
    """Price `candidate` (with its migrations from `current`) and `current` on `loads[L, D, E]`.
    NumPy only (runs on the planner's thread)."""
    if current.digest() == candidate.digest():
        return Assessment(same=True)
    now = cost.price(current.placement, current.assignment, loads)
    new = cost.price(candidate.placement, candidate.assignment, loads)
    migrations = candidate.transfers.migrations if candidate.transfers is not None else None
    phases, _ = cost.phases(candidate.placement, candidate.assignment, loads, migrations)
    switch = float(phases.migrate_s.sum() + phases.trans_s.sum())  # homes moved + replicas filled
    return Assessment(False, now.step_s, new.step_s, switch)


class SwitchGuard:
    """The adoption rule and the fallback rule (module docstring), with their state.

    `margin`: the switch must be paid `1 + margin` times; `horizon`: steps a plan serves;
    `backoff`: re-plans skipped after the first fallback (doubles up to `max_backoff`);
    `enabled=False` adopts every candidate that differs and never falls back."""

    def __init__(
        self,
        horizon: int,
        margin: float = 0.2,
        backoff: int = 1,
        max_backoff: int = 8,
        enabled: bool = True,
    ) -> None:
        if horizon < 1:
            raise ConfigError(f"must be >= 1, got {horizon}", field="guard.horizon")
        if not margin >= 0:
            raise ConfigError(f"must be >= 0, got {margin}", field="guard.margin")
        if backoff < 0 or max_backoff < backoff:
            raise ConfigError(
                f"need 0 <= backoff <= max_backoff, got {backoff}, {max_backoff}",
                field="guard.backoff",
            )
        self.horizon = int(horizon)
        self.margin = float(margin)
        self.backoff = int(backoff)
        self.max_backoff = int(max_backoff)
        self.enabled = enabled
        self.k_switch = 1.0
        self._switches = 0
        self.fallbacks = 0
        self._skip = 0  # re-plans still to skip
        self._next_backoff = self.backoff

    # ------------------------------------------------------------------ adoption
    def decide(self, a: Assessment, wait_s: float = 0.0) -> Decision:
        """Adopt or not (see the module docstring)."""
        if a.same:
            return Decision(False, "same")
        gain = (a.current_s - a.candidate_s) * self.horizon
        switch = self.k_switch * a.switch_s + max(0.0, wait_s)
        if not self.enabled:
            return Decision(True, "off", gain, switch)
        ok = gain > 0 and gain > (1.0 + self.margin) * switch
        return Decision(ok, "adopt" if ok else "no-gain", gain, switch)

    def record_switch(self, measured_s: float, modelled_s: float) -> None:
        """A switch's measured seconds against its modelled ones: `k_switch` becomes the mean
        ratio over the switches so far."""
        if not (measured_s > 0 and modelled_s > 0):
            return
        self._switches += 1
        ratio = measured_s / modelled_s
        self.k_switch += (ratio - self.k_switch) / self._switches

    # ------------------------------------------------------------------ keeping it
    def pays(self, before_s: np.ndarray, after_s: np.ndarray) -> bool:
        """Whether the plan in force pays: the median step period `after_s` under it below the
        median `before_s` under the previous plan (True while either is empty)."""
        before = np.asarray(before_s, float)
        after = np.asarray(after_s, float)
        before, after = before[before > 0], after[after > 0]
        if not self.enabled or before.size == 0 or after.size == 0:
            return True
        return float(np.median(after)) < float(np.median(before))

    def fell_back(self) -> None:
        """Record a fallback: skip the next re-plans (doubling on repeats)."""
        self.fallbacks += 1
        self._skip = self._next_backoff
        self._next_backoff = min(self.max_backoff, max(1, 2 * self._next_backoff))

    def kept(self) -> None:
        """A plan proved itself: reset the backoff."""
        self._next_backoff = self.backoff

    def skip_replan(self) -> bool:
        """Consume one skipped re-plan; True if this one is skipped."""
        if self._skip > 0:
            self._skip -= 1
            return True
        return False


__all__ = ["Assessment", "Decision", "SwitchGuard", "assess"]
