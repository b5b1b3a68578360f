"""Per-layer costs the GEMM and link model does not see: the non-MoE compute at its measured rate
and the token dispatcher's host work (NumPy only; coefficients in `core.cluster.HostCosts`, fitted
by `poise calibrate`).

**Non-MoE compute** (attention, norms, rotary positions, the router and the head's share of one
block). With N tokens per device, F the non-MoE forward FLOPs per token and block
(`ModelSpec.non_moe_flops_fwd`) and the small-batch rate curve of the expert GEMMs
(`Cluster.gemm_rate`, rate(n) = R n / (n + h)) applied to this work, in the model's compute dtype
t (`ModelSpec.gemm_dtype`):

    FNEC = N F / rate_f(N) = F (N + h_f) / R_f
    BNEC = 2 N F / rate_b(N) = 2 F (N + h_b) / R_b          (backward: twice the FLOPs)

R_f, h_f = `dense_fwd_flops`, `dense_fwd_half_tokens`; R_b, h_b = `dense_bwd_*`. With the defaults
(R_f = gemm_flops(t) = peak[t] * efficiency, h_f = 0, backward = forward's) these are the cost
model's FNEC = N F / gemm_flops(t) and BNEC = 2 FNEC (`poise.cost.model`; the non-expert computation
of Pro-Prophet's FNEC/BNEC). The FLOPs of a GPT block (`gpt_non_moe_flops_per_token`) follow Kaplan
et al., "Scaling Laws for Neural Language Models" (2020), Table 1: 2 FLOPs per weight and token,
plus the attention scores and values, here causal (mean (T + 1) / 2 positions attended).

**Dispatcher host work** (`poise.nn.dispatch.Dispatcher`: sorting a layer's routed rows by
expert, gathering them into the send buffer, the counts exchange, regrouping received rows by
slot and back, and combine's gathers; backward runs the transposed gathers). Per MoE layer l and
device d, with s[l, d] the rows (token-expert pairs) d's router routes, its own included, and
r[l, d] the rows d computes:

    H_fwd[l, d] = a_f + b_f (s[l, d] + r[l, d])
    H_bwd[l, d] = a_b + b_b (s[l, d] + r[l, d])
    H_fwd[l] = a_f + b_f rows[l],   rows[l] = max_d (s[l, d] + r[l, d])
                                      (the layer's all-to-alls wait for the slowest device)

Where the devices are processes sharing C cores' worth of compute (`HostCosts.shared_cores`,
CPU ranks on one host), a rank waiting at the all-to-all lends its core to the others, as for
the expert GEMMs (`poise.cost.model`): the host work is bounded by the devices' total too,

    rows[l] = max(max_d (s + r)[l, d], sum_d (s + r)[l, d] / C)          (`busiest_sharing`)

so with 4 ranks on 2 cores and top-1 routing (sum_d s = sum_d r = the layer's tokens), moving
rows off the busiest device saves host work only while it handles more than twice the mean.
Priced at `max_d` alone, the cost model credited replicas on `skewed-4` (4 CPU ranks on 2
cores, max / mean 2.1-2.6) with 3,000 rows a layer less host work, tens of ms a step, that
the paired clock never measured. The fixed term `a` is left per device: it does not move with
the placement.

a = `dispatch_*_s` (what does not scale with rows: the counts all-to-all, index bookkeeping,
Python), b = `dispatch_*_s_per_row`; the linear start-up + per-unit form of Hockney's model
("The communication challenge for MPP", Parallel Computing 20, 1994), fitted per row of
d_model values to the dispatcher's measured time beyond its token all-to-alls' link time. Each
routed row is copied into the send buffer and its output gathered back (s), each received row
regrouped by slot and back (r). The time adds to the layer under every schedule: it runs on the
device's own thread between the collectives.

The cost model prices both with a cluster's measured host costs (`CostModel.non_moe_s`,
`CostModel.complete`, `PhaseTimes.dispatch_host_fwd_s/_bwd_s`), so planners and the simulator
see the same layer time.
"""

from __future__ import annotations

import numpy as np

from poise.core.cluster import Cluster, HostCosts


def dense_rates(cluster: Cluster, dtype: str) -> tuple[float, float, float, float]:
    """`(R_f, h_f, R_b, h_b)` of the module docstring, defaults filled in (R_f: the large-GEMM
    rate in compute dtype `dtype`, `Cluster.gemm_flops`). Measured rates (`HostCosts`) are one
    rate, measured in the calibration's dtype, and apply to every dtype."""
    host = cluster.host
    if host.dense_fwd_flops is None:
        r_f, h_f = cluster.gemm_flops(dtype), 0.0
    else:
        r_f, h_f = host.dense_fwd_flops, host.dense_fwd_half_tokens
    if host.dense_bwd_flops is None:
        return r_f, h_f, r_f, h_f
    return r_f, h_f, host.dense_bwd_flops, host.dense_bwd_half_tokens


def dense_seconds(
    cluster: Cluster, flops_per_token: float, tokens: float, dtype: str
) -> tuple[float, float]:
    """`(FNEC, BNEC)` seconds of one block's non-MoE compute on `tokens` tokens in compute dtype
    `dtype` (module docstring); 0 for no tokens."""
    if tokens <= 0 or flops_per_token <= 0:
        return 0.0, 0.0
    r_f, h_f, r_b, h_b = dense_rates(cluster, dtype)
    return flops_per_token * (tokens + h_f) / r_f, 2.0 * flops_per_token * (tokens + h_b) / r_b


def dispatch_rows(counts: np.ndarray, device_load: np.ndarray) -> np.ndarray:
    """`[L, D]` rows each device's dispatcher handles, s + r: `counts[L, D, E]` the rows each
    device routes (row d: its router's assignments) and `device_load[L, D]` the rows it
    computes (`PlanCost.device_load`)."""
    counts = np.asarray(counts, dtype=np.float64)
    return counts.sum(axis=2) + np.asarray(device_load, dtype=np.float64)


def busiest_sharing(work: np.ndarray, shared_cores: float) -> np.ndarray:
    """`[L]` the work that bounds each layer, for per-device work `work[L, D]` (rows or
    seconds) that every device must finish before the layer's collectives: the busiest
    device's, or with devices sharing `shared_cores` > 0 cores (a waiting rank lends its core)
    the larger of that and the devices' total over the cores (module docstring). The cost
    model bounds the expert GEMMs' seconds and the dispatcher's rows (s + r, `dispatch_rows`)
    with it."""
    work = np.asarray(work, dtype=np.float64)
    if work.ndim != 2:
        raise ValueError(f"work must be [layers, devices], got {work.shape}")
    if not work.shape[1]:
        return np.zeros(work.shape[0])
    busiest = work.max(axis=1)
    if shared_cores > 0:
        busiest = np.maximum(busiest, work.sum(axis=1) / shared_cores)
    return busiest


def dispatch_host_seconds(host: HostCosts, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(H_fwd[L], H_bwd[L])`: the dispatcher host seconds per layer, forward and backward, for
    `rows[L, D]` = s + r (`dispatch_rows`): the slowest device's, bounded by the devices' total
    over `host.shared_cores` where they share cores (`busiest_sharing`)."""
    busiest = busiest_sharing(rows, host.shared_cores)
    fwd = host.dispatch_fwd_s + host.dispatch_fwd_s_per_row * busiest
    bwd = host.dispatch_bwd_s + host.dispatch_bwd_s_per_row * busiest
    return fwd, bwd


def gpt_non_moe_flops_per_token(
    d_model: int, context: int, experts: int, vocab: int, layers: int
) -> float:
    """Forward FLOPs per token of one GPT-MoE block outside its experts (module docstring):
    attention projections 8 d^2 (q, k, v, output), causal attention 2 d (T + 1) (scores and
    values over (T + 1) / 2 positions on average), the router 2 d E, and the tied embedding
    head's 2 V d shared over the `layers` MoE blocks."""
    d, T, E, V = float(d_model), float(context), float(experts), float(vocab)
    return 8.0 * d * d + 2.0 * d * (T + 1.0) + 2.0 * d * E + 2.0 * V * d / layers


__all__ = [
    "busiest_sharing",
    "dense_rates",
    "dense_seconds",
    "dispatch_host_seconds",
    "dispatch_rows",
    "gpt_non_moe_flops_per_token",
]
