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
"""

from __future__ import annotations

import numpy as np

from poise.core.errors import ConfigError

BAND = 2.0


def pattern_age(history: np.ndarray, forecast: np.ndarray, recent: int) -> int:
    """Steps the pattern of `forecast[L, E]` has held in `history[S, L, E]` (oldest first):
    the newest consecutive steps within `BAND` times the step-to-step spread of the newest
    `recent` (module docstring). 0 for an empty history or a forecast of no tokens."""
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
    total = float(forecast.sum())
    if len(history) == 0 or total <= 0:
        return 0
    delta = np.abs(history - forecast).sum(axis=(1, 2)) / total  # [S]
    if len(history) < 2:
        return int(delta[0] <= 0.0)
    steps = np.abs(np.diff(history, axis=0)).sum(axis=(1, 2)) / total  # [S - 1]
    tau = float(np.median(steps[-recent:]))
    within = delta <= BAND * tau
    outside = np.flatnonzero(~within)
    return int(len(delta) - 1 - outside[-1]) if outside.size else len(delta)


def persistence_horizon(history: np.ndarray, forecast: np.ndarray, base: int) -> int:
    """`max(base, pattern_age(history, forecast, recent=base))`: the steps a plan for
    `forecast[L, E]` is priced over (module docstring)."""
    if base < 1:
        raise ConfigError(f"must be >= 1, got {base}", field="horizon")
    return max(int(base), pattern_age(history, forecast, base))


__all__ = ["BAND", "pattern_age", "persistence_horizon"]
