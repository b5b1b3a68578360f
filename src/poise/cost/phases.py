"""The phases of one training step's MoE work, each in seconds per layer `[L]` (the slowest
device sets each layer's figure). `poise.cost.model` fills them; `poise.cost.schedule` combines
them into step time."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass
class PhaseTimes:
    """Seconds per phase, each `[L]` (slowest device per layer)."""

    dispatch_s: np.ndarray
    combine_s: np.ndarray
    expert_fwd_s: np.ndarray
    expert_bwd_s: np.ndarray
    non_moe_fwd_s: np.ndarray
    non_moe_bwd_s: np.ndarray
    trans_s: np.ndarray
    agg_s: np.ndarray
    migrate_s: np.ndarray
    dispatch_host_fwd_s: np.ndarray  # the dispatcher's host work (`poise.cost.host`)
    dispatch_host_bwd_s: np.ndarray

    @classmethod
    def from_parts(
        cls,
        a2a: np.ndarray,
        fec: np.ndarray,
        fnec: np.ndarray,
        trans: np.ndarray,
        migrate: np.ndarray,
        bnec: np.ndarray | None = None,
    ) -> PhaseTimes:
        """The step's phases from one all-to-all, forward compute, Trans and migration: combine
        mirrors dispatch, backward compute is twice forward (the non-MoE part too unless `bnec`
        is given), Agg mirrors Trans, no dispatcher host work (`CostModel.complete` adds it)."""
        none = np.zeros_like(np.asarray(fec, dtype=np.float64))
        return cls(
            dispatch_s=a2a,
            combine_s=a2a.copy(),
            expert_fwd_s=fec,
            expert_bwd_s=2.0 * fec,
            non_moe_fwd_s=fnec,
            non_moe_bwd_s=2.0 * fnec if bnec is None else bnec,
            trans_s=trans,
            agg_s=trans.copy(),
            migrate_s=migrate,
            dispatch_host_fwd_s=none,
            dispatch_host_bwd_s=none.copy(),
        )

    def as_dict(self) -> dict[str, float]:
        """Totals over layers, seconds."""
        return {k: float(np.sum(v)) for k, v in self.__dict__.items()}


PHASE_NAMES = [f.name for f in fields(PhaseTimes)]  # the phases, in field order
