"""The cost model: seconds per MoE layer and step for a placement, an assignment and loads.

All inputs are loads `counts[L, D, E]` (token-to-expert assignments per source device) and a
`Placement`/`Assignment`; everything is vectorised over layers, devices and experts. Where the
tokens and bytes go (R, S_v, R_v below) is `poise.cost.traffic`; this module prices them.

Formulas (B_t bytes per routed token, F_t forward FLOPs per routed token, W_e expert bytes,
M_e migration bytes, see `core.spec.ModelSpec`):

- Tokens computed on device d for expert e (`Assignment.received`):
      R[d, e] = c[d, e] * h[d, e] + w[e, d] * sum_s c[s, e] * (1 - h[s, e])
  with h the holder mask and w the assignment weights. An assignment that splits by counts
  (`Assignment.by_counts`, as the runtime executes it) has w resolved from each priced step's
  own counts (`Assignment.resolve`, `poise.core.token_split`): every term below then prices
  that step's split.
- Expert compute, forward (FasterMoE eq. 7's compute term B * F_t / P; Pro-Prophet's FEC):
      FEC = max_d sum_e R[d, e] * F_t / rate(R[d, e]),   BEC = 2 FEC
  where rate(n) = peak[t] * efficiency * n / (n + half_rows) (`Cluster.gemm_rate`) in the
  model's compute dtype t (`ModelSpec.gemm_dtype`): the device's dense peak for t, the fraction
  large GEMMs reach, and the small-GEMM loss. Where the devices are processes sharing C cores
  (`HostCosts.shared_cores`, CPU ranks on one host), a waiting rank lends its core:
      FEC = max(max_d T_d, sum_d T_d / C),   T_d = sum_e R[d, e] * F_t / rate(R[d, e])
  (work-conserving sharing; with C = D / 2, balance saves at most the excess of the slowest
  device over twice the mean).
- Per-call floor (`Cluster.expert_call_floor_s` = phi; `expert_call_floor`): a device that
  computes a row takes at least phi for its layer's expert forward + backward, split 1:2 as the
  GEMMs are: each T_d above becomes max(T_d, phi / 3 * min(n_d, 1)), n_d = sum_e R[d, e], so
  FEC_d >= phi / 3 and BEC_d = 2 FEC_d >= 2 phi / 3 (0 rows: 0 s). Measured on an H100
  (docs/benchmarks.md, "Expert compute on an H100", floor column: flat at 0.78-1.00 ms a
  call below ~1,000-2,000 rows a slot, the GPU waiting for the host issuing kernels).
- All-to-all on the links as capacities (FasterMoE eq. 7's B * B_t / W_net term, per link as
  in HybridEP eq. 10-11; `poise.cost.network`): S_v[d], R_v[d] are the bytes device d sends
  and receives over level v; a level-0 link carries its devices' intra-node bytes, a NIC what
  its devices send out of / receive into their node (S_1 + S_2), an uplink what leaves / enters
  their domain (S_2); with load_k the larger direction summed over the devices behind link k,
      A = max_{v, k} load_k / bw_v + max_d sum_v lat_v * m_v[d]
  (a lone sender gets a whole shared NIC; eight at once an eighth each), with m_v[d] the larger
  of the peers d sends to and receives from over level v (`traffic.Routing.messages`: s sends
  to d iff s sends at least a byte of tokens of some expert d takes a share of; a latency per
  message, the pairwise-exchange all-to-all's (p - 1) alpha). Dispatch and combine move the
  same bytes in opposite directions, so A_c = A_d; backward repeats both (4 all-to-alls per
  step).
- Trans (Pro-Prophet eq. 4-5, FasterMoE's shadow broadcast): a broadcast from the home to its
  replicas (`traffic.replica_traffic`): the home sends W_e once, over the farthest level; the
  copy enters each other domain and node once and reaches the node's other replicas over
  level 0; priced on the links like the all-to-all, with one message per (home, replica
  device) pair (`traffic.replica_messages`). Agg, the reduce back to the home, moves the same
  bytes the other way, so Agg = Trans.
- Migration: each home change moves M_e (weights + optimizer state) from old to new home, one
  message per (old home, new home) pair (`traffic.migration_messages`).
- Non-MoE compute: FNEC = tokens_per_device * non_moe_flops / gemm_flops(t), BNEC = 2 FNEC,
  gemm_flops(t) = peak[t] * efficiency (`Cluster.gemm_flops`); on a
  cluster with measured host costs (`poise calibrate`), at the measured dense rates, plus the
  token dispatcher's host work per layer H_fwd, H_bwd = a + b * max_d (rows routed + rows
  computed), with ranks sharing cores bounded by the devices' total too (`poise.cost.host`;
  `CostModel.complete`).

The schedule (`schedule.py`) turns these phases into step time (overlap or not).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement
from poise.core.spec import ModelSpec
from poise.cost.fingerprint import fingerprint, same_content
from poise.cost.host import busiest_sharing, dense_seconds, dispatch_host_seconds, dispatch_rows
from poise.cost.network import link_seconds
from poise.cost.phases import PhaseTimes
from poise.cost.schedule import Schedule
from poise.cost.traffic import (
    Routing,
    migration_messages,
    migration_traffic,
    padded_counts,
    replica_cells,
    replica_messages,
    replica_traffic,
)


@dataclass
class PlanCost:
    """A plan priced on loads: per-layer phases, per-layer time under the schedule, step time."""

    phases: PhaseTimes
    layer_s: np.ndarray
    schedule: str
    device_load: np.ndarray = field(repr=False)  # [L, D] tokens computed per device

    @classmethod
    def under(cls, schedule: Schedule, phases: PhaseTimes, device_load: np.ndarray) -> PlanCost:
        """The cost of `phases` (`[L]` each) and `device_load[L, D]` under `schedule`."""
        return cls(
            phases=phases,
            layer_s=schedule.layer_time(phases),
            schedule=schedule.name,
            device_load=device_load,
        )

    @property
    def step_s(self) -> float:
        return float(self.layer_s.sum())

    @property
    def max_over_mean(self) -> float:
        """Mean over layers of (max device load / mean device load)."""
        mean = self.device_load.mean(axis=1)
        ratio = np.where(mean > 0, self.device_load.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)
        return float(ratio.mean())


PRICE_CHUNK_CELLS = 2**19  # layer x device x expert cells a pricer handles at once (4 MiB)


def link_time(
    cluster: Cluster,
    send_bytes: np.ndarray,
    recv_bytes: np.ndarray,
    messages: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """`[L]` seconds of a phase moving `send_bytes`, `recv_bytes` (`[3, L, D]`, by level) in
    `messages` (the peers each device sends to and receives from, `[3, L, D]` each) on the
    cluster's links as capacities (`poise.cost.network.link_seconds`): the most loaded link's
    bytes / bandwidth plus the largest latency of one device's messages."""
    return link_seconds(cluster, send_bytes, recv_bytes, messages)


def expert_seconds(cluster: Cluster, spec: ModelSpec, rows: np.ndarray) -> np.ndarray:
    """Forward seconds of one expert GEMM over `rows` tokens (elementwise) in the spec's compute
    dtype t (`ModelSpec.gemm_dtype`): rows * F_t / rate(max(rows, 1)),
    rate(n) = peak[t] * efficiency * n / (n + h) (`Cluster.gemm_rate`, h = gemm_half_rows),
    which simplifies to

        F_t / (peak[t] * efficiency) * (rows + h * min(rows, 1))

    (for rows >= 1: (rows + h); below one row the rate of one row applies). The simplified form
    takes three passes over `rows` instead of seven."""
    rows = np.asarray(rows, dtype=np.float64)
    half = max(cluster.gemm_half_rows, 0.0)
    scale = spec.flops_per_token_fwd / cluster.gemm_flops(spec.gemm_dtype)
    if half == 0.0:
        return rows * scale
    out = np.minimum(rows, 1.0)  # in place from here: one temporary instead of four
    out *= half
    out += rows
    out *= scale
    return out


def expert_call_floor(cluster: Cluster, spec: ModelSpec, seconds: np.ndarray) -> np.ndarray:
    """Devices' forward expert seconds in a layer, `seconds` = T_d = sum_e expert_seconds(R[d,
    e]) (any shape, elementwise), with the cluster's per-call floor phi =
    `Cluster.expert_call_floor_s` (one device's forward + backward expert call per layer, at
    least; docs/benchmarks.md, "Expert compute on an H100", floor column) applied:

        FEC_d = max(T_d, phi / 3 * min(n_d, 1)),   so BEC_d = 2 FEC_d >= 2 phi / 3

    for n_d = sum_e R[d, e] rows (the model's 1:2 forward:backward split; 0 rows: 0 s; below
    one row the floor scales down with the rows, as `expert_seconds` charges a fraction of a row,
    so float residues of ~1e-13 tokens are no call). min(n_d, 1) is read off T_d itself:
    min(n_d, 1) = min(T_d / T_1, 1), T_1 = expert_seconds(1 row), since T_d = n_d T_1 while every
    R[d, e] < 1 and T_d >= T_1 once n_d >= 1; so the incremental pricers, which keep T_d but not
    n_d, floor exactly as `PlanPricer` does. Monotone in T_d: the floored maximum over devices is
    the floor of the maximum. Without a floor, `seconds` comes back as it is."""
    floor = cluster.expert_call_floor_s
    if floor <= 0.0:
        return seconds
    one_row = float(expert_seconds(cluster, spec, np.float64(1.0)))
    if not one_row > 0.0:  # experts of no FLOPs: no rows to tell from their seconds
        return seconds
    calls = np.minimum(np.asarray(seconds, dtype=np.float64) / one_row, 1.0)
    calls *= floor / 3.0
    return np.maximum(seconds, calls)


@dataclass
class CostModel:
    """Prices placements on a cluster for a model under a schedule."""

    cluster: Cluster
    spec: ModelSpec
    schedule: Schedule = field(default_factory=Schedule)
    pricers: PricerCache = field(
        default_factory=lambda: PricerCache(), init=False, repr=False, compare=False
    )

    def check_loads(self, counts: np.ndarray, source: str = "loads") -> np.ndarray:
        counts = np.asarray(counts, dtype=np.float64)
        D, E = self.cluster.num_devices, self.spec.experts
        if counts.ndim != 3 or counts.shape[1:] != (D, E):
            raise PlanError(
                f"loads must be [layers, devices={D}, experts={E}], got {counts.shape}",
                source=source,
                field="loads",
            )
        if counts.size:  # NaN and inf show in the minimum or the maximum
            lo, hi = counts.min(), counts.max()
            if not (np.isfinite(lo) and np.isfinite(hi) and lo >= 0):
                raise PlanError(
                    "loads must be finite and non-negative", source=source, field="loads"
                )
        return counts

    @property
    def non_moe_s(self) -> tuple[float, float]:
        """`(FNEC, BNEC)`: a block's non-MoE compute on one device, forward and backward. At the
        cluster's measured dense rates when it has them (`cost.host.dense_seconds`), else
        tokens per device x non-MoE FLOPs per token / the large-GEMM rate in the spec's compute
        dtype (`Cluster.gemm_flops`), and twice that backward."""
        cluster, spec = self.cluster, self.spec
        host = cluster.host
        if host.dense_fwd_flops is not None or host.dense_bwd_flops is not None:
            return dense_seconds(
                cluster, spec.non_moe_flops_fwd, spec.tokens_per_device, spec.gemm_dtype
            )
        fnec = spec.tokens_per_device * spec.non_moe_flops_fwd / cluster.gemm_flops(spec.gemm_dtype)
        return fnec, 2.0 * fnec

    @property
    def non_moe_fwd_s(self) -> float:
        """FNEC (`non_moe_s`)."""
        return self.non_moe_s[0]

    @property
    def prices_dispatch_host(self) -> bool:
        """Whether the cluster has measured dispatcher host costs (`cost.host`)."""
        host = self.cluster.host
        return any(
            v != 0.0
            for v in (
                host.dispatch_fwd_s,
                host.dispatch_fwd_s_per_row,
                host.dispatch_bwd_s,
                host.dispatch_bwd_s_per_row,
            )
        )

    def complete(
        self, phases: PhaseTimes, counts: np.ndarray, device_load: np.ndarray
    ) -> PhaseTimes:
        """`phases` (`[L]` each, e.g. from an incremental pricer) with what depends on the
        cluster's host costs filled in: the non-MoE compute at `non_moe_s` and the dispatcher's
        host work for `counts[L, D, E]` routed and `device_load[L, D]` computed rows
        (`cost.host.dispatch_host_seconds`: a + b * max_d (s + r), forward and backward).
        Without measured host costs the phases come back as they are."""
        host = self.cluster.host
        if host.is_default:
            return phases
        L = len(phases.dispatch_s)
        fnec, bnec = self.non_moe_s
        extra: dict[str, np.ndarray] = {
            "non_moe_fwd_s": np.full(L, fnec),
            "non_moe_bwd_s": np.full(L, bnec),
        }
        if self.prices_dispatch_host:
            rows = dispatch_rows(counts, device_load)
            extra["dispatch_host_fwd_s"], extra["dispatch_host_bwd_s"] = dispatch_host_seconds(
                host, rows
            )
        return dataclasses.replace(phases, **extra)

    def cost_of(self, phases: PhaseTimes, counts: np.ndarray, device_load: np.ndarray) -> PlanCost:
        """The `PlanCost` of `phases` and `device_load[L, D]` on `counts[L, D, E]`, completed
        (`complete`) and timed under the schedule."""
        return PlanCost.under(
            self.schedule, self.complete(phases, counts, device_load), device_load
        )

    def expert_compute_s(self, received: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """`[L, D]` forward seconds of expert GEMMs for `received[L, D, E]` tokens: the sum over
        experts of `expert_seconds`, i.e. F_t / gemm_flops(t) * (rows_d + h * sum_e min(R_de, 1))
        with `rows[L, D]` = sum_e R_de (computed here if not given): two passes over
        `received` instead of five."""
        cluster = self.cluster
        rows = received.sum(axis=2) if rows is None else rows
        scale = self.spec.flops_per_token_fwd / cluster.gemm_flops(self.spec.gemm_dtype)
        half = max(cluster.gemm_half_rows, 0.0)
        if half == 0.0:
            return rows * scale
        small = np.minimum(received, 1.0).sum(axis=2)
        small *= half
        small += rows
        small *= scale
        return small

    def pricer(self, placement: Placement, assignment: Assignment) -> PlanPricer:
        """A pricer of this plan for many load matrices (see `PlanPricer`): the one this cost
        model made last for a plan of the same content, if it still keeps it
        (`PricerCache`)."""
        return self.pricers.get(self, placement, assignment)

    def phases(
        self,
        placement: Placement,
        assignment: Assignment,
        counts: np.ndarray,
        migrations: np.ndarray | None = None,
    ) -> tuple[PhaseTimes, np.ndarray]:
        """Phase times `[L]` and the per-device computed tokens `[L, D]`."""
        return self.pricer(placement, assignment).phases(counts, migrations)

    def price(
        self,
        placement: Placement,
        assignment: Assignment,
        counts: np.ndarray,
        migrations: np.ndarray | None = None,
    ) -> PlanCost:
        return self.pricer(placement, assignment).price(counts, migrations)


def array_key(a: np.ndarray | None) -> tuple[Any, ...] | None:
    """An exact dictionary key of an array's content and the order of its axes in memory
    (which sets NumPy's summation order; None for None)."""
    if a is None:
        return None
    return (a.dtype.str, a.shape, tuple(np.argsort(a.strides, kind="stable")), a.tobytes())


def plan_fingerprint(placement: Placement, assignment: Assignment) -> tuple[Any, ...]:
    """A key of what `PlanPricer` prices of a plan (`fingerprint` of the placement's homes and
    copies and of the assignment's weights, group weights and shed shares; the group size and
    per-step splitting): equal plans, equal keys; a match is confirmed by `prices_same`."""
    a = assignment
    return (
        fingerprint(placement.home),
        fingerprint(placement.copies),
        fingerprint(a.weights),
        fingerprint(a.group_weights),
        a.group_size,
        a.by_counts,
        fingerprint(a.shed),
    )


def prices_same(pricer: PlanPricer, placement: Placement, assignment: Assignment) -> bool:
    """Whether `pricer` was built on this plan's content, bit for bit."""
    p, a = pricer.placement, pricer.assignment
    return (
        same_content(p.home, placement.home)
        and same_content(p.copies, placement.copies)
        and same_content(a.weights, assignment.weights)
        and same_content(a.group_weights, assignment.group_weights)
        and a.group_size == assignment.group_size
        and a.by_counts == assignment.by_counts
        and same_content(a.shed, assignment.shed)
    )


PRICER_CACHE_CELLS = 2**22  # layer x device x expert cells of the pricers a cost model keeps
PRICER_CACHE_PLANS = 64  # and at most this many


class PricerCache:
    """The pricers a `CostModel` made last, by plan content (`plan_fingerprint`, each match
    confirmed bit for bit: `prices_same`; a plan that shares a key without the content takes
    the key's place), so a plan priced
    again (the simulator putting in force the plan a policy priced; a policy's placement that
    stays; `auto`'s candidates that are a rival's plan) reuses its `PlanPricer`, whose results
    are the same as a new one's. Each pricer is built on copies of the plan's arrays, so what
    the caller does with its own after does not reach it. Shared by threads (a lock guards the
    table); not pickled (an unpickled cost model starts with an empty cache)."""

    def __init__(self) -> None:
        self._pricers: OrderedDict[tuple[Any, ...], PlanPricer] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def clear(self) -> None:
        """Forget every kept pricer (a benchmark timing plans made on a new forecast)."""
        with self._lock:
            self._pricers.clear()

    def get(self, cost: CostModel, placement: Placement, assignment: Assignment) -> PlanPricer:
        """`cost`'s pricer of this plan: a kept one of the same content, or a new one."""
        key = plan_fingerprint(placement, assignment)
        with self._lock:
            pricer = self._pricers.get(key)
            if pricer is not None and prices_same(pricer, placement, assignment):
                self._pricers.move_to_end(key)
                return pricer
        pricer = PlanPricer(cost, placement.copy(), assignment.copy())
        keep = min(PRICER_CACHE_PLANS, max(2, PRICER_CACHE_CELLS // max(1, placement.copies.size)))
        with self._lock:
            self._pricers[key] = pricer
            self._pricers.move_to_end(key)
            while len(self._pricers) > keep:
                self._pricers.popitem(last=False)
        return pricer


class PlanPricer:
    """Prices one placement and assignment on any number of load matrices: what depends only on
    the plan (its `Routing`, Trans and Agg seconds, the non-MoE compute) is computed once, so a
    simulator replaying a plan for K steps pays for it once, not K times. An assignment that
    splits by counts (`Assignment.by_counts`) is resolved on each priced load matrix: its
    routing is built per call."""

    def __init__(self, cost: CostModel, placement: Placement, assignment: Assignment) -> None:
        self.cost = cost
        cluster, spec = cost.cluster, cost.spec
        self.layers = placement.layers
        self.placement, self.assignment = placement, assignment
        self.routing = Routing(cluster, placement, assignment)
        replicas = replica_cells(placement)
        t_send, t_recv = replica_traffic(cluster, placement, spec.expert_bytes, replicas=replicas)
        t_msg = replica_messages(cluster, placement, replicas)
        self.trans_s = link_time(cluster, t_send, t_recv, t_msg) * cluster.host.transfer_scale
        self.fnec_s, self.bnec_s = cost.non_moe_s

    def phases(
        self, counts: np.ndarray, migrations: np.ndarray | None = None
    ) -> tuple[PhaseTimes, np.ndarray]:
        """Phase times `[L]` and the per-device computed tokens `[L, D]` on `counts[L, D, E]`,
        plus the one-off `migrations` rows (layer, expert, old home, new home)."""
        cost = self.cost
        counts = self._checked(counts)
        cluster, spec, L = cost.cluster, cost.spec, self.layers
        fec, a2a, device_load = np.zeros(L), np.zeros(L), np.zeros((L, cluster.num_devices))
        for start, stop, routing, part, remote, split, received in self._chunks(counts):
            rows = received.sum(axis=2)  # [l, D]
            device_load[start:stop] = rows
            per_device = cost.expert_compute_s(received, rows)  # [l, D]
            per_device = expert_call_floor(cluster, spec, per_device)  # the per-call floor
            # ranks sharing cores: a waiting rank lends its core, the total bounds the layer too
            fec[start:stop] = busiest_sharing(per_device, cluster.host.shared_cores)
            send, recv = routing.traffic(part, remote, split)
            tb = spec.token_bytes
            msg = routing.messages(part, tb, remote, split)
            a2a[start:stop] = link_time(cluster, send * tb, recv * tb, msg)
        if migrations is not None and len(migrations):
            m_send, m_recv = migration_traffic(cluster, migrations, L, spec.migration_bytes)
            m_msg = migration_messages(cluster, migrations, L)
            mig = link_time(cluster, m_send, m_recv, m_msg) * cluster.host.transfer_scale
        else:
            mig = np.zeros(L)
        fnec, bnec = np.full(L, self.fnec_s), np.full(L, self.bnec_s)
        phases = PhaseTimes.from_parts(a2a, fec, fnec, self.trans_s.copy(), mig, bnec)
        return cost.complete(phases, counts, device_load), device_load

    def _checked(self, counts: np.ndarray) -> np.ndarray:
        """`counts[L, D, E]` checked, padded to capacity where the schedule pads
        (DeepSpeed-MoE's dispatcher: every pair at capacity)."""
        counts = self.cost.check_loads(counts)
        if self.cost.schedule.pads:
            counts = padded_counts(counts)
        if counts.shape[0] != self.layers:
            raise PlanError(
                f"loads have {counts.shape[0]} layers, the plan {self.layers}", field="loads"
            )
        return counts

    def _chunks(self, counts: np.ndarray) -> Iterator[tuple[Any, ...]]:
        """`(start, stop, routing, loads, remote, split, received)` per chunk of layers of the
        checked `counts[L, D, E]`: at most PRICE_CHUNK_CELLS cells each, so the temporaries stay
        small enough for the allocator to reuse (no page faults per step on 8,192 devices); an
        assignment that splits by counts resolved on them (this step's split of the replicated
        experts' tokens)."""
        L = self.layers
        whole = self.routing
        if self.assignment.by_counts:
            whole = Routing(
                self.cost.cluster, self.placement, self.assignment.resolve(self.placement, counts)
            )
        per_chunk = max(1, PRICE_CHUNK_CELLS // max(1, counts[0].size))
        for start in range(0, L, per_chunk):
            stop = min(L, start + per_chunk)
            routing = whole if per_chunk >= L else whole.take_layers(start, stop)
            part = counts[start:stop]
            remote = routing.remote(part)
            split = routing.split(remote)
            yield start, stop, routing, part, remote, split, routing.received(part, remote, split)

    def device_compute_s(self, counts: np.ndarray) -> np.ndarray:
        """`[L, D]` forward expert seconds of every device on `counts[L, D, E]`
        (`CostModel.expert_compute_s` of the tokens each computes, with the cluster's per-call
        floor, `expert_call_floor`; `phases`' `expert_fwd_s` is the slowest device's per layer,
        or the shared cores' bound where they are shared)."""
        counts = self._checked(counts)
        cost = self.cost
        out = np.zeros((self.layers, cost.cluster.num_devices))
        for start, stop, *_, received in self._chunks(counts):
            out[start:stop] = expert_call_floor(
                cost.cluster, cost.spec, cost.expert_compute_s(received)
            )
        return out

    def price(self, counts: np.ndarray, migrations: np.ndarray | None = None) -> PlanCost:
        """The plan's `PlanCost` on `counts[L, D, E]` under the cost model's schedule."""
        phases, device_load = self.phases(counts, migrations)
        return PlanCost.under(self.cost.schedule, phases, device_load)
