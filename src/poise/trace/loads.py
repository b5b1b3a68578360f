"""Turning traces into the loads a planner sees, on a cluster of a given size.

A trace records `[S, L, D_trace, E]`; a cluster has D devices. When D is a multiple of D_trace
each source row is split evenly over D / D_trace devices (largest remainder keeps integers
exact); when D_trace is a multiple of D, groups of sources are summed. Anything else is refused.
"""

from __future__ import annotations

import numpy as np

from poise.core.errors import ConfigError, TraceError
from poise.core.spec import ModelSpec
from poise.trace.trace import Trace


def fit_devices(counts: np.ndarray, devices: int, source: str = "trace") -> np.ndarray:
    """`[..., D_trace, E]` -> `[..., devices, E]`, conserving every expert's total exactly."""
    counts = np.asarray(counts)
    d_trace = counts.shape[-2]
    if d_trace == devices:
        return counts
    if d_trace % devices == 0:
        shape = (*counts.shape[:-2], devices, d_trace // devices, counts.shape[-1])
        return counts.reshape(shape).sum(axis=-2)
    if devices % d_trace == 0:
        k = devices // d_trace
        base = counts // k
        rest = counts - base * k  # 0 <= rest < k: the first `rest` parts get one more
        parts = base[..., None, :] + (np.arange(k)[:, None] < rest[..., None, :])
        return parts.reshape(*counts.shape[:-2], devices, counts.shape[-1])
    raise ConfigError(
        f"trace has {d_trace} source devices and the cluster {devices}; one must divide the other",
        source=source,
        field="devices",
    )


def spec_for_trace(spec: ModelSpec, trace: Trace, *, explicit: bool, source: str) -> ModelSpec:
    """The model shape to plan `trace` with. A model the user named must agree with the trace on
    experts; a default model takes the trace's experts, top-k and layer count."""
    if explicit and spec.experts != trace.experts:
        raise ConfigError(
            f"model {spec.name!r} has {spec.experts} experts but the trace has {trace.experts}",
            source=source,
            field="experts",
        )
    return spec.with_(experts=trace.experts, top_k=trace.top_k, moe_layers=trace.layers)


def require_tokens(trace: Trace, source: str) -> None:
    """Refuse an all-zero trace: it routes no tokens, so its statistics (tokens per device,
    skew) and every price of it would be nonsense."""
    if not trace.counts.any():
        raise TraceError(
            "every count is zero: the trace routes no tokens", source=source, field="counts"
        )
