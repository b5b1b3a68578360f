"""SmartMoE's online stage: pick the pool's best layout for the load seen now, and what moving
between two layouts costs (NumPy only).

The offline stage (`poise.layouts.price.rank_layouts`) keeps a pool of layouts priced on the
expected load distribution. Online, every so many steps, `select_layout` prices each pool layout
on the recent loads (with the expert placement `permute` would choose inside it,
`poise.layouts.price.permute_in_layout`) and moves to the fastest only when the predicted
saving over the coming steps exceeds the cost of moving there:

    switch  iff  (T_current - T_best) * horizon > T_switch

T_switch (`switch_seconds`): every device receives the weights and optimizer state of the
experts (M_e each) and dense blocks (P_d (B_dtype + B_opt) each) it holds in the new layout and
not in the old one, from the nearest old holder, priced per link level as the cost model prices
migration (`poise.cost.network.link_seconds`, the receiving side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.spec import ModelSpec
from poise.cost.network import link_seconds
from poise.layouts.pool import Layout, LayoutSettings
from poise.layouts.price import LayoutCost, price_with_online


def switch_seconds(
    old: Layout,
    new: Layout,
    cluster: Cluster,
    spec: ModelSpec,
    old_homes: np.ndarray | None = None,
    new_homes: np.ndarray | None = None,
) -> float:
    """Seconds to move from `old` to `new` (group-local homes `[L, E]`, default static): every
    device receives the weights and optimizer state (M_e per expert, P_d (B_dtype + B_opt) per
    dense block) it holds under `new` but not under `old`, from the nearest old holder (same
    node, else same domain, else another domain), priced per level as the cost model prices
    migration (`poise.cost.network.link_seconds`, the receiving side), one message per item
    received at the level it crosses."""
    held_old = held_state(old, old_homes)
    held_new = held_state(new, new_homes)
    need = held_new & ~held_old  # [L, D, E + 1]
    if not need.any():
        return 0.0
    L, D, C = need.shape
    nodes, domains = cluster.num_nodes, cluster.domains
    in_node = held_old.reshape(L, nodes, D // nodes, C).any(axis=2)[:, cluster.node_of(), :]
    in_dom = held_old.reshape(L, domains, D // domains, C).any(axis=2)[:, cluster.domain_of(), :]
    size = np.full(C, spec.migration_bytes)
    size[-1] = spec.dense_params_per_block * (spec.dtype_bytes + spec.optimizer_bytes_per_param)
    moved = need * size  # [L, D, C] bytes
    at_level = (in_node, in_dom & ~in_node, ~in_dom)
    per_level = np.stack([(moved * at).sum(axis=(0, 2)) for at in at_level])  # [3, D] bytes
    items = np.stack([(need & at).sum(axis=(0, 2)) for at in at_level]).astype(np.float64)
    # The senders are spread over the old holders: charge the receiving side on the links.
    none = np.zeros_like(per_level)
    return float(link_seconds(cluster, none, per_level, (none, items)))


def held_state(layout: Layout, homes: np.ndarray | None = None) -> np.ndarray:
    """`[L, D, E + 1]` bool: device d holds expert e of layer l (columns 0..E-1) or the dense
    block of layer l (column E)."""
    L, D, E = layout.layers, layout.devices, layout.experts
    homes = layout.static_homes() if homes is None else np.asarray(homes, dtype=np.int64)
    Ds, Ls = layout.stage_devices, layout.layers_per_stage
    held = np.zeros((L, D, E + 1), dtype=bool)
    for s in range(layout.pp):
        layers = slice(s * Ls, (s + 1) * Ls)
        placement, _ = layout.placement(homes[layers])
        held[layers, s * Ds : (s + 1) * Ds, :E] = placement.copies > 0
        held[layers, s * Ds : (s + 1) * Ds, E] = True
    return held


@dataclass
class Selection:
    """The online choice: `layout` (with group-local `homes[L, E]`) to run next, whether that is
    a switch, each pool layout's predicted step seconds on the recent loads, the switch cost and
    the predicted saving over the horizon."""

    layout: Layout
    homes: np.ndarray
    switched: bool
    step_s: dict[str, float]
    switch_s: float
    saving_s: float


def select_layout(
    pool: Sequence[Layout],
    recent: np.ndarray,
    cluster: Cluster,
    spec: ModelSpec,
    current: Layout | None = None,
    current_homes: np.ndarray | None = None,
    settings: LayoutSettings | None = None,
    horizon_steps: int = 100,
) -> Selection:
    """SmartMoE's online selection inside the pool: price every pool layout (with its online
    `permute` placement when `settings.online`) on `recent[S, L, D, E]` and take the fastest;
    switch from `current` only when the predicted saving over `horizon_steps` steps,
    (T_current - T_best) * horizon, exceeds `switch_seconds`. Ties go to the earlier pool entry."""
    settings = settings or LayoutSettings()
    if not pool:
        raise ConfigError("the layout pool is empty", field="pool")
    if horizon_steps < 1:
        raise ConfigError(f"must be >= 1, got {horizon_steps}", field="horizon_steps")
    recent = np.asarray(recent, dtype=np.float64)
    if recent.ndim == 3:
        recent = recent[None]
    costs: dict[Layout, LayoutCost] = {}
    for layout in pool:
        start = current_homes if layout == current else None
        costs[layout] = price_with_online(layout, cluster, spec, recent, settings, start)
    best = min(pool, key=lambda lay: costs[lay].step_s)
    step_s = {lay.name: costs[lay].step_s for lay in pool}
    if current is None:
        return Selection(best, costs[best].homes, True, step_s, 0.0, 0.0)
    if current not in costs:
        costs[current] = price_with_online(current, cluster, spec, recent, settings, current_homes)
        step_s[current.name] = costs[current].step_s
    saving = (costs[current].step_s - costs[best].step_s) * horizon_steps
    old_homes = current_homes if current_homes is not None else current.static_homes()
    switch = switch_seconds(current, best, cluster, spec, old_homes, costs[best].homes)
    if best != current and saving > switch:
        return Selection(best, costs[best].homes, True, step_s, switch, saving)
    # Stay in the current layout, with its own online placement.
    return Selection(current, costs[current].homes, False, step_s, switch, saving)


__all__ = ["Selection", "held_state", "select_layout", "switch_seconds"]
