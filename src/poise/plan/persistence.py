"""How long a load pattern has held, and so how many steps a plan made for it should be priced over.

A plan pays back a one-off migration (homes moved with their optimizer moments) over the steps
it serves, and those are as many as the load pattern it was made for lasts. A fixed horizon of
one re-planning interval prices a home move as if the pattern ended at the next re-plan: on a
stationary trace a re-placement that would pay for the rest of the run then loses to replicas
that cost Trans and Agg every step (`benchmarks/ep_step.py`, zipf-1.2, the first plan: four
replicas and one home moved with 5 steps of horizon, 58 homes moved and no replica from 20 on,
175 against 165 ms a modelled step), while during a router's collapse early in training the
pattern does not last one interval.

The pattern's age is read from the history the plan is made from. With `x_s [L, E]` the tokens
each expert received at step s (summed over sources) and `f [L, E]` the forecast:

    delta_s = sum |x_s - f| / sum f                 (the step's distance from the forecast)
    tau     = median over the newest `recent` steps of sum |x_s - x_(s-1)| / sum f
    age     = the newest consecutive steps with delta_s <= BAND * tau

and the horizon is `max(base, age)`: the pattern has held `age` steps, and a process observed
to have lasted A steps is, with no other knowledge, as likely to end before A more as after
(the Copernican or Lindy estimate: the median remaining life of something whose age is A and
whose lifetime is unknown is A). `tau` is the step-to-step spread of the newest steps, the
sampling noise of routing that has not moved: two draws from one distribution differ by about
sqrt(2) times a draw's distance from its mean, so a step of the same pattern lies within about
`tau` of a forecast made from its neighbours (the spread of the newest steps about the forecast
itself would not do: the forecast is fitted to them, and steps it was not fitted to lie
further). `BAND` = 2 keeps a step in the pattern while it lies within twice that spread;
routing that has moved lies further. An exactly stationary trace (tau = 0) has every step at
distance 0 and holds for the whole history; the horizon never falls below `base`, the
re-planning interval the horizon was before.

The history is a window (the newest 100 steps, live and simulated), so an age read from it
alone stops at the window's length: on a pattern that holds for thousands of steps the horizon
stayed at 100, and a re-placement of homes that pays back only over more steps than that was
never made (on `benchmarks/ep_step.py`'s stationary zipf-1.2 trace, `auto` kept 4 replicas and
their Trans and Agg, 2% of each step, where moving the homes instead paid back in about 100
steps). Where the whole window held, the pattern had held before it too, as long as the last
plan's age says it had: with that plan made at step s' from a pattern aged A', and this
window of W steps ending at step s overlapping it,

    held_before = max(0, A' + (s - s') - W)          (`carried_age`)

and the age is W + held_before (`pattern_age`'s `held_before`). The two windows share their
overlapping steps, each within the band of both forecasts, so the pattern they describe is one.
The caller keeps (s', A') from plan to plan: the live Balancer from `auto`'s `pattern_age` note,
the simulator from the same function on the same inputs.
"""

from __future__ import annotations

import numpy as np

from poise.core.errors import ConfigError

BAND = 2.0


def pattern_age(
    history: np.ndarray, forecast: np.ndarray, recent: int, held_before: int = 0
) -> int:
    """Steps the pattern of `forecast[L, E]` has held in `history[S, L, E]` (oldest first):
    the newest consecutive steps within `BAND` times the step-to-step spread of the newest
    `recent` (module docstring), plus `held_before` where all S held (the steps it had held
    before the window, `carried_age`). 0 for an empty history or a forecast of no tokens."""
    history = np.asarray(history, dtype=np.float64)
    forecast = np.asarray(forecast, dtype=np.float64)
    if history.ndim != 3 or history.shape[1:] != forecast.shape:
        raise ConfigError(
            f"history must be [S, L, E] and forecast [L, E], got {history.shape} and "
            f"{forecast.shape}",
            field="history",
        )
    if recent < 1:
        raise ConfigError(f"must be >= 1, got {recent}", field="recent")
    if held_before < 0:
        raise ConfigError(f"must be >= 0, got {held_before}", field="held_before")
    total = float(forecast.sum())
    if len(history) == 0 or total <= 0:
        return 0
    delta = np.abs(history - forecast).sum(axis=(1, 2)) / total  # [S]
    if len(history) < 2:
        return int(delta[0] <= 0.0) * (1 + held_before)
    steps = np.abs(np.diff(history, axis=0)).sum(axis=(1, 2)) / total  # [S - 1]
    tau = float(np.median(steps[-recent:]))
    within = delta <= BAND * tau
    outside = np.flatnonzero(~within)
    return int(len(delta) - 1 - outside[-1]) if outside.size else len(delta) + held_before


def carried_age(previous: tuple[int, int] | None, step: int, window: int) -> int:
    """Steps the pattern had held before a window of `window` steps ending at `step`, from
    the last plan's `previous = (step, age)` (module docstring): `max(0, age + (step - s') -
    window)`; 0 without a last plan, or where the window begins after its step (no overlap)."""
    if previous is None:
        return 0
    made_at, age = previous
    if made_at < step - window + 1 or made_at > step:
        return 0
    return max(0, int(age) + (step - made_at) - int(window))


def horizon_for_age(age: int, base: int) -> int:
    """`max(base, age)`: the steps a plan for a pattern of `age` steps is priced over, never
    fewer than the re-planning interval `base` (module docstring)."""
    if base < 1:
        raise ConfigError(f"must be >= 1, got {base}", field="horizon")
    return max(int(base), int(age))


def persistence_horizon(
    history: np.ndarray, forecast: np.ndarray, base: int, held_before: int = 0
) -> int:
    """`horizon_for_age(pattern_age(history, forecast, recent=base, held_before), base)`: the
    steps a plan for `forecast[L, E]` is priced over (module docstring)."""
    if base < 1:
        raise ConfigError(f"must be >= 1, got {base}", field="horizon")
    return horizon_for_age(pattern_age(history, forecast, base, held_before), base)


__all__ = ["BAND", "carried_age", "horizon_for_age", "pattern_age", "persistence_horizon"]
