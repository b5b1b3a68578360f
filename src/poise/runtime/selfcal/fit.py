"""Self-calibration: the cost model's compute, transfer and dispatch constants fitted to this run.

Each step the Balancer measures its layers' forward phases on every rank and keeps, per step,
one figure per phase for all ranks (gathered with the counts, so every rank holds the same
figures; `across_ranks`): `experts_s` (the expert GEMMs, the slowest rank's), `a2a_s`
(dispatch + combine: the token all-to-all with its host work, the fastest rank's, since the
others' include waiting for the slowest rank's experts) and the exposed transfer seconds
(`exposed_transfers_s`: Trans waits and Agg in the step, Trans launches at the boundary; the
fastest rank's too, for the same reason).
Priced on the same steps' counts under the plan that ran them, three constants are fitted, each
a least-squares fit through the origin over a window of steps, pulled towards its prior
(`centre`) by `prior_rows` steps of the mean prediction (`fit_scale`):

    k = (sum_s m_s p_s + w P^2 c) / (sum_s p_s^2 + w P^2),   P = mean_s p_s,  w = prior_rows

1. `k_compute`: the marginal expert forward seconds of a row over the model's (`fit_marginal`):
   each rank's own expert seconds `y[s, d]` (`StepRecords.rank_expert_rows`) against the model's
   for the rows that rank computed, `m[s, d]` (`device_compute`), as `y = k m + c_s`, one
   intercept per step: balancing moves rows between devices, so what it saves is the marginal
   seconds of a row. A fit through the origin (`y = k m`) reads the per-call seconds every layer
   pays whatever its rows (measured on `skewed`, 2 CPU ranks: ~9 ms a step, 2 ms a layer, at
   7.7 us a row) as per-row seconds, and priced a row 25-65% too dear: on balanced steps (every
   device near the mean) it fitted k 1.3 times what it fitted on static steps, and the guard's
   modelled saving of a replica plan came out 3-5 times the paired clock's. Per-step intercepts
   also take out the machine's drift between steps (it moves every rank's seconds alike). The
   slope is known only as well as the ranks' rows differ: its standard error (from the
   residuals) weighs it against the previous fit's (`Fit.k_compute_se`, kept at least
   `DRIFT` of its value: the machine's speed drifts 10-20% over tens of steps) or, at the first
   fit, against the fit through the origin on the same samples (an upper bound where the
   intercept is positive, taken as known to within its own size). The fitted cluster's peak
   FLOP/s are the preset's divided by it. Without per-rank seconds (a caller that has only the
   slowest rank's), the slowest rank's seconds over the model's `expert_fwd_s`, through the
   origin (centre 1).
2. `k_transfer`: exposed transfer seconds over the model's Trans + Agg, on steps whose plan
   has replicas (the step that carried the switch left out: its boundary holds the one-off
   migration); the fitted cluster's bulk transfers (Trans, Agg, migration:
   `HostCosts.transfer_scale`) take k_transfer times as long, so they are priced at the rate
   this run moves them, while the token all-to-all stays on the prior's links. Centre: the previous
   fit's value (before any, the start-up probe's, `poise.runtime.selfcal.probe`, or 1 without it),
   which is also kept when no replica ran in the window.
3. `dispatch_s_per_row`: the token all-to-all's measured seconds beyond its link time on the
   prior's links, per row the busiest device's dispatcher handles (sent + received, summed over
   layers; where ranks share cores, the devices' total over the cores when that is more:
   `cost.host.busiest_sharing`): the dispatcher's host work (`poise.cost.host`, the linear form
   `poise calibrate` fits), added to the prior's, forward and backward alike (centre 0 beyond
   the prior's).

One scale on the links for both would price them alike: fitted to the all-to-all (whose time on
CPU ranks is mostly host work per row, 30-50 times the link's) a 10 MB Trans looked too dear to
keep any replica; fitted to the transfers (7-18 times the link's) the all-to-all's link term
exceeds what it measures, and a replica that keeps tokens local is credited with a saving in
bytes the run does not see. Plans are priced, and chosen, with the fitted cluster.
The fit is NumPy only: it runs on the background planner's thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from poise.core.cluster import Cluster, PeakFlops
from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement, Plan
from poise.cost.host import busiest_sharing, dispatch_rows
from poise.cost.model import CostModel
from poise.cost.phases import PhaseTimes

# Columns of the Balancer's gathered measurement rows (seconds, `across_ranks`): the step's
# period (the wall time from the previous step's Agg landing to this one's: the boundary before
# the step, with the Trans launched for it, then its forward, backward and Agg), the boundary
# itself (Trans launch, migration, waiting for the planner), and the layers' forward phases.
# `transfers_s`: the step's Trans waits in forward and its Agg (launch and wait); the boundary
# (`boundary_s`, the previous step's) holds the Trans launches; `migrate_s`, the part of that
# boundary spent moving homes with their optimizer state (a switch's migration, 0 otherwise).
MEASURED = ("period_s", "boundary_s", "gate_s", "a2a_s", "experts_s", "transfers_s", "migrate_s")
PERIOD, BOUNDARY, GATE, A2A, EXPERTS, TRANSFERS, MIGRATE = range(len(MEASURED))
WAITED = (BOUNDARY, A2A, TRANSFERS, MIGRATE)  # collectives: taken at the rank that waited least
SCALE_LIMITS = (1e-3, 1e3)  # a fit outside these is a measurement gone wrong: clipped
# what steps ran under: one plan for every step, or one per step (the plan in force with the
# replicas each step ran, `poise.plan.retarget.ran_plans`)
Ran: TypeAlias = Plan | Sequence[Plan]
# The least relative standard error a previous fit's k_compute carries into the next window:
# the machine's speed drifts 10-20% over tens of steps (docs/benchmarks.md, identical static
# runs), so a figure fitted a window ago is not known better than that now.
DRIFT = 0.1


@dataclass(frozen=True)
class Fit:
    """Fitted constants (module docstring; 1.0 and 0.0 = the preset), the steps they came from,
    and the fitted figures: large-GEMM FLOP/s in the model's compute dtype, and the intra-node
    bandwidth bulk transfers see (the prior link's over `k_transfer`)."""

    k_compute: float = 1.0
    k_transfer: float = 1.0
    dispatch_s_per_row: float = 0.0
    rows: int = 0
    gemm_flops: float = 0.0
    intra_bw_Bps: float = 0.0
    k_compute_se: float = float("inf")  # `k_compute`'s standard error (inf: not measured)
    # what the paired clock found replicas to cost over their modelled Trans + Agg
    # (`paired_clock.replica_scale`; 1: as modelled, or not measured); plans are priced with
    # transfers k_transfer * k_replica times the prior's
    k_replica: float = 1.0
    expert_fixed_s: float = 0.0  # per step: the expert seconds no row accounts for (intercept)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "checkpoint") -> Fit:
        """The fit `as_dict` gave: every field, a number (a checkpoint's); one `ConfigError`
        naming `source` and the field for a malformed one."""
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


def predicted_phases(cost: CostModel, plan: Ran, counts: np.ndarray) -> np.ndarray:
    """Model figures per step `[S, 4]` of `plan` on `counts[S, L, D, E]`, summed over layers:
    expert forward seconds, dispatch + combine link seconds (forward), Trans + Agg seconds, and
    the rows that bound the dispatchers' host work (`cost.host.busiest_sharing` of
    `cost.host.dispatch_rows`, sent + received: the busiest device's, or the devices' total
    over the cores they share where that is more)."""
    if len(counts) == 0:
        return np.zeros((0, 4))
    phases, device_load, loads = _per_step_layers(cost, plan, counts)
    shared = cost.cluster.host.shared_cores
    rows = busiest_sharing(dispatch_rows(loads, device_load), shared)  # [S * L]
    per_layer = np.stack(
        [
            phases.expert_fwd_s,
            phases.dispatch_s + phases.combine_s,
            phases.trans_s + phases.agg_s,
            rows,
        ],
        axis=1,
    )  # [S * L, 4]
    return per_layer.reshape(len(counts), -1, 4).sum(axis=1)


def _per_step_layers(
    cost: CostModel, plan: Ran, counts: np.ndarray
) -> tuple[PhaseTimes, np.ndarray, np.ndarray]:
    """`plan` priced on every step of `counts[S, L, D, E]` in one call: the steps' layers laid
    end to end as `S * L` layers of the plan's own (a layer's phases depend on its own counts
    only), so the phases come back `[S * L]`, the device loads `[S * L, D]`, with the loads
    `[S * L, D, E]` they were priced on."""
    pricer, loads = _steps_as_layers(cost, plan, counts)
    phases, device_load = pricer.phases(loads)
    return phases, device_load, loads


def _steps_as_layers(cost: CostModel, plan: Ran, counts: np.ndarray) -> tuple[Any, np.ndarray]:
    """A pricer of `plan` on every step of `counts[S, L, D, E]` at once, the steps' layers laid
    end to end as `S * L` layers of the plan's own (of step s's plan, given one per step), and
    those loads `[S * L, D, E]`."""
    S, L = counts.shape[:2]
    loads = counts.reshape(S * L, *counts.shape[2:]).astype(np.float64)
    if isinstance(plan, Plan):
        layers = np.tile(np.arange(L), S)
        placement, assignment = (
            plan.placement.take_layers(layers),
            plan.assignment.take_layers(layers),
        )
    else:
        if len(plan) != S:
            raise ValueError(f"{len(plan)} plans for {S} steps")
        placement = Placement(
            np.concatenate([p.placement.home for p in plan]),
            np.concatenate([p.placement.copies for p in plan]),
            plan[0].placement.slots_per_device,
        )
        assignment = Assignment.from_layers([(p.assignment, i) for p in plan for i in range(L)])
    return cost.pricer(placement, assignment), loads


def across_ranks(per_rank: np.ndarray) -> np.ndarray:
    """One row of `MEASURED` from every rank's `per_rank[D, len(MEASURED)]`: the slowest rank's
    seconds, except those spent in collectives (`WAITED`: the all-to-all, the transfers and the
    boundary), which are the fastest rank's. A collective ends when the last rank has joined,
    so a rank that reaches it early waits there for the slowest one: the slowest rank's seconds
    in it are mostly imbalance, the fastest rank's (the one that arrived last) are the exchange
    itself, and the time it adds to the step. Taken at the slowest rank, Agg's wait behind the
    slowest backward and the boundary's behind the slowest optimizer step would be charged to
    the transfers (`k_transfer`, `k_switch`) exactly when the loads are skewed."""
    out = per_rank.max(axis=0)
    out[list(WAITED)] = per_rank[:, list(WAITED)].min(axis=0)
    return out


def live_parts(cost: CostModel, plan: Ran, counts: np.ndarray) -> np.ndarray:
    """Model seconds per step `[S, 2]` of `plan` on `counts[S, L, D, E]`, summed over layers:
    `busy` (expert forward and backward, dispatch and combine with their host work: what a
    placement changes on the critical path, slowest device per layer) and `transfers` (Trans +
    Agg, before any overlap). The live guard prices a plan as `busy + k_transfer * transfers`,
    `k_transfer` fitted to the exposed transfer seconds the run measures."""
    if len(counts) == 0:
        return np.zeros((0, 2))
    busy, transfers = _busy_and_transfers_by_layer(_per_step_layers(cost, plan, counts)[0])
    return np.stack([busy, transfers], axis=1).reshape(len(counts), -1, 2).sum(axis=1)


def _busy_and_transfers_by_layer(ph: PhaseTimes) -> tuple[np.ndarray, np.ndarray]:
    busy = ph.expert_fwd_s + ph.expert_bwd_s + ph.dispatch_s + ph.combine_s
    busy = busy + ph.dispatch_host_fwd_s + ph.dispatch_host_bwd_s
    return busy, ph.trans_s + ph.agg_s


def busy_and_transfers(ph: PhaseTimes) -> tuple[float, float]:
    """`(busy, transfers)` seconds of one step's phases, summed over layers (`live_parts`)."""
    busy, transfers = _busy_and_transfers_by_layer(ph)
    return float(busy.sum()), float(transfers.sum())


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
    """`prior` with every peak FLOP/s divided by `k_compute`, its bulk transfers (Trans, Agg,
    migration: `HostCosts.transfer_scale`) `k_transfer` times as long, and `dispatch_s_per_row`
    added to the dispatcher's host seconds per row, forward and backward. The links stay as
    the prior gives them: the token all-to-all is priced on them plus the dispatcher's work."""
    peaks = prior.peak_flops
    scaled = {
        name: (None if getattr(peaks, name) is None else getattr(peaks, name) / k_compute)
        for name in ("fp32", "tf32", "bf16", "fp16")
    }
    host = prior.host
    host = dataclasses.replace(
        host,
        transfer_scale=host.transfer_scale * k_transfer,
        dispatch_fwd_s_per_row=host.dispatch_fwd_s_per_row + dispatch_s_per_row,
        dispatch_bwd_s_per_row=host.dispatch_bwd_s_per_row + dispatch_s_per_row,
    )
    same = (k_compute, k_transfer, dispatch_s_per_row) == (1.0, 1.0, 0.0)
    return dataclasses.replace(
        prior,
        name=prior.name if same else f"{prior.name}~fitted",
        peak_flops=PeakFlops(**scaled),
        host=host,
    )


def device_compute(cost: CostModel, plan: Ran, counts: np.ndarray) -> np.ndarray:
    """`[S, D]` the model's forward expert seconds of every device under `plan` on each step of
    `counts[S, L, D, E]`, summed over layers (`PlanPricer.device_compute_s`)."""
    pricer, loads = _steps_as_layers(cost, plan, counts)
    per_layer = pricer.device_compute_s(loads)  # [S * L, D]
    return per_layer.reshape(*counts.shape[:2], -1).sum(axis=1)


def fit_marginal(
    y: np.ndarray, m: np.ndarray, centre: float, centre_se: float
) -> tuple[float, float, float]:
    """`(k, se, fixed)`: the marginal scale `k` of `y[S, D] = k m[S, D] + c_s` (one intercept
    per step; rows with a non-finite `y` left out), its standard error, weighed against `centre`
    known to within `centre_se` by inverse variance (module docstring, 1), and `fixed`, the mean
    intercept. Within step s, with deviations from the step's means `y' = y - mean_d y`,
    `m' = m - mean_d m`:

        k_w = sum y' m' / sum m'^2,   se_w^2 = sum (y' - k_w m')^2 / (n - S - 1) / sum m'^2

    over the n samples of S steps; `k = (k_w / se_w^2 + centre / centre_se^2) / (1 / se_w^2 +
    1 / centre_se^2)`. With fewer than S + 2 samples or no spread, `centre` as it is."""
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
    steps `counts[S, L, D, E]` run under `plan` (module docstring, 1)."""
    m = device_compute(cost, plan, counts)
    y = np.asarray(rank_experts, float)
    if previous is not None and np.isfinite(previous.k_compute_se):
        centre = previous.k_compute
        centre_se = max(previous.k_compute_se, DRIFT * previous.k_compute)
    else:  # through the origin on the same samples, known to within its own size
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
    """The cluster fitted to `measured[S, len(MEASURED)]` (seconds per step, `across_ranks`)
    from steps run under `plan` with `counts[S, L, D, E]` (module docstring); `cost` prices on
    `prior`; `previous`: the last fit (its `k_transfer` is the centre and is kept when no
    replica ran; its `k_compute`, the centre of the marginal fit); `settled[S]` (default all):
    the steps whose transfers are steady (not the one that carried the switch);
    `rank_experts[S, D]`: every rank's own expert seconds on those steps (None: only the
    slowest rank's, in `measured`, fitted through the origin)."""
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
    if any(p.placement.replicas().any() for p in _plans(plan)):  # replicas: Trans and Agg ran
        steady = np.ones(len(counts), bool) if settled is None else np.asarray(settled, bool)
        exposed = exposed_transfers_s(measured)[steady]
        k_t = fit_scale(exposed, base[steady, 2], prior_rows, centre=k_t0)
    # The all-to-all is priced on the prior's links; the rest of its measured time is the
    # dispatcher's work per row.
    host = prior.host
    host_s = host.dispatch_fwd_s * cost.spec.moe_layers + host.dispatch_fwd_s_per_row * base[:, 3]
    beyond = measured[:, A2A] - base[:, 1] - host_s
    h = max(0.0, fit_slope(beyond, base[:, 3], prior_rows, centre=0.0))
    fit = _fit_of(prior, cost, k_c, k_t, h, len(counts))
    fit = dataclasses.replace(fit, k_compute_se=k_se, expert_fixed_s=fixed)
    return scaled_cluster(prior, k_c, k_t, h), fit


def _plans(plan: Ran) -> Sequence[Plan]:
    return [plan] if isinstance(plan, Plan) else plan


def cluster_of(prior: Cluster, fit: Fit) -> Cluster:
    """The cluster plans are priced on after `fit`: `prior` scaled by its compute, its bulk
    transfers (`k_transfer` times the paired clock's `k_replica`) and its dispatcher's seconds
    per row (`scaled_cluster`)."""
    return scaled_cluster(
        prior, fit.k_compute, fit.k_transfer * fit.k_replica, fit.dispatch_s_per_row
    )


def exposed_transfers_s(measured: np.ndarray) -> np.ndarray:
    """`[S]` seconds the steps of `measured[S, len(MEASURED)]` spent on balancing's transfers
    on the critical path: Trans waits and Agg in the step, Trans launches at the boundary."""
    return measured[:, TRANSFERS] + measured[:, BOUNDARY]


def _fit_of(prior: Cluster, cost: CostModel, k_c: float, k_t: float, h: float, rows: int) -> Fit:
    flops = prior.gemm_flops(cost.spec.gemm_dtype) / k_c
    return Fit(k_c, k_t, h, rows, flops, prior.intra_node.bw_Bps / k_t)


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
    "cluster_of",
    "device_compute",
    "exposed_transfers_s",
    "fit_cluster",
    "fit_compute",
    "fit_marginal",
    "fit_scale",
    "fit_slope",
    "live_parts",
    "predicted_phases",
    "scaled_cluster",
]
