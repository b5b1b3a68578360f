"""Self-calibration: the cost model's compute and network constants fitted to this run.

Each step the Balancer measures its layers' forward phases on every rank and keeps, per step,
one figure per phase for all ranks (gathered with the counts, so every rank holds the same
figures; `across_ranks`): `experts_s` (the expert GEMMs, the slowest rank's) and `a2a_s`
(dispatch + combine: the token all-to-all with its host work, the fastest rank's, since the
others' include waiting for the slowest rank's experts). Priced on the same steps' counts under
the plan that ran them, the cost model predicts `expert_fwd_s` and `dispatch_s + combine_s`
(summed over layers). Two scales relate them, each a least-squares fit through the origin over
a window of steps, pulled towards 1 (the cluster preset) by a prior worth
`prior_rows` steps of the mean prediction:

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
from poise.cost.phases import PhaseTimes

# Columns of the Balancer's gathered measurement rows (seconds, `across_ranks`): the wall time
# between two step boundaries, the boundary itself (Trans launch, migration, waiting for the
# planner), and the layers' forward phases.
# `transfers_s`: the step's Trans waits in forward and its Agg (launch and wait); the boundary
# (`boundary_s`, the previous step's) holds the Trans launches.
MEASURED = ("period_s", "boundary_s", "gate_s", "a2a_s", "experts_s", "transfers_s")
PERIOD, BOUNDARY, GATE, A2A, EXPERTS, TRANSFERS = range(len(MEASURED))
SCALE_LIMITS = (1e-3, 1e3)  # a fit outside these is a measurement gone wrong: clipped


@dataclass(frozen=True)
class Fit:
    """Fitted scales (`k_compute`, `k_network`, 1.0 = the preset), the steps they came from,
    and the fitted figures: large-GEMM FLOP/s in the model's compute dtype, intra-node
    bandwidth."""

    k_compute: float = 1.0
    k_network: float = 1.0
    k_transfer: float = 1.0
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


def across_ranks(per_rank: np.ndarray) -> np.ndarray:
    """One row of `MEASURED` from every rank's `per_rank[D, len(MEASURED)]`: the slowest rank's
    seconds, except the all-to-all's, which is the fastest rank's. An all-to-all ends when the
    last rank has sent, so a rank that reaches it early waits there for the slowest one's
    experts: the slowest rank's all-to-all seconds are mostly imbalance, the fastest rank's
    (the one that arrived last) are the exchange itself."""
    out = per_rank.max(axis=0)
    out[A2A] = per_rank[:, A2A].min()
    return out


def live_parts(cost: CostModel, plan: Plan, counts: np.ndarray) -> np.ndarray:
    """Model seconds per step `[S, 2]` of `plan` on `counts[S, L, D, E]`, summed over layers:
    `busy` (expert forward and backward, dispatch and combine with their host work: what a
    placement changes on the critical path, slowest device per layer) and `transfers` (Trans +
    Agg, before any overlap). The live guard prices a plan as `busy + k_transfer * transfers`,
    `k_transfer` fitted to the exposed transfer seconds the run measures."""
    pricer = cost.pricer(plan.placement, plan.assignment)
    out = np.zeros((len(counts), 2))
    for s, row in enumerate(counts):
        out[s] = busy_and_transfers(pricer.phases(row.astype(np.float64))[0])
    return out


def busy_and_transfers(ph: PhaseTimes) -> tuple[float, float]:
    """`(busy, transfers)` seconds of one step's phases, summed over layers (`live_parts`)."""
    busy = ph.expert_fwd_s + ph.expert_bwd_s + ph.dispatch_s + ph.combine_s
    busy = busy + ph.dispatch_host_fwd_s + ph.dispatch_host_bwd_s
    return float(busy.sum()), float((ph.trans_s + ph.agg_s).sum())


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
    """The cluster fitted to `measured[S, len(MEASURED)]` (seconds per step, `across_ranks`)
    from steps run under `plan` with `counts[S, L, D, E]`; `cost` prices on `prior`."""
    if len(counts) == 0:
        return prior, _fit_of(prior, cost, 1.0, 1.0, 1.0, 0)
    predicted = predicted_phases(cost, plan, counts)
    k_c = fit_scale(measured[:, EXPERTS], predicted[:, 0], prior_rows)
    k_n = fit_scale(measured[:, A2A], predicted[:, 1], prior_rows)
    fitted = scaled_cluster(prior, k_c, k_n)
    k_t = 1.0
    if plan.placement.copies.sum() > plan.placement.home.size:  # replicas: Trans and Agg ran
        modelled = live_parts(CostModel(fitted, cost.spec, cost.schedule), plan, counts)[:, 1]
        k_t = fit_scale(exposed_transfers_s(measured), modelled, prior_rows)
    return fitted, _fit_of(prior, cost, k_c, k_n, k_t, len(counts))


def exposed_transfers_s(measured: np.ndarray) -> np.ndarray:
    """`[S]` seconds the steps of `measured[S, len(MEASURED)]` spent on balancing's transfers
    on the critical path: Trans waits and Agg in the step, Trans launches at the boundary."""
    return measured[:, TRANSFERS] + measured[:, BOUNDARY]


def _fit_of(prior: Cluster, cost: CostModel, k_c: float, k_n: float, k_t: float, rows: int) -> Fit:
    flops = prior.gemm_flops(cost.spec.gemm_dtype) / k_c
    return Fit(k_c, k_n, k_t, rows, flops, prior.intra_node.bw_Bps / k_n)


__all__ = [
    "A2A",
    "BOUNDARY",
    "EXPERTS",
    "GATE",
    "MEASURED",
    "PERIOD",
    "TRANSFERS",
    "Fit",
    "across_ranks",
    "busy_and_transfers",
    "exposed_transfers_s",
    "fit_cluster",
    "fit_scale",
    "live_parts",
    "predicted_phases",
    "scaled_cluster",
]
