"""Self-calibration: the cost model's compute and network constants fitted to this run.

Each step the Balancer measures its layers' forward phases on every rank and keeps, per step,
the slowest rank's seconds (gathered with the counts, so every rank holds the same figures):
`experts_s` (the expert GEMMs) and `a2a_s` (dispatch + combine: the token all-to-all with its
host work). Priced on the same steps' counts under the plan that ran them, the cost model
predicts `expert_fwd_s` and `dispatch_s + combine_s` (summed over layers). Two scales relate
them, each a least-squares fit through the origin over a window of steps, pulled towards 1
(the cluster preset) by a prior worth `prior_rows` steps of the mean prediction:

    k = (sum_s m_s p_s + w P^2) / (sum_s p_s^2 + w P^2),   P = mean_s p_s,  w = prior_rows

`k_compute` > 1: GEMMs are slower than the preset says, so the fitted cluster's peak FLOP/s are
the preset's divided by `k_compute`; `k_network` likewise divides every link's bandwidth and
multiplies its latency. Plans are then priced, and chosen, with the fitted cluster.
The fit is NumPy only: it runs on the background planner's thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.cluster import Cluster, Link, PeakFlops
from poise.core.placement import Plan
from poise.cost.model import CostModel

# Columns of the Balancer's gathered measurement rows (seconds, slowest rank): the wall time
# between two step boundaries, the boundary itself (Trans launch, migration, waiting for the
# planner), and the layers' forward phases.
MEASURED = ("period_s", "boundary_s", "gate_s", "a2a_s", "experts_s")
PERIOD, BOUNDARY, GATE, A2A, EXPERTS = range(len(MEASURED))
SCALE_LIMITS = (1e-3, 1e3)  # a fit outside these is a measurement gone wrong: clipped


@dataclass(frozen=True)
class Fit:
    """Fitted scales (`k_compute`, `k_network`, 1.0 = the preset), the steps they came from,
    and the fitted figures: large-GEMM FLOP/s in the model's compute dtype, intra-node
    bandwidth."""

    k_compute: float = 1.0
    k_network: float = 1.0
    rows: int = 0
    gemm_flops: float = 0.0
    intra_bw_Bps: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predicted_phases(cost: CostModel, plan: Plan, counts: np.ndarray) -> np.ndarray:
    """Model seconds per step `[S, 2]`: (expert forward, dispatch + combine), summed over
    layers, of `plan` on `counts[S, L, D, E]`."""
    pricer = cost.pricer(plan.placement, plan.assignment)
    out = np.zeros((len(counts), 2))
    for s, row in enumerate(counts):
        phases, _ = pricer.phases(row.astype(np.float64))
        out[s] = (phases.expert_fwd_s.sum(), (phases.dispatch_s + phases.combine_s).sum())
    return out


def fit_scale(measured: np.ndarray, predicted: np.ndarray, prior_rows: float) -> float:
    """Least squares `measured ~ k * predicted` through the origin, pulled towards k = 1 by
    `prior_rows` steps of the mean prediction; 1.0 without usable steps."""
    m, p = np.asarray(measured, float), np.asarray(predicted, float)
    ok = np.isfinite(m) & np.isfinite(p) & (p > 0) & (m > 0)
    if not ok.any():
        return 1.0
    m, p = m[ok], p[ok]
    prior = prior_rows * float(p.mean()) ** 2
    k = (float(m @ p) + prior) / (float(p @ p) + prior)
    return float(np.clip(k, *SCALE_LIMITS))


def scaled_cluster(prior: Cluster, k_compute: float, k_network: float) -> Cluster:
    """`prior` with every peak FLOP/s divided by `k_compute` and every link's bandwidth divided
    (latency multiplied) by `k_network`."""
    peaks = prior.peak_flops
    scaled = {
        name: (None if getattr(peaks, name) is None else getattr(peaks, name) / k_compute)
        for name in ("fp32", "tf32", "bf16", "fp16")
    }

    def link(x: Link) -> Link:
        return dataclasses.replace(x, bw_Bps=x.bw_Bps / k_network, lat_s=x.lat_s * k_network)

    return dataclasses.replace(
        prior,
        name=prior.name if (k_compute, k_network) == (1.0, 1.0) else f"{prior.name}~fitted",
        peak_flops=PeakFlops(**scaled),
        intra_node=link(prior.intra_node),
        inter_node=link(prior.inter_node),
        inter_domain=link(prior.inter_domain),
    )


def fit_cluster(
    prior: Cluster,
    cost: CostModel,
    plan: Plan,
    counts: np.ndarray,
    measured: np.ndarray,
    prior_rows: float = 4.0,
) -> tuple[Cluster, Fit]:
    """The cluster fitted to `measured[S, len(MEASURED)]` (slowest rank's seconds per step)
    from steps run under `plan` with `counts[S, L, D, E]`; `cost` prices on `prior`."""
    if len(counts) == 0:
        return prior, _fit_of(prior, cost, 1.0, 1.0, 0)
    predicted = predicted_phases(cost, plan, counts)
    k_c = fit_scale(measured[:, EXPERTS], predicted[:, 0], prior_rows)
    k_n = fit_scale(measured[:, A2A], predicted[:, 1], prior_rows)
    return scaled_cluster(prior, k_c, k_n), _fit_of(prior, cost, k_c, k_n, len(counts))


def _fit_of(prior: Cluster, cost: CostModel, k_c: float, k_n: float, rows: int) -> Fit:
    flops = prior.gemm_flops(cost.spec.gemm_dtype) / k_c
    return Fit(k_c, k_n, rows, flops, prior.intra_node.bw_Bps / k_n)


__all__ = [
    "A2A",
    "BOUNDARY",
    "EXPERTS",
    "GATE",
    "MEASURED",
    "PERIOD",
    "Fit",
    "fit_cluster",
    "fit_scale",
    "predicted_phases",
    "scaled_cluster",
]
