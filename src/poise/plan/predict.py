"""Load predictors: next step's loads from the recent history (loads drift slowly; Pro-Prophet).

Each predictor maps `history[S, L, D, E]` (oldest first, S >= 1) to a prediction `[L, D, E]`:

- `last`: the latest observation;
- `window(w)`: the mean of the last w observations;
- `ema(alpha)`: exponential moving average, p_t = alpha * x_t + (1 - alpha) * p_{t-1}.

`prediction_error` replays a trace and reports the mean relative L1 error of each predictor,
sum |pred - actual| / sum actual over the steps it could predict.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.errors import ConfigError


@dataclass(frozen=True)
class Predictor:
    """`kind`: last, window or ema; `window` (steps) and `alpha` (EMA weight of the newest)."""

    kind: str = "ema"
    window: int = 10
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("last", "window", "ema"):
            raise ConfigError("must be last, window or ema", source=self.kind, field="predictor")
        if self.window < 1:
            raise ConfigError("must be >= 1", source=str(self.window), field="predictor.window")
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError("must be in (0, 1]", source=str(self.alpha), field="predictor.alpha")

    @property
    def name(self) -> str:
        return {"last": "last", "window": f"window({self.window})", "ema": f"ema({self.alpha:g})"}[
            self.kind
        ]

    def predict(self, history: np.ndarray) -> np.ndarray:
        """`history[S, L, D, E]` -> `[L, D, E]` float."""
        history = np.asarray(history, dtype=np.float64)
        if history.ndim != 4 or history.shape[0] == 0:
            raise ConfigError(
                f"history must be [S >= 1, L, D, E], got {history.shape}",
                source=self.name,
                field="history",
            )
        if self.kind == "last":
            return history[-1].copy()
        if self.kind == "window":
            return history[-self.window :].mean(axis=0)
        return self.predict_all(history)[-1]

    def predict_all(self, history: np.ndarray) -> np.ndarray:
        """`[S, L, D, E]` -> `[S, L, D, E]`: row t is the prediction made after seeing rows <= t,
        i.e. the forecast for step t + 1. One pass, for replaying whole traces."""
        x = np.asarray(history, dtype=np.float64)
        if self.kind == "last":
            return x.copy()
        if self.kind == "window":
            csum = np.cumsum(x, axis=0)
            out = csum.copy()
            w = self.window
            out[w:] = csum[w:] - csum[:-w]
            counts = np.minimum(np.arange(1, len(x) + 1), w).reshape(-1, 1, 1, 1)
            return out / counts
        out = np.empty_like(x)
        acc = x[0].copy()
        out[0] = acc
        for t in range(1, len(x)):
            acc = self.alpha * x[t] + (1.0 - self.alpha) * acc
            out[t] = acc
        return out


class OnlineForecast:
    """A predictor fed one step at a time (memory: one step, or `window` steps), for replays too
    large to hold whole: `update(x[L, D, E])` after each step, `forecast()` for the next one.
    Equals `Predictor.predict_all` row by row."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor
        self._recent: list[np.ndarray] = []
        self._acc: np.ndarray | None = None
        self.seen = 0

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64)
        self.seen += 1
        kind = self.predictor.kind
        if kind == "ema":
            a = self.predictor.alpha
            self._acc = x.copy() if self._acc is None else a * x + (1.0 - a) * self._acc
        else:
            keep = 1 if kind == "last" else self.predictor.window
            self._recent = [*self._recent[-(keep - 1) :], x] if keep > 1 else [x]

    def forecast(self) -> np.ndarray:
        """`[L, D, E]` the prediction for the next step; needs at least one update."""
        if self.seen == 0:
            raise ConfigError("no step observed yet", source=self.predictor.name, field="history")
        if self.predictor.kind == "ema":
            assert self._acc is not None
            return self._acc
        if self.predictor.kind == "last":
            return self._recent[-1]
        return np.mean(self._recent, axis=0)


def parse_predictor(text: str) -> Predictor:
    """`last`, `window`, `window:20`, `ema`, `ema:0.3`."""
    kind, _, arg = text.partition(":")
    try:
        if kind == "window":
            return Predictor("window", window=int(arg) if arg else 10)
        if kind == "ema":
            return Predictor("ema", alpha=float(arg) if arg else 0.5)
    except ValueError:
        raise ConfigError(
            f"bad predictor argument {arg!r}", source=text, field="predictor"
        ) from None
    return Predictor(kind)


def prediction_error(counts: np.ndarray, predictor: Predictor) -> float:
    """Mean relative L1 error of one-step-ahead predictions over `counts[S, L, D, E]` (S >= 2)."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.shape[0] < 2:
        raise ConfigError(
            "need at least 2 steps to measure prediction error",
            source=predictor.name,
            field="steps",
        )
    pred = predictor.predict_all(counts)[:-1]
    actual = counts[1:]
    total = actual.sum()
    return float(np.abs(pred - actual).sum() / total) if total > 0 else 0.0
