"""`shadow`: FasterMoE's dynamic shadowing (He et al., PPoPP '22, §4 "dynamic shadowing").

Before each step, the hottest experts are *shadowed*: their parameters are broadcast from the
home to every device, each device computes its own tokens for them locally (no all-to-all for
those tokens) and the gradients are reduced back to the home. Homes never move.

Performance model (FasterMoE's eq. 7-8 as implemented in FastMoE's `shadow_policy.py`, with the
per-device refinement of the SmartMoE artifact's fork, which separates tokens that cross the
network from tokens that are computed). Per layer, for the first k experts of the loads sorted in
descending order (stable: lower expert index first on ties) shadowed:

    C_k[d] = tokens device d computes   (its homes' tokens + its own tokens of shadowed experts)
    B_k[d] = max(sent_k[d], received_k[d])   tokens crossing the network at d
    lat_k  = max_d ( 3 F_t / P * C_k[d] + 4 B_t / W_net * B_k[d] ) + k * t_shadow
    t_shadow = W_e / W_net * (1 + 2 (D - 1) / D)

with F_t forward FLOPs per token (x3: forward and backward), P the device's large-GEMM rate in the
model's compute dtype (`cluster.gemm_flops(spec.gemm_dtype)`), B_t bytes per token (x4: dispatch and
combine, forward and backward), W_e expert bytes, and W_net the per-device bandwidth of the slowest
link level the cluster has (FasterMoE uses one network bandwidth). t_shadow is the FasterMoE
prototype's cost of one shadowed expert: one broadcast of its parameters plus a ring reduction of
its gradients (the SmartMoE fork uses 8 W_e / W_net; option `shadow_cost_factor` overrides the
factor (1 + 2 (D - 1) / D)).

Greedy (FasterMoE Algorithm 1): starting from lat_0, shadow the next expert while
lat_{k+1} < lat_k (strict); the first non-improvement stops the walk.

Slots: a shadow needs a free slot on every device that is not the expert's home. FasterMoE had no
slot limit; here the walk also stops at the first expert that does not fit everywhere (slots only
fill up along the walk, so the feasible shadow sets form a prefix of the sorted order).

The placement keeps the homes in force (the static placement at the start) and drops any earlier
replicas; `Assignment.to_home` routes the rest (a shadowed expert is held everywhere, so every
source is local). `plan.notes["shadowed"][l]` lists the shadowed experts of layer l in the order
they were chosen; `notes["fastermoe_lat_s"][l]` is (lat_0, lat_k*) of the model above.

More devices than experts (E < D; FasterMoE has no such case): the walk starts from the static
placement and its routing (`poise.core.static_ep`): with E dividing D, DeepSpeed-MoE's
expert-parallel groups (device d holds expert d mod E, and a source sends each expert's tokens
to the copy inside its own group of E consecutive devices, `Assignment.group_local`); else a
block of copies per expert with its remote tokens split evenly over them. C_k and B_k are those
of that routing: a holder computes its own tokens and the remote ones routed to it. A shadow
goes to the devices without a copy (one slot on each), the copies stay, and the experts not
shadowed keep static's routing; with one slot per device (the least E < D needs) nothing fits
and the plan is static's. `notes["edp_copies"]` is True.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement, Plan
from poise.core.static_ep import static_assignment
from poise.plan.policies.base import (
    PlanContext,
    finish_plan,
    register,
    start_homes,
    static_placement,
)

NAME = "shadow"


def network_bw(cluster: Cluster) -> float:
    """W_net: per-device bandwidth (bytes/s) of the slowest link level the cluster uses."""
    levels = []
    if cluster.devices_per_node > 1:
        levels.append(cluster.intra_node)
    if cluster.nodes_per_domain > 1:
        levels.append(cluster.inter_node)
    if cluster.domains > 1:
        levels.append(cluster.inter_domain)
    if not levels:
        levels.append(cluster.intra_node)
    return min(link.per_device_bw_Bps for link in levels)


def shadow_latencies(
    counts: np.ndarray,
    home: np.ndarray,
    free: np.ndarray,
    t_comp: float,
    t_feat: float,
    t_shadow: float,
) -> tuple[np.ndarray, np.ndarray]:
    """FasterMoE latency for every prefix of the descending-load order, for one layer.

    `counts[D, E]` tokens per source and expert; `home[E]`; `free[D]` free slots per device.
    Returns `(order[E], lat[K + 1])`: lat[k] is the model latency with `order[:k]` shadowed, for
    the K longest prefixes that fit in the slots."""
    E = counts.shape[1]
    walk = _Walk(counts[None], home[None], free[None], t_comp, t_feat, t_shadow)
    lat, fits = walk.rows(E)
    K = int(np.argmin(fits[0])) - 1 if not fits.all() else E
    return walk.order[0], lat[0, : K + 1]


class _Walk:
    """The prefixes of FasterMoE's walk for L layers at once, computed a chunk of steps at a
    time (`rows`): step k shadows `order[:, k]` (loads descending, stable). `counts[L, D, E]`,
    `home[L, E]`, `free[L, D]`; the running sums carried between chunks are the cumulative
    sums of one pass, so every row equals its value in a single pass over all E steps."""

    def __init__(
        self,
        counts: np.ndarray,
        home: np.ndarray,
        free: np.ndarray,
        t_comp: float,
        t_feat: float,
        t_shadow: float,
    ) -> None:
        L, D, _ = counts.shape
        self.t_comp, self.t_feat, self.t_shadow = t_comp, t_feat, t_shadow
        self.free = free
        total = counts.sum(axis=1)  # [L, E]
        self.order = np.argsort(-total, axis=1, kind="stable")
        # Tokens that leave their source: all but the home's own (zeroed in a copy).
        self.away = np.array(counts, dtype=np.float64, order="C")
        self.away[np.arange(L)[:, None], home, np.arange(home.shape[1])[None, :]] = 0.0
        remote_total = self.away.sum(axis=1)  # [L, E] tokens each home receives
        flat = (np.arange(L)[:, None] * D + home).ravel()
        self.homed = np.bincount(flat, weights=total.ravel(), minlength=L * D).reshape(L, D)
        self.recv0 = np.bincount(flat, weights=remote_total.ravel(), minlength=L * D).reshape(L, D)
        self.send0 = self.away.sum(axis=2)
        self.home, self.remote_total = home, remote_total
        self._start(L, D)

    def _start(self, L: int, D: int) -> None:
        """Running sums after the steps done so far (none): compute, sent, received, slots
        used, each `[L, 1, D]`."""
        self.done = 0
        self.d_comp = np.zeros((L, 1, D))
        self.d_send = np.zeros((L, 1, D))
        self.d_recv = np.zeros((L, 1, D))
        self.used = np.zeros((L, 1, D), dtype=np.int64)

    def _lat(self, d_comp: np.ndarray, d_send: np.ndarray, d_recv: np.ndarray) -> np.ndarray:
        """Slowest device's latency `[L, n]` of rows `[L, n, D]` (without the shadow cost)."""
        comp = self.homed[:, None, :] + d_comp
        crossing = np.maximum(self.send0[:, None, :] - d_send, self.recv0[:, None, :] - d_recv)
        return (self.t_comp * comp + self.t_feat * np.maximum(crossing, 0.0)).max(axis=2)

    def _columns(
        self, layer: np.ndarray, idx: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The steps' experts `idx[L, n]` (`layer[L, 1]`), each `[L, n, D]`: the tokens each
        device sends away for it (`a`), the remote tokens each device receives for it (`hit`:
        only its home), and the devices a shadow of it takes a slot on (all but its home)."""
        L, D, _ = self.away.shape
        n = idx.shape[1]
        home_o = self.home[layer, idx]  # the steps' experts: homes, remote tokens, [L, n]
        a = self.away[layer[:, :, None], np.arange(D), idx[:, :, None]]  # [L, n, D]
        hit = np.zeros((L, n, D))
        hit[layer, np.arange(n)[None, :], home_o] = self.remote_total[layer, idx]
        return a, hit, home_o[:, :, None] != np.arange(D)[None, None, :]

    def first(self) -> tuple[np.ndarray, np.ndarray]:
        """`(lat[L, 1], fits[L, 1])` of row 0 (nothing shadowed)."""
        lat = self._lat(self.d_comp, self.d_send, self.d_recv) + self.t_shadow * np.arange(1)
        return lat, (self.used <= self.free[:, None, :]).all(axis=2)

    def rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`(lat[L, n + 1], fits[L, n + 1])` for rows done..done + n (row r: the first r experts
        shadowed; lat[k] includes k t_shadow) and advance by n steps."""
        r0, r1 = self.done, self.done + n
        L = self.away.shape[0]
        a, hit, away = self._columns(np.arange(L)[:, None], self.order[:, r0:r1])
        # Step k: every device computes its own tokens; the holders stop receiving.
        d_comp = np.cumsum(np.concatenate([self.d_comp, a - hit], axis=1), axis=1)
        d_send = np.cumsum(np.concatenate([self.d_send, a], axis=1), axis=1)
        d_recv = np.cumsum(np.concatenate([self.d_recv, hit], axis=1), axis=1)
        lat = self._lat(d_comp, d_send, d_recv) + self.t_shadow * np.arange(r0, r1 + 1)
        # Slots: shadowing order[k] takes a slot on every device that does not hold it.
        used = np.cumsum(np.concatenate([self.used, away], axis=1), axis=1)
        fits = (used <= self.free[:, None, :]).all(axis=2)
        self.done = r1
        self.d_comp, self.d_send = d_comp[:, -1:], d_send[:, -1:]
        self.d_recv, self.used = d_recv[:, -1:], used[:, -1:]
        return lat, fits


class _CopiesWalk(_Walk):
    """FasterMoE's walk from a placement with several holders per expert (static's
    expert-data-parallel copies, more devices than experts) and a fixed `assignment` over them
    (static's: group-local in DeepSpeed's EP groups, or the even split over all copies). A
    holder keeps its own tokens and receives the tokens the assignment routes to it from the
    sources without a copy (`weights[l, e, d]` of all of them without groups; with group-local
    routing, its share of its group's, `Assignment.received`); shadowing e gives every device
    a copy: each computes its own tokens, the holders stop receiving, and a slot is taken on
    each device that had none."""

    def __init__(
        self,
        counts: np.ndarray,
        placement: Placement,
        assignment: Assignment,
        free: np.ndarray,
        t_comp: float,
        t_feat: float,
        t_shadow: float,
    ) -> None:
        if assignment.by_counts or assignment.shed is not None:
            raise PlanError("the shadow walk takes a fixed assignment", field="assignment")
        L, D, _ = counts.shape
        self.t_comp, self.t_feat, self.t_shadow = t_comp, t_feat, t_shadow
        self.free = free
        self.order = np.argsort(-counts.sum(axis=1), axis=1, kind="stable")
        self.held = placement.holders()  # [L, D, E]
        own = np.where(self.held, np.asarray(counts, dtype=np.float64), 0.0)
        self.away = np.where(self.held, 0.0, np.asarray(counts, dtype=np.float64))
        # Remote tokens each holder receives per expert, [L, D, E].
        if assignment.grouped:
            self.recv = assignment.received(placement, counts) - own
        else:
            self.recv = (assignment.weights * self.away.sum(axis=1)[:, :, None]).transpose(0, 2, 1)
        self.homed = (own + self.recv).sum(axis=2)  # tokens each device computes
        self.recv0 = self.recv.sum(axis=2)
        self.send0 = self.away.sum(axis=2)
        self._start(L, D)

    def _columns(
        self, layer: np.ndarray, idx: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As `_Walk._columns`: the remote tokens go to every holder by the assignment, and a
        shadow takes a slot on every device without a copy."""
        D = self.away.shape[1]
        at = (layer[:, :, None], np.arange(D), idx[:, :, None])  # -> [L, n, D]
        return self.away[at], self.recv[at], ~self.held[at]


def first_non_improvement(lat: np.ndarray) -> int:
    """Number of experts shadowed: walk while lat[k + 1] < lat[k] (strict)."""
    improving = lat[1:] < lat[:-1]
    return int(np.argmin(improving)) if not improving.all() else len(improving)


def shadow_layers(
    counts: np.ndarray,
    home: np.ndarray,
    free: np.ndarray,
    t_comp: float,
    t_feat: float,
    t_shadow: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FasterMoE's walk on every layer: `counts[L, D, E]`, `home[L, E]`, `free[L, D]` ->
    `(order[L, E], k[L], lat_0[L], lat_k[L])`: layer l shadows `order[l, :k[l]]`, the longest
    prefix that fits in the slots along which each step strictly lowers the latency
    (`shadow_latencies` then `first_non_improvement`). The walk stops at the first step that
    does not help, so the rows are computed a chunk at a time (4, 16, 64, ... steps) until
    every layer has stopped."""
    return _walk_layers(_Walk(counts, home, free, t_comp, t_feat, t_shadow))


def shadow_layers_on_copies(
    counts: np.ndarray,
    placement: Placement,
    assignment: Assignment,
    t_comp: float,
    t_feat: float,
    t_shadow: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`shadow_layers` from a placement whose experts may have several holders (static's
    expert-data-parallel copies) and a fixed `assignment` over them (static's routing,
    `_CopiesWalk`): `counts[L, D, E]` -> `(order[L, E], k[L], lat_0[L], lat_k[L])`. A shadow
    takes a slot on every device without a copy of its expert; the free slots are what
    `placement` leaves."""
    free = placement.slots_per_device - placement.slots_used()
    walk = _CopiesWalk(counts, placement, assignment, free, t_comp, t_feat, t_shadow)
    return _walk_layers(walk)


def _walk_layers(walk: _Walk) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`shadow_layers`' walk on a built `_Walk` (its free slots `walk.free[L, D]`)."""
    L, _, E = walk.away.shape
    free = walk.free
    if not (free >= 0).all() or E == 0:  # (row 0, nothing shadowed, fits where free >= 0)
        lat0, fits0 = walk.first()
        if fits0.all():  # no expert
            return walk.order, np.zeros(L, dtype=np.int64), lat0[:, 0], lat0[:, 0].copy()
        # A layer over its slots from the start: price it all at once.
        lat, fits = walk.rows(E)
        lat = np.concatenate([lat0, lat[:, 1:]], axis=1)
        k = np.zeros(L, dtype=np.int64)
        for layer in range(L):
            K = int(np.argmin(fits[layer])) - 1 if not fits[layer].all() else E
            k[layer] = first_non_improvement(lat[layer, : K + 1])
        return walk.order, k, lat[:, 0], lat[np.arange(L), k]
    k = np.full(L, -1, dtype=np.int64)
    step = 4
    while walk.done < E and (k < 0).any():
        r0 = walk.done
        n = min(step, E - r0)
        lat, fits = walk.rows(n)
        if r0 == 0:  # row 0: nothing shadowed
            lat0 = lat[:, 0]
            lat_k, prev = lat0.copy(), lat0
        # Row r + 1 stops the walk at r if it does not fit or does not lower the latency.
        before = np.concatenate([prev[:, None], lat[:, 1:-1]], axis=1)
        stop = ~fits[:, 1:] | ~(lat[:, 1:] < before)  # [L, n]
        hit = (k < 0) & stop.any(axis=1)
        first = stop.argmax(axis=1)
        k = np.where(hit, r0 + first, k)
        lat_k = np.where(hit, before[np.arange(L), first], lat_k)
        prev = lat[:, -1]
        step *= 4
    open_layers = k < 0  # walked every expert
    k[open_layers] = E
    lat_k[open_layers] = prev[open_layers]
    return walk.order, k, lat0, lat_k


@register(NAME, builds_on="homes")
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """`loads[L, D, E]` predicted tokens -> Plan with the FasterMoE shadow set per layer."""
    L, D, E = loads.shape
    cluster, spec = ctx.cluster, ctx.spec
    w_net = network_bw(cluster)
    factor = ctx.option(NAME, "shadow_cost_factor", None)
    factor = 1.0 + 2.0 * (D - 1) / D if factor is None else float(factor)
    t_comp = 3.0 * spec.flops_per_token_fwd / cluster.gemm_flops(spec.gemm_dtype)
    t_feat = 4.0 * spec.token_bytes / w_net
    t_shadow = spec.expert_bytes / w_net * factor
    if E < D:
        return _plan_on_edp_copies(loads, previous, ctx, (t_comp, t_feat, t_shadow), w_net)
    placement = Placement.from_homes(start_homes(previous, ctx, L), D, ctx.slots_per_device)
    if D == 1:
        shadowed: list[list[int]] = [[] for _ in range(L)]
        lats: list[list[float]] = [[0.0, 0.0] for _ in range(L)]
    else:
        homed = np.bincount((np.arange(L)[:, None] * D + placement.home).ravel(), minlength=L * D)
        free = ctx.slots_per_device - homed.reshape(L, D)  # (the copies are the homes)
        order, k, lat0, lat_k = shadow_layers(loads, placement.home, free, t_comp, t_feat, t_shadow)
        take = np.arange(order.shape[1])[None, :] < k[:, None]  # [L, E]
        layer, rank = np.nonzero(take)
        placement.copies[layer, :, order[layer, rank]] = np.maximum(
            placement.copies[layer, :, order[layer, rank]], 1
        )
        order_list = order.tolist()
        shadowed = [order_list[layer][:n] for layer, n in enumerate(k.tolist())]
        lats = np.stack([lat0, lat_k], axis=1).tolist()
    notes: dict[str, Any] = {"shadowed": shadowed, "fastermoe_lat_s": lats, "w_net_Bps": w_net}
    return finish_plan(NAME, placement, Assignment.to_home(placement), loads, previous, ctx, notes)


def _plan_on_edp_copies(
    loads: np.ndarray,
    previous: Plan | None,
    ctx: PlanContext,
    times: tuple[float, float, float],
    w_net: float,
) -> Plan:
    """More devices than experts: FasterMoE's walk from the static placement and its routing over
    the expert-data-parallel copies (`static_assignment`); each shadow goes to the devices
    without a copy. `times`: (t_comp, t_feat, t_shadow) of the module docstring."""
    L, D, E = loads.shape
    placement = static_placement(L, E, D, ctx.slots_per_device)
    order, k, lat0, lat_k = shadow_layers_on_copies(
        loads, placement, static_assignment(placement), *times
    )
    take = np.arange(E)[None, :] < k[:, None]  # [L, E]
    layer, rank = np.nonzero(take)
    placement.copies[layer, :, order[layer, rank]] = np.maximum(
        placement.copies[layer, :, order[layer, rank]], 1
    )
    order_list = order.tolist()
    notes: dict[str, Any] = {
        "shadowed": [order_list[layer][:n] for layer, n in enumerate(k.tolist())],
        "fastermoe_lat_s": np.stack([lat0, lat_k], axis=1).tolist(),
        "w_net_Bps": w_net,
        "edp_copies": True,
    }
    # A shadowed expert is held everywhere; the others keep static's routing.
    assignment = static_assignment(placement)
    return finish_plan(NAME, placement, assignment, loads, previous, ctx, notes)
