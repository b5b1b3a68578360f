"""Statistics of a routing trace: how skewed, how fast it drifts, how unbalanced a static
placement is.

All measures work on the expert loads `load[s, l, e] = sum_d counts[s, l, d, e]` (`[S, L, E]`).

- Skew, per step and layer, averaged over steps for each layer:
  `max_over_mean = max_e load / mean_e load`; `gini` = Gini coefficient of the loads
  (0: all equal, (E-1)/E: one expert takes everything); `top_share = max_e load / sum_e load`.
- Drift at lag k (in training iterations, by the trace's recorded `step_ids`): the mean over
  layers and row pairs of the total variation distance `TV(p_s, p_t) = 0.5 * sum_e |p_s[e] -
  p_t[e]|` between normalised load distributions `p_s = load[s, l] / sum_e load[s, l]` of rows
  recorded k iterations apart; `None` when the trace has no such pair. A trace sampled every
  1,000 iterations has no lag-1 pair; its consecutive rows are reported with their gap.
- Device imbalance of the static placement: experts in contiguous blocks, expert e on device
  `floor(e * D / E)`; `max_d / mean_d` of the device loads per step and layer, averaged over
  steps. `D` is the trace's device count unless `devices` says otherwise.

Steps or layers with no assignments at all have no distribution; they are left out of the
averages (a measure with nothing to average is `None`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.table import Table

from poise.core.errors import ConfigError
from poise.trace.trace import Trace

DRIFT_LAGS = (1, 10, 100)


def gini(x: np.ndarray) -> np.ndarray:
    """Gini coefficient over the last axis of non-negative loads `[..., E]` -> `[...]`.

    `gini = sum_i (2i - E - 1) x_(i) / (E * sum x)` with `x_(1) <= ... <= x_(E)`; NaN where the
    loads sum to 0. Example: `gini([0, 0, 0, 1]) = 0.75`, `gini([1, 1, 1, 1]) = 0`."""
    x = np.sort(np.asarray(x, dtype=np.float64), axis=-1)
    n = x.shape[-1]
    coef = 2.0 * np.arange(1, n + 1) - n - 1  # 2i - E - 1
    total = x.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (x * coef).sum(axis=-1) / (n * total), np.nan)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def distributions(load: np.ndarray) -> np.ndarray:
    """Normalise loads `[..., E]` to probability rows; all-zero rows become NaN."""
    load = np.asarray(load, dtype=np.float64)
    return _ratio(load, load.sum(axis=-1, keepdims=True))


def tv_distance(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Total variation distance `0.5 * sum_e |p - q|` over the last axis."""
    return 0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum(axis=-1)


def drift_at_lag(load: np.ndarray, lag: int, step_ids: np.ndarray | None = None) -> float | None:
    """Mean TV distance between rows `lag` apart of the normalised loads `[S, L, E]`; `None`
    if no pair is `lag` apart or none has traffic on both sides. With `step_ids` (the
    recorded iteration of each row, increasing), rows are paired by iteration: rows recorded
    at iterations i and i + lag, so a trace of iterations 1, 1001, 5001 has no lag-1 pair."""
    if lag < 1:
        raise ConfigError(f"must be >= 1, got {lag}", field="lag")
    if step_ids is None:
        if lag >= load.shape[0]:
            return None
        p = distributions(load)
        return _mean(tv_distance(p[lag:], p[:-lag]))
    ids = np.asarray(step_ids, dtype=np.int64)
    later = np.searchsorted(ids, ids + lag)
    ok = later < len(ids)
    ok[ok] = ids[later[ok]] == ids[ok] + lag
    if not ok.any():
        return None
    p = distributions(load)
    return _mean(tv_distance(p[later[ok]], p[ok]))


def consecutive_drift(load: np.ndarray, step_ids: np.ndarray) -> dict[str, Any] | None:
    """Mean TV distance between consecutive rows, with the range of iteration gaps between
    them (`gap_min`, `gap_max`); `None` for a one-row trace."""
    if load.shape[0] < 2:
        return None
    gaps = np.diff(np.asarray(step_ids, dtype=np.int64))
    p = distributions(load)
    return {
        "tv": _mean(tv_distance(p[1:], p[:-1])),
        "gap_min": int(gaps.min()),
        "gap_max": int(gaps.max()),
    }


def static_device_of(experts: int, devices: int) -> np.ndarray:
    """`[E]` device of each expert in the contiguous-block static placement: `floor(e * D / E)`."""
    return (np.arange(experts) * devices) // experts


def device_loads(load: np.ndarray, device_of: np.ndarray, devices: int) -> np.ndarray:
    """Sum expert loads `[S, L, E]` onto devices -> `[S, L, D]`. `device_of` is `[E]` or
    `[L, E]` (a placement per layer)."""
    S, L, E = load.shape
    dev = np.broadcast_to(np.asarray(device_of), (L, E))
    out = np.zeros((S, L, devices))
    for layer in range(L):  # O(S * E) per layer, whatever the device count
        np.add.at(out[:, layer], (slice(None), dev[layer]), load[:, layer])
    return out


def _mean(x: np.ndarray) -> float | None:
    x = np.asarray(x, dtype=np.float64)
    finite = x[np.isfinite(x)]
    return float(finite.mean()) if finite.size else None


def _per_layer(x: np.ndarray) -> list[float | None]:
    """`[S, L]` -> mean over steps for each layer (NaNs skipped)."""
    return [_mean(x[:, layer]) for layer in range(x.shape[1])]


def _summary(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    return {
        "mean": float(np.mean(vals)) if vals else None,
        "max": float(np.max(vals)) if vals else None,
    }


def _resolve_devices(
    trace: Trace,
    devices: int | Sequence[int] | np.ndarray | None,
) -> tuple[np.ndarray, int]:
    E = trace.experts
    if devices is None:
        return static_device_of(E, trace.devices), trace.devices
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if devices < 1:
            raise ConfigError(f"must be >= 1, got {devices}", field="devices")
        return static_device_of(E, int(devices)), int(devices)
    dev = np.asarray(devices)
    if dev.shape not in ((E,), (trace.layers, E)) or not np.issubdtype(dev.dtype, np.integer):
        raise ConfigError(
            f"must be a device count or an integer array [E] or [L, E] "
            f"(E={E}, L={trace.layers}), got shape {dev.shape}",
            field="devices",
        )
    if dev.size and dev.min() < 0:
        raise ConfigError("device ids must be >= 0", field="devices")
    return dev, int(dev.max()) + 1


def trace_stats(
    trace: Trace,
    devices: int | Sequence[int] | np.ndarray | None = None,
) -> dict[str, Any]:
    """Skew, drift and static-placement device imbalance of a trace, as a JSON-ready dict.

    `devices`: `None` (contiguous blocks over the trace's `D` devices), a device count
    (contiguous blocks over that many devices) or an explicit expert-to-device map `[E]` or
    `[L, E]`. Keys: `name`, `shape` (`[S, L, D, E]`), `top_k`, `tokens_per_device`,
    `total_assignments`, `skew` (`max_over_mean`, `gini`, `top_share`: per-layer lists of
    step means, and `summary` with their mean and max over layers), `drift`
    (`{lag: mean TV or None}` for lags 1, 10, 100), `device_imbalance` (`devices`,
    `per_layer`, `mean`, `max`)."""
    load = trace.expert_load().astype(np.float64)  # [S, L, E]
    total = load.sum(axis=-1)  # [S, L]
    mean = total / trace.experts
    per_step = {
        "max_over_mean": _ratio(load.max(axis=-1), mean),
        "gini": gini(load),
        "top_share": _ratio(load.max(axis=-1), total),
    }
    skew: dict[str, Any] = {key: _per_layer(v) for key, v in per_step.items()}
    skew["summary"] = {key: _summary(skew[key]) for key in per_step}

    device_of, D = _resolve_devices(trace, devices)
    dload = device_loads(load, device_of, D)  # [S, L, D]
    imbalance = _per_layer(_ratio(dload.max(axis=-1), dload.mean(axis=-1)))

    return {
        "name": trace.name,
        "shape": [trace.steps, trace.layers, trace.devices, trace.experts],
        "step_ids": [int(trace.step_ids[0]), int(trace.step_ids[-1])],
        "top_k": trace.top_k,
        "tokens_per_device": trace.tokens_per_device,
        "total_assignments": int(trace.counts.sum()),
        "skew": skew,
        "drift": {lag: drift_at_lag(load, lag, trace.step_ids) for lag in DRIFT_LAGS},
        "drift_consecutive": consecutive_drift(load, trace.step_ids),
        "device_imbalance": {"devices": D, "per_layer": imbalance, **_summary(imbalance)},
    }


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def stats_table(stats: dict[str, Any]) -> Table:
    """A rich table of `trace_stats` output: one row per layer and a summary row."""
    S, L, D, E = stats["shape"]
    skew, dev = stats["skew"], stats["device_imbalance"]
    drift = stats["drift"]
    drift_text = ", ".join(
        f"lag {lag}: {_fmt(drift.get(lag, drift.get(str(lag))), 3)}" for lag in DRIFT_LAGS
    )
    drift_text = f"{drift_text} iterations"
    rows = stats.get("drift_consecutive")
    if rows and (rows["gap_min"], rows["gap_max"]) != (1, 1):
        gap = (
            str(rows["gap_min"])
            if rows["gap_min"] == rows["gap_max"]
            else f"{rows['gap_min']}-{rows['gap_max']}"
        )
        drift_text += f"; consecutive rows ({gap} iterations apart): {_fmt(rows['tv'], 3)}"
    table = Table(
        title=f"{stats['name']}: {S} steps x {L} layers x {D} devices x {E} experts, "
        f"top-{stats['top_k']}, {stats['tokens_per_device']} tokens/device",
        caption=f"drift (mean TV): {drift_text}\ndevice max/mean: static contiguous placement on "
        f"{dev['devices']} devices",
    )
    # numbers fold on a narrow terminal instead of being cut with '…'
    for col in ("layer", "max/mean", "Gini", "top share", "device max/mean"):
        table.add_column(col, justify="right", overflow="fold")
    for layer in range(L):
        table.add_row(
            str(layer),
            _fmt(skew["max_over_mean"][layer]),
            _fmt(skew["gini"][layer], 3),
            _fmt(skew["top_share"][layer], 3),
            _fmt(dev["per_layer"][layer]),
        )
    summary = skew["summary"]
    table.add_section()
    table.add_row(
        "mean",
        _fmt(summary["max_over_mean"]["mean"]),
        _fmt(summary["gini"]["mean"], 3),
        _fmt(summary["top_share"]["mean"], 3),
        _fmt(dev["mean"]),
    )
    table.add_row(
        "max",
        _fmt(summary["max_over_mean"]["max"]),
        _fmt(summary["gini"]["max"], 3),
        _fmt(summary["top_share"]["max"], 3),
        _fmt(dev["max"]),
    )
    return table
