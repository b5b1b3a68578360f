"""Self-calibration: the cost model's compute, transfer and dispatch constants fitted to this run.

Each step the Balancer gathers one row of `MEASURED` seconds for all ranks (`across_ranks`):
the expert GEMMs at the slowest rank, and the collectives (the token all-to-all, the exposed
transfers, the boundary) at the fastest, whose time in a collective is the exchange itself
rather than a wait for the slowest rank. Priced on the same steps' counts under what they ran,
three constants are fitted, each least squares through the origin pulled towards its prior
`c` by `w` steps of the mean prediction:

    k = (sum_s m_s p_s + w P^2 c) / (sum_s p_s^2 + w P^2),   P = mean_s p_s

1. `k_compute`, the marginal seconds of an expert row over the model's: every rank's expert
   seconds `y[s, d]` against the model's for its rows `m[s, d]`, as `y = k m + c_s` with one
   intercept per step (`fit_marginal`). Balancing moves rows between devices, so what it saves
   is a row's marginal cost; a fit through the origin would read each layer's fixed per-call
   seconds as per-row seconds, and the per-step intercepts also take out the machine's drift.
   The slope is weighed against the previous fit by inverse variance, the previous one known
   no better than `DRIFT` of its value.
2. `k_transfer`: exposed transfer seconds over the model's Trans + Agg on steps that ran
   replicas (not the switch's step); the fitted cluster's bulk transfers take `k_transfer`
   times as long (`HostCosts.transfer_scale`), the token all-to-all stays on the prior's links.
   Its centre is the previous fit's, first the start-up probe's (`poise.runtime.selfcal.probe`).
3. `dispatch_s_per_row`: the all-to-all's seconds beyond its link time, per row the busiest
   dispatcher handles: the dispatcher's host work, added to the prior's.

One scale for links and transfers would misprice one of them: on CPU ranks the all-to-all is
mostly host work per row, a replica's Trans mostly bytes. NumPy only (the planning job's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.cluster import Cluster, PeakFlops
from poise.core.errors import ConfigError
from poise.cost.model import CostModel
from poise.cost.per_step import Ran, device_compute, plans_of, predicted_phases

# Columns of a gathered measurement row (seconds): the step's period (from the previous step's
# Agg landing to this one's), the boundary before it (Trans launches, migration, planner wait),
# the layers' forward phases, the step's Trans waits and Agg, and the boundary's migration.
MEASURED = ("period_s", "boundary_s", "gate_s", "a2a_s", "experts_s", "transfers_s", "migrate_s")
PERIOD, BOUNDARY, GATE, A2A, EXPERTS, TRANSFERS, MIGRATE = range(len(MEASURED))
WAITED = (BOUNDARY, A2A, TRANSFERS, MIGRATE)  # collectives: taken at the rank that waited least
SCALE_LIMITS = (1e-3, 1e3)  # a fit outside these is a measurement gone wrong: clipped
# The least relative standard error a previous k_compute carries into the next window: the
# machine's speed drifts by about a tenth over tens of steps.
DRIFT = 0.1


@dataclass(frozen=True)
class Fit:
    """Fitted constants (module docstring; 1.0 and 0.0: the prior's), the steps they came from,
    the fitted large-GEMM FLOP/s and the bandwidth bulk transfers see; `k_compute_se` (inf: not
    measured); `k_replica`, what the paired clock found replicas to cost over their modelled
    Trans + Agg (`poise.runtime.control.clock.replica_scale`; plans are priced with transfers
    `k_transfer * k_replica` times the prior's); `expert_fixed_s`, the expert seconds a step no
    row accounts for (the marginal fit's intercept)."""

    k_compute: float = 1.0
    k_transfer: float = 1.0
    dispatch_s_per_row: float = 0.0
    rows: int = 0
    gemm_flops: float = 0.0
    intra_bw_Bps: float = 0.0
    k_compute_se: float = float("inf")
    k_replica: float = 1.0
    expert_fixed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "checkpoint") -> Fit:
        """The fit `as_dict` gave; one `ConfigError` naming `source` and the field otherwise."""
        names = {f.name for f in dataclasses.fields(cls)}
        if set(values) != names:
            raise ConfigError(
                f"missing {sorted(names - set(values))}, unknown {sorted(set(values) - names)}",
                source=source,
                field="fit",
            )
        for name, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"not a number: {v!r}", source=source, field=f"fit.{name}")
        return cls(**{k: (int(v) if k == "rows" else float(v)) for k, v in values.items()})


def across_ranks(per_rank: np.ndarray) -> np.ndarray:
    """One `MEASURED` row from every rank's `per_rank[D, len(MEASURED)]`: the slowest rank's
    seconds, but the fastest rank's in collectives (`WAITED`): a collective ends when the last
    rank joins, so the slowest rank's seconds there are its wait for the others."""
    out = per_rank.max(axis=0)
    out[list(WAITED)] = per_rank[:, list(WAITED)].min(axis=0)
    return out


def exposed_transfers_s(measured: np.ndarray) -> np.ndarray:
    """`[S]` seconds the steps of `measured[S, len(MEASURED)]` spent on balancing's transfers on
    the critical path: Trans waits and Agg in the step, Trans launches at the boundary."""
    return measured[:, TRANSFERS] + measured[:, BOUNDARY]


def fit_slope(y: np.ndarray, x: np.ndarray, prior_rows: float, centre: float = 0.0) -> float:
    """Least squares `y ~ k * x` through the origin over the steps with a finite `y` and a
    positive `x`, pulled towards `centre` by `prior_rows` steps of the mean `x`; `centre`
    without such steps."""
    y, x = np.asarray(y, float), np.asarray(x, float)
    ok = np.isfinite(y) & np.isfinite(x) & (x > 0)
    if not ok.any():
        return float(centre)
    y, x = y[ok], x[ok]
    prior = prior_rows * float(x.mean()) ** 2
    return (float(y @ x) + prior * centre) / (float(x @ x) + prior)


def fit_scale(
    measured: np.ndarray, predicted: np.ndarray, prior_rows: float, centre: float = 1.0
) -> float:
    """`fit_slope` of `measured` (positive steps only: a zero is a phase that did not run) on
    `predicted`, clipped to `SCALE_LIMITS`: the module docstring's k."""
    m = np.asarray(measured, float)
    k = fit_slope(np.where(m > 0, m, np.nan), predicted, prior_rows, centre)
    return float(np.clip(k, *SCALE_LIMITS))


def scaled_cluster(
    prior: Cluster, k_compute: float, k_transfer: float, dispatch_s_per_row: float = 0.0
) -> Cluster:
    """`prior` with its peak FLOP/s over `k_compute`, its bulk transfers `k_transfer` times as
    long (`HostCosts.transfer_scale`) and `dispatch_s_per_row` more host seconds per dispatched
    row, forward and backward; its links as they are."""
    peaks = prior.peak_flops
    scaled = {
        name: (None if getattr(peaks, name) is None else getattr(peaks, name) / k_compute)
        for name in ("fp32", "tf32", "bf16", "fp16")
    }
    host = dataclasses.replace(
        prior.host,
        transfer_scale=prior.host.transfer_scale * k_transfer,
        dispatch_fwd_s_per_row=prior.host.dispatch_fwd_s_per_row + dispatch_s_per_row,
        dispatch_bwd_s_per_row=prior.host.dispatch_bwd_s_per_row + dispatch_s_per_row,
    )
    same = (k_compute, k_transfer, dispatch_s_per_row) == (1.0, 1.0, 0.0)
    return dataclasses.replace(
        prior,
        name=prior.name if same else f"{prior.name}~fitted",
        peak_flops=PeakFlops(**scaled),
        host=host,
    )


def fit_marginal(
    y: np.ndarray, m: np.ndarray, centre: float, centre_se: float
) -> tuple[float, float, float]:
    """`(k, se, fixed)`: the slope of `y[S, D] = k m[S, D] + c_s` (one intercept per step; steps
    with a non-finite `y` left out) weighed against `centre` known to within `centre_se`, its
    standard error, and the mean intercept. With deviations from each step's means `y'`, `m'`:

        k_w = sum y' m' / sum m'^2,   se_w^2 = sum (y' - k_w m')^2 / (n - S - 1) / sum m'^2

    over the n samples of S steps, then `k = (k_w / se_w^2 + centre / centre_se^2) /
    (1 / se_w^2 + 1 / centre_se^2)`. `centre` as it is with fewer than S + 2 samples or no
    spread in `m`."""
    y, m = np.asarray(y, float), np.asarray(m, float)
    ok = np.isfinite(y).all(axis=1) & np.isfinite(m).all(axis=1)
    y, m = y[ok], m[ok]
    S, D = y.shape if y.ndim == 2 else (0, 0)
    n = S * D
    dm = m - m.mean(axis=1, keepdims=True)
    dy = y - y.mean(axis=1, keepdims=True)
    sxx = float((dm * dm).sum())
    if n < S + 2 or not sxx > 0:
        fixed = float((y - centre * m).mean()) if n else 0.0
        return float(centre), float(centre_se), fixed
    k_w = float((dy * dm).sum()) / sxx
    resid = dy - k_w * dm
    se_w = float(np.sqrt(max(float((resid * resid).sum()), 1e-30) / (n - S - 1) / sxx))
    if np.isfinite(centre_se) and centre_se > 0:
        w_w, w_c = 1.0 / se_w**2, 1.0 / centre_se**2
        k = (k_w * w_w + centre * w_c) / (w_w + w_c)
        se = float(np.sqrt(1.0 / (w_w + w_c)))
    else:
        k, se = k_w, se_w
    k = float(np.clip(k, *SCALE_LIMITS))
    return k, se, float((y - k * m).mean())


def fit_compute(
    cost: CostModel, plan: Ran, counts: np.ndarray, rank_experts: np.ndarray,
    previous: Fit | None,
) -> tuple[float, float, float]:  # fmt: skip
    """`(k_compute, se, fixed)` from every rank's expert seconds `rank_experts[S, D]` on the
    steps `counts[S, L, D, E]` run under `plan` (module docstring, 1); at the first fit the
    centre is the fit through the origin on the same samples, known to within its own size."""
    m = device_compute(cost, plan, counts)
    y = np.asarray(rank_experts, float)
    if previous is not None and np.isfinite(previous.k_compute_se):
        centre = previous.k_compute
        centre_se = max(previous.k_compute_se, DRIFT * previous.k_compute)
    else:
        centre = fit_scale(y.ravel(), m.ravel(), prior_rows=0.0)
        centre_se = centre
    return fit_marginal(y, m, centre, centre_se)


def fit_cluster(
    prior: Cluster,
    cost: CostModel,
    plan: Ran,
    counts: np.ndarray,
    measured: np.ndarray,
    prior_rows: float = 4.0,
    previous: Fit | None = None,
    settled: np.ndarray | None = None,
    rank_experts: np.ndarray | None = None,
) -> tuple[Cluster, Fit]:
    """The cluster fitted to `measured[S, len(MEASURED)]` from steps run under `plan` with
    `counts[S, L, D, E]` (module docstring); `cost` prices on `prior`; `previous`: the last fit
    (the centres); `settled[S]` (default all): the steps whose transfers are steady (not the
    switch's); `rank_experts[S, D]`: every rank's expert seconds (None: the slowest rank's alone,
    fitted through the origin)."""
    k_t0 = previous.k_transfer if previous is not None else 1.0
    if len(counts) == 0:
        return scaled_cluster(prior, 1.0, k_t0), _fit_of(prior, cost, 1.0, k_t0, 0.0, 0)
    base = predicted_phases(cost, plan, counts)
    k_se, fixed = float("inf"), 0.0
    if rank_experts is not None:
        k_c, k_se, fixed = fit_compute(cost, plan, counts, rank_experts, previous)
    else:
        k_c = fit_scale(measured[:, EXPERTS], base[:, 0], prior_rows)
    k_t = k_t0
    if any(p.placement.replicas().any() for p in plans_of(plan)):  # Trans and Agg ran
        steady = np.ones(len(counts), bool) if settled is None else np.asarray(settled, bool)
        exposed = exposed_transfers_s(measured)[steady]
        k_t = fit_scale(exposed, base[steady, 2], prior_rows, centre=k_t0)
    host = prior.host
    host_s = host.dispatch_fwd_s * cost.spec.moe_layers + host.dispatch_fwd_s_per_row * base[:, 3]
    beyond = measured[:, A2A] - base[:, 1] - host_s  # the dispatcher's work beyond the links
    h = max(0.0, fit_slope(beyond, base[:, 3], prior_rows, centre=0.0))
    fit = _fit_of(prior, cost, k_c, k_t, h, len(counts))
    fit = dataclasses.replace(fit, k_compute_se=k_se, expert_fixed_s=fixed)
    return scaled_cluster(prior, k_c, k_t, h), fit


def cluster_of(prior: Cluster, fit: Fit) -> Cluster:
    """The cluster plans are priced on after `fit` (`scaled_cluster`, transfers scaled by
    `k_transfer * k_replica`)."""
    return scaled_cluster(
        prior, fit.k_compute, fit.k_transfer * fit.k_replica, fit.dispatch_s_per_row
    )


def _fit_of(prior: Cluster, cost: CostModel, k_c: float, k_t: float, h: float, rows: int) -> Fit:
    flops = prior.gemm_flops(cost.spec.gemm_dtype) / k_c
    return Fit(k_c, k_t, h, rows, flops, prior.intra_node.bw_Bps / k_t)
