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

with F_t forward FLOPs per token (x3: forward and backward), P the device's GEMM rate
(`cluster.gemm_flops`), B_t bytes per token (x4: dispatch and combine, forward and backward),
W_e expert bytes, and W_net the per-device bandwidth of the slowest link level the cluster has
(FasterMoE uses one network bandwidth). t_shadow is the FasterMoE prototype's cost of one
shadowed expert: one broadcast of its parameters plus a ring reduction of its gradients (the
SmartMoE fork uses 8 W_e / W_net; option `shadow_cost_factor` overrides the factor
(1 + 2 (D - 1) / D)).

Greedy (FasterMoE Algorithm 1): starting from lat_0, shadow the next expert while
lat_{k+1} < lat_k (strict); the first non-improvement stops the walk.

Slots: a shadow needs a free slot on every device that is not the expert's home. FasterMoE had no
slot limit; here the walk also stops at the first expert that does not fit everywhere (slots only
fill up along the walk, so the feasible shadow sets form a prefix of the sorted order).

The placement keeps the homes in force (the static layout at the start) and drops any earlier
replicas; `Assignment.to_home` routes the rest (a shadowed expert is held everywhere, so every
source is local). `plan.notes["shadowed"][l]` lists the shadowed experts of layer l in the order
they were chosen; `notes["fastermoe_lat_s"][l]` is (lat_0, lat_k*) of the model above.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.placement import Assignment, Placement, Plan
from poise.policies.base import PlanContext, finish_plan, register, start_placement
from poise.topology import Cluster

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
    D, E = counts.shape
    order = np.argsort(-counts.sum(axis=0), kind="stable")
    is_home = np.arange(D)[:, None] == home[None, :]  # [D, E]
    away = np.where(is_home, 0.0, counts)  # tokens that leave their source, [D, E]
    remote_total = away.sum(axis=0)  # [E] tokens each home receives
    homed_tokens = np.bincount(home, weights=counts.sum(axis=0), minlength=D)
    recv0 = np.bincount(home, weights=remote_total, minlength=D)
    send0 = away.sum(axis=1)
    # Step k (shadow order[k]): every device computes its own tokens; the home stops receiving.
    a = away[:, order].T  # [E, D]
    home_hit = np.zeros((E, D))
    home_hit[np.arange(E), home[order]] = remote_total[order]
    d_comp = np.vstack([np.zeros(D), np.cumsum(a - home_hit, axis=0)])  # [E + 1, D]
    d_send = np.vstack([np.zeros(D), np.cumsum(a, axis=0)])
    d_recv = np.vstack([np.zeros(D), np.cumsum(home_hit, axis=0)])
    comp = homed_tokens[None, :] + d_comp
    crossing = np.maximum(send0[None, :] - d_send, recv0[None, :] - d_recv)
    lat = (t_comp * comp + t_feat * np.maximum(crossing, 0.0)).max(axis=1)
    lat = lat + t_shadow * np.arange(E + 1)
    # Slots: shadowing order[k] takes a slot on every device but its home.
    used = np.vstack([np.zeros(D), np.cumsum(~is_home[:, order].T, axis=0)])
    fits = (used <= free[None, :]).all(axis=1)
    K = int(np.argmin(fits)) - 1 if not fits.all() else E
    return order, lat[: K + 1]


def first_non_improvement(lat: np.ndarray) -> int:
    """Number of experts shadowed: walk while lat[k + 1] < lat[k] (strict)."""
    improving = lat[1:] < lat[:-1]
    return int(np.argmin(improving)) if not improving.all() else len(improving)


@register(NAME)
def plan(loads: np.ndarray, previous: Plan | None, ctx: PlanContext) -> Plan:
    """`loads[L, D, E]` predicted tokens -> Plan with the FasterMoE shadow set per layer."""
    L, D, _ = loads.shape
    cluster, spec = ctx.cluster, ctx.spec
    start = start_placement(previous, ctx, L)
    placement = Placement.from_homes(start.home, D, ctx.slots_per_device)
    w_net = network_bw(cluster)
    factor = ctx.option(NAME, "shadow_cost_factor", None)
    factor = 1.0 + 2.0 * (D - 1) / D if factor is None else float(factor)
    t_comp = 3.0 * spec.flops_per_token_fwd / cluster.gemm_flops
    t_feat = 4.0 * spec.token_bytes / w_net
    t_shadow = spec.expert_bytes / w_net * factor
    shadowed: list[list[int]] = []
    lats: list[list[float]] = []
    for layer in range(L):
        home = placement.home[layer]
        free = ctx.slots_per_device - placement.copies[layer].sum(axis=1)
        if D == 1:
            shadowed.append([])
            lats.append([0.0, 0.0])
            continue
        order, lat = shadow_latencies(loads[layer], home, free, t_comp, t_feat, t_shadow)
        k = first_non_improvement(lat)
        chosen = order[:k]
        placement.copies[layer][:, chosen] = np.maximum(placement.copies[layer][:, chosen], 1)
        shadowed.append([int(e) for e in chosen])
        lats.append([float(lat[0]), float(lat[k])])
    notes: dict[str, Any] = {"shadowed": shadowed, "fastermoe_lat_s": lats, "w_net_Bps": w_net}
    return finish_plan(NAME, placement, Assignment.to_home(placement), loads, previous, ctx, notes)
