"""Expert load per MoE layer for one training step: what `metrics.jsonl`, TensorBoard and the
console show.

From the step's routing counts `counts[L, D, E]` (assignments each source rank's router sent to
each expert, before drops), the plan in force and the dropped assignments, per layer `l`:

- `tokens_per_expert[l][e] = sum_d counts[l, d, e]` (token-expert assignments, all ranks);
- `expert_max_over_mean[l] = max_e n_e / mean_e n_e` (1.0 for an idle layer);
- `cv[l] = std_e n_e / mean_e n_e` (population standard deviation; 0.0 for an idle layer), the
  coefficient of variation that Megatron-Core, DeepSpeed and torchtitan users read expert
  imbalance by;
- `dropped_tokens[l]`: assignments the router's capacity dropped on all ranks (0 when dropless);
- `replicas[l]`: copies beyond the homes, `sum_{d,e} copies[l, d, e] - E`.

Tokens per device (`device_tokens[L][D]`, after the plan's assignment) and the device max/mean
come from `poise.runtime.stats.StepStats` beside these. `worst_layer` picks the layer with the
largest CV (ties: the first), the one the console shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ExpertLoad:
    """One step's expert load. `tokens_per_expert [L, E]` int64; `expert_max_over_mean [L]`,
    `cv [L]` float64; `dropped_tokens [L]`, `replicas [L]` int64."""

    tokens_per_expert: np.ndarray
    expert_max_over_mean: np.ndarray
    cv: np.ndarray
    dropped_tokens: np.ndarray
    replicas: np.ndarray

    @property
    def worst_layer(self) -> int:
        """Index of the layer with the largest CV (0 without layers)."""
        return int(np.argmax(self.cv)) if self.cv.size else 0

    def as_record(self) -> dict[str, Any]:
        """JSON-ready fields for a `metrics.jsonl` line."""
        return {
            "tokens_per_expert": self.tokens_per_expert.tolist(),
            "expert_max_over_mean": [float(x) for x in self.expert_max_over_mean],
            "cv": [float(x) for x in self.cv],
            "dropped_tokens": [int(x) for x in self.dropped_tokens],
            "replicas": [int(x) for x in self.replicas],
            "worst_layer": self.worst_layer,
        }


def expert_load(
    counts: np.ndarray, copies: np.ndarray | None = None, dropped: np.ndarray | None = None
) -> ExpertLoad:
    """Expert load of `counts[L, D, E]` (or `[L, E]`, already summed over sources).
    `copies[L, D, E]`: the placement in force (None: homes only, no replicas); `dropped[L]`:
    dropped assignments per layer (None: dropless, all zero)."""
    c = np.asarray(counts)
    if c.ndim == 3:
        c = c.sum(axis=1)
    if c.ndim != 2:
        raise ValueError(f"counts must be [L, D, E] or [L, E], got shape {np.shape(counts)}")
    per_expert = c.astype(np.int64)
    L, E = per_expert.shape
    n = per_expert.astype(np.float64)
    mean = n.mean(axis=1) if E else np.zeros(L)
    safe = np.where(mean > 0, mean, 1.0)
    ratio = np.where(mean > 0, n.max(axis=1, initial=0.0) / safe, 1.0)
    cv = np.where(mean > 0, n.std(axis=1) / safe, 0.0) if E else np.zeros(L)
    drops = np.zeros(L, np.int64) if dropped is None else np.asarray(dropped, np.int64).reshape(L)
    if copies is None:
        replicas = np.zeros(L, np.int64)
    else:
        replicas = np.asarray(copies, np.int64).sum(axis=(1, 2)) - E
    return ExpertLoad(per_expert, ratio, cv, drops, replicas)


__all__ = ["ExpertLoad", "expert_load"]
