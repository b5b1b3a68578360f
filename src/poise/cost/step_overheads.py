"""The work of a training step outside its MoE layers (NumPy only): the dense gradients'
all-reduce, the gathering of the step's routing counts, the global gradient norm with
clipping, and the optimizer step.

A device holds P parameters: the replicated (dense) ones, P_dense, and its expert slots, S per
MoE layer, P = P_dense + S L P_e (P_e = `ModelSpec.expert_params`; every rank steps all of its
slot tensors). With G = P_dense * g bytes of dense gradients (g = `ModelSpec.dtype_bytes`) and
the coefficients of `core.cluster.HostCosts`:

    T_allreduce = lat_ar + G / bw_ar                      measured between the devices, or
                = hierarchical all-reduce of G bytes on the cluster's links
                  (`poise.cost.collectives.hierarchical_allreduce_s`) when none was measured
    T_counts    = T_allreduce(L E 8 bytes)                the Balancer's gather of the step's
                                                          routing counts [L, E] (int64), a
                                                          latency-bound collective
    T_clip      = c_0 + c_1 P + T_allreduce(8 bytes)      squared norms per tensor, one scalar
                                                          all-reduce of the experts' squares,
                                                          scaling in place
    T_opt       = o_0 + o_1 P                             AdamW (Loshchilov & Hutter, ICLR 2019):
                                                          a fixed number of elementwise passes
                                                          over each parameter, its gradient and
                                                          its two moments
    T_outside   = T_allreduce + T_counts + T_clip + T_opt   seconds added to every step

The all-reduce is the linear alpha-beta model that Parm and FSMoE fit per collective (see
`poise.cost.collectives`); the clip and optimizer terms are the same linear start-up + per-unit form
(Hockney, Parallel Computing 1994) fitted by `poise calibrate` on the model's tensor count. All
devices hold the same P under expert parallelism, so no device is slower than another here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.spec import ModelSpec
from poise.cost.collectives import hierarchical_allreduce_s

NORM_BYTES = 8  # the clip's scalar all-reduce: one float64
OVERHEADS = ("grad_allreduce_s", "counts_s", "clip_s", "optimizer_s")


@dataclass(frozen=True)
class StepWork:
    """What one device does outside the layers each step: `dense_params` (replicated, their
    gradients all-reduced), `params` (all it steps: dense + its slots), `grad_bytes` per dense
    gradient value, `counts_bytes` of routing counts gathered (0: none)."""

    dense_params: int
    params: int
    grad_bytes: float
    counts_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.dense_params < 0 or self.params < self.dense_params or self.grad_bytes <= 0:
            raise ConfigError(
                f"need 0 <= dense_params <= params and grad_bytes > 0, got {self.dense_params}, "
                f"{self.params}, {self.grad_bytes}",
                field="dense_params",
            )

    @classmethod
    def of(cls, spec: ModelSpec, dense_params: int, slots_per_device: int) -> StepWork:
        """P = dense_params + slots_per_device * L * P_e for `spec`; L E int64 counts."""
        experts = slots_per_device * spec.moe_layers * spec.expert_params
        counts = 8.0 * spec.moe_layers * spec.experts
        return cls(
            int(dense_params), int(dense_params) + int(experts), float(spec.dtype_bytes), counts
        )


def allreduce_seconds(cluster: Cluster, nbytes: float) -> float:
    """Seconds for every device of `cluster` to all-reduce `nbytes` (module docstring): the
    measured fit when the cluster has one, else the hierarchical model on its links; 0 for one
    device or nothing to reduce."""
    if cluster.num_devices <= 1 or nbytes <= 0:
        return 0.0
    host = cluster.host
    if host.allreduce_lat_s is not None and host.allreduce_bw_Bps is not None:
        return host.allreduce_lat_s + nbytes / host.allreduce_bw_Bps
    return hierarchical_allreduce_s(cluster, np.arange(cluster.num_devices), float(nbytes))


def step_overheads(cluster: Cluster, work: StepWork) -> dict[str, float]:
    """`OVERHEADS` seconds per step (module docstring)."""
    host = cluster.host
    return {
        "grad_allreduce_s": allreduce_seconds(cluster, work.dense_params * work.grad_bytes),
        "counts_s": allreduce_seconds(cluster, work.counts_bytes),
        "clip_s": host.clip_s
        + host.clip_s_per_param * work.params
        + allreduce_seconds(cluster, NORM_BYTES),
        "optimizer_s": host.optimizer_s + host.optimizer_s_per_param * work.params,
    }


__all__ = ["NORM_BYTES", "OVERHEADS", "StepWork", "allreduce_seconds", "step_overheads"]
