"""What a live Balancer learned about its run, as plain values a checkpoint keeps.

A resumed run re-plans from the saved load window as the first would (`poise.train.checkpoint`);
this is the rest of what its decisions depend on, beyond the loads:

- `guard`: the do-no-harm guard's state (`SwitchGuard.state`): the switches' measured price
  (`k_switch`, `relay_s`), the trust a refutation by the paired clock left and the re-plans
  until its re-trial, the backoffs still to run, the promise of the plan in force;
- `fit`: the self-calibrated constants (`selfcal.Fit`), the centre of the next fit and what the
  plans are priced with until it (`selfcal.cluster_of`);
- `lag`: the steps from a request to its decision, adapted to the planner's measured time;
- `replicas_timed`: the paired clock has timed a plan with replicas in this run (`leader`,
  rule 4);
- `pattern`: `(requested at, age)` of the load pattern the last plan saw
  (`persistence.carried_age`);
- `replan_phase`: the re-plans' cadence, shifted by an `unsettled` refusal (`Balancer(recheck=
  ...)`; absent from checkpoints written before it was kept: 0).

Beside them the checkpoint keeps the last candidate, the plan the next job from the static
layout backtests on the window's steps since it (`poise.train.checkpoint`).

Without them a resumed run starts as a fresh one: it trusts a model the clock had refuted,
prices switches at the prior, and re-learns its backoffs, so a run resumed after a refutation
pays for the trial the refutation had spared it. The step times behind them (the records the
fit and the verdicts read) are not kept: they were measured by the processes that ended, and
the resumed run measures its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from poise.core.errors import ConfigError
from poise.runtime.selfcal import fit as selfcal

KEYS = ("guard", "fit", "lag", "replicas_timed", "pattern", "replan_phase")
OPTIONAL = ("replan_phase",)  # written since it was kept; older checkpoints lack it


def learned_state(balancer: Any) -> dict[str, Any]:
    """The state of `balancer` (a `poise.runtime.balancer.Balancer`) listed in the module
    docstring, in plain Python values."""
    pattern = balancer._pattern
    return {
        "guard": balancer.guard.state(),
        "fit": balancer.fit.as_dict(),
        "lag": int(balancer.lag),
        "replicas_timed": bool(balancer._replicas_timed),
        "pattern": None if pattern is None else [int(pattern[0]), int(pattern[1])],
        "replan_phase": int(balancer.replan_phase),
    }


def restore_learned(balancer: Any, state: Mapping[str, Any], source: str = "checkpoint") -> None:
    """Give `balancer` back the `learned_state` of the run it resumes (the same configuration
    and world): checked in full before any of it is set, one `ConfigError` naming `source` and
    the entry for a malformed one. The fitted cluster is re-derived from the fit on this
    balancer's prior; the lag is at least this run's `plan_lag` (`planner.adoption_lag`; left
    at `plan_lag` 0 where that is 0)."""
    if not set(KEYS) - set(OPTIONAL) <= set(state) <= set(KEYS):
        raise ConfigError(
            f"balancer state: expected {list(KEYS)}, got {sorted(state)}",
            source=source,
            field="balancer.learned",
        )
    fit = selfcal.Fit.from_dict(state["fit"], source=source)
    lag, timed, pattern = state["lag"], state["replicas_timed"], state["pattern"]
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ConfigError(f"not a step count: {lag!r}", source=source, field="balancer.lag")
    if not isinstance(timed, bool):
        raise ConfigError(f"not a bool: {timed!r}", source=source, field="balancer.replicas_timed")
    if pattern is not None and not (
        isinstance(pattern, (list, tuple))
        and len(pattern) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pattern)
    ):
        raise ConfigError(f"not (step, age): {pattern!r}", source=source, field="balancer.pattern")
    phase = state.get("replan_phase", 0)
    if isinstance(phase, bool) or not isinstance(phase, int) or phase < 0:
        raise ConfigError(
            f"not a step count: {phase!r}", source=source, field="balancer.replan_phase"
        )
    balancer.guard.restore(state["guard"], source=source)
    balancer.fit = fit
    balancer.fitted_cluster = selfcal.cluster_of(balancer.cluster, fit)
    if balancer.plan_lag > 0:  # as `_decide` adapts it
        balancer.lag = max(balancer.plan_lag, lag)
    balancer._replicas_timed = timed
    balancer._pattern = None if pattern is None else (int(pattern[0]), int(pattern[1]))
    balancer.replan_phase = phase % balancer.replan_every


__all__ = ["KEYS", "learned_state", "restore_learned"]
