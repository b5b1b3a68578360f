"""A training run in a SmartMoE layout: which layout, and the per-step pieces the loop adds.

    layout = resolve_layout(cfg, world)  # poise.train.config; None without `cfg.layout`
    groups = create_groups(layout)                # poise.runtime.smartmoe: once, on every rank
    model = GPTMoE(...)                           # compute only, every expert
    apply_expert_parallel(model, groups.ep, num_slots=E / ep [+ spare_slots when balancing])
    ...
    loss.backward(); dense all-reduce over the world; balancer.reduce_replicas()  # Agg done
    all_reduce_expert_grads(model, groups.edp)                      # expert grads: SUM over EDP
    summed, counts = edp_counts(balancer.window[-1], groups)        # [L, ep, E], [L, D, E]

`cfg.layout` is any text `poise.layouts.pool.Layout.parse` reads (`"ep=2"`, `"pp1-ep2-edp2"`; the
`poise layouts` command ranks them). On D ranks a layout of expert-parallel degree ep splits the
ranks into edp = D / ep EP groups of ep contiguous ranks, each holding every expert (E / ep per
rank) and routing only its own tokens; the ranks at one position of every group form an EDP group
and sum their expert gradients each step (`poise.runtime.smartmoe`, which says why a SUM gives
the gradient of the global batch). The dense part stays data parallel over all D ranks and each
rank still reads its own share of the global batch, so the losses do not depend on the layout.

Balancing inside a layout. Each EP group runs its own `poise.runtime.Balancer` over its ep
ranks. If each planned on its own group's loads `[L, ep, E]`, the groups would choose different
placements, the slot-by-slot EDP sum would add different experts' gradients and the replicas
would diverge. So every step the loop all-gathers the groups' counts over the EDP group and
gives every Balancer the same input, the counts summed over the EDP group,

    summed[l, i, e] = sum_g counts[l, g ep + i, e]                               [L, ep, E]

(position i of every group together: the tokens an EP group of ep ranks would route if it
processed the whole global batch). The planners are deterministic, so every group plans alike,
and `all_reduce_expert_grads` checks that the slot maps still agree before summing. The same
gather gives the world's counts `[L, D, E]` for the routing trace. Absolute token counts seen by
the planner are edp times a rank's own (the whole global batch on ep ranks); compute and
all-to-all are priced for that load, parameter transfers (Trans, Agg, migration) at their true
size, so with edp > 1 the cost model leans towards replication by at most that factor.

The EDP gradient sum runs after `balancer.reduce_replicas()`: Agg, launched asynchronously from the
gradient hooks, zeroes replica rows at launch and adds them into their homes at completion; a sum
between the two would add homes without their replicas' share. Once Agg is done, replica rows
are zero and homes hold their EP group's sums, and the slot-by-slot SUM over EDP completes them.

The routers' aux-loss-free bias (`bias_rate > 0`) is updated from the counts summed over the EP
group (`MoE.update_bias`); `install_edp_bias_sum` first sums them over the EDP group, so the
bias sees the whole world's counts and stays identical on every rank.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from poise.core.errors import ConfigError, PoiseError
from poise.nn import comm

if TYPE_CHECKING:
    import torch
    from torch import nn

    from poise.layouts.pool import Layout
    from poise.runtime.smartmoe import LayoutGroups

# Layout.parse's grammar: "ep=4", "pp=2,ep=4", "pp1-ep4-edp2"; read here only to check the
# pipeline degree and to size the world-independent check (Layout.parse does the rest).
_DEGREE = re.compile(r"(pp|ep|edp)\s*[=:]?\s*(\d+)")


def check_layout_text(text: str, experts: int, moe_layers: int, source: str) -> None:
    """What can be checked without the world size: the syntax, pp = 1 (Poise has no pipeline
    executor) and ep dividing the `experts`. Raises one `ConfigError(source, field="layout")`."""
    degrees = {k: int(v) for k, v in _DEGREE.findall(text)}
    if degrees.get("pp", 1) != 1:
        raise ConfigError(
            f"{text!r}: pipeline degree {degrees['pp']}: Poise has no pipeline executor; use a "
            "pp=1 layout (e.g. 'ep=2')",
            source=source,
            field="layout",
        )
    devices = max(1, degrees.get("ep", 1)) * max(1, degrees.get("edp", 1))
    parse_layout(text, devices, experts, moe_layers, source, world=None)


def parse_layout(
    text: str, devices: int, experts: int, layers: int, source: str, world: int | None
) -> Layout:
    from poise.layouts.pool import Layout

    try:
        return Layout.parse(text, devices, experts, layers)
    except PoiseError as exc:
        on = f" on {world} ranks" if world is not None else ""
        raise ConfigError(f"{text!r}{on}: {exc.message}", source=source, field="layout") from None


def edp_counts(row: np.ndarray, groups: LayoutGroups) -> tuple[np.ndarray, np.ndarray]:
    """This step's routing counts of every rank from this EP group's `row [L, ep, E]` (what its
    Balancer gathered): one all-gather over the EDP group. Returns `summed [L, ep, E]` (summed
    over the EDP group: the same on every rank, the Balancer's planning input) and `counts [L,
    D, E]` (rank g ep + i is position i of EP group g: the trace's counts). Collective over
    the EDP group; with edp = 1 both are `row`."""
    import torch

    from poise.nn.comm import comm_device

    row = np.asarray(row, dtype=np.int64)
    if groups.edp is None:
        return row, row
    local = torch.from_numpy(np.ascontiguousarray(row))
    local = local.to(comm_device(groups.edp, local.device))
    parts = [torch.empty_like(local) for _ in groups.edp_ranks]
    comm.all_gather(parts, local, group=groups.edp)
    stacked = torch.stack(parts).cpu().numpy()  # [edp, L, ep, E], EDP rank g = EP group g
    L, E = row.shape[0], row.shape[2]
    counts = stacked.transpose(1, 0, 2, 3).reshape(L, -1, E)  # [L, D, E]
    return stacked.sum(axis=0), counts


def install_edp_bias_sum(
    optimizer: torch.optim.Optimizer, model: nn.Module, edp_group: Any
) -> torch.utils.hooks.RemovableHandle | None:
    """A step pre-hook that sums every MoE router's `bias_counts` over `edp_group` (one
    all-reduce), so that `MoE.update_bias`, which sums them over the EP group, sees the world's
    counts. Register it before `poise.nn.moe.install_bias_update`'s hook (pre-hooks run in
    registration order). None when there is nothing to sum."""
    import torch

    from poise.nn.comm import comm_device
    from poise.nn.moe import find_moe_layers

    layers = [m for m in find_moe_layers(model) if m.router.expert_bias is not None]
    if edp_group is None or not layers:
        return None

    def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        local = torch.stack([m.bias_counts.to("cpu", torch.long) for m in layers])  # [L, E]
        buf = local.to(comm_device(edp_group, local.device))
        comm.all_reduce(buf, group=edp_group)
        for m, counts in zip(layers, buf.cpu(), strict=True):
            m.bias_counts.copy_(counts)

    return optimizer.register_step_pre_hook(hook)


__all__ = ["check_layout_text", "edp_counts", "install_edp_bias_sum", "parse_layout"]
