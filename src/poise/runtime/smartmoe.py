"""Starting training in a SmartMoE layout: expert-parallel groups, expert-data-parallel replicas.

    from poise.layouts.pool import Layout
    from poise.runtime.smartmoe import all_reduce_expert_grads, create_groups

    layout = Layout(devices=world, experts=E, layers=L, ep=2)      # or from `poise layouts`
    groups = create_groups(layout)                                  # once, on every rank
    model = MyModel(...)                                            # compute-only MoE layers
    apply_expert_parallel(model, **groups.expert_parallel_kwargs()) # EP group, E/ep slots
    ...
    loss.backward()
    sync_router_grads(model)                     # dense/router gradients: SUM over the world
    all_reduce_expert_grads(model, groups.edp)   # expert gradients: SUM over the EDP group
    optimizer.step()

A `poise.layouts.pool.Layout` with pipeline degree 1 splits the D ranks into D / ep contiguous EP
groups (ranks [g ep, (g+1) ep)), each holding every expert, E / ep per rank, and running
`poise.nn.MoE`'s expert parallelism on its own tokens. Ranks at the same position of every EP
group ({i, i + ep, ...}) form an EDP group: the same experts in the same slots, their gradients
all-reduced before the optimizer step.

SUM, not mean: each slot's gradient already sums its EP group's contributions (the dispatcher
returns them), and routers and dense parameters are summed over the ranks with each loss
normalised by the *global* token count; summing the EDP copies gives every copy the gradient of
all D ranks' losses, that of one process computing the global batch (a mean would divide only
the expert gradients by edp). Every copy then takes the same step from the same state, so the
replicas stay identical without a broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import ConfigError, PlanError
from poise.layouts.pool import Layout
from poise.nn import comm
from poise.nn.comm import comm_device
from poise.nn.moe import find_moe_layers


@dataclass(frozen=True)
class LayoutGroups:
    """This rank's groups in `layout` with their global ranks: `ep` (the default group when ep
    is the world), `edp` (None when edp = 1), `ep_transfer` (a second group over the EP ranks
    for the Balancer's transfers, `poise.runtime.moves.transfer_group`; None where ep is 1)."""

    layout: Layout
    ep: Any
    edp: Any
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]
    ep_transfer: Any = None

    def expert_parallel_kwargs(self) -> dict[str, Any]:
        """`group` and `num_slots` (E / ep experts a rank) for `poise.nn.apply_expert_parallel`."""
        return {"group": self.ep, "num_slots": self.layout.experts_per_device}


def create_groups(layout: Layout, *, transfers: bool = True) -> LayoutGroups:
    """Create every EP and EDP group of `layout` (collective: every rank, once, every group in
    the same order) and return this rank's; `transfers`: also `LayoutGroups.ep_transfer` (static
    EP needs none). `ConfigError` without a process group, for another world size, or for a
    pipeline layout (Poise has no pipeline executor)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "needs an initialised torch.distributed process group", field="layout", source="runtime"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.devices != world:
        raise ConfigError(
            f"layout {layout.name} is for {layout.devices} ranks, the world has {world}",
            source=layout.name,
            field="devices",
        )
    if layout.pp != 1:
        raise ConfigError(
            f"pipeline degree {layout.pp}: Poise has no pipeline executor; run a pp=1 layout",
            source=layout.name,
            field="pp",
        )
    ep_group, ep_ranks = _create_all(layout.ep_groups(), rank, world)
    if layout.edp == 1:
        edp_group, edp_ranks = None, (rank,)
    else:
        edp_group, edp_ranks = _create_all(layout.edp_groups(), rank, world)
    ep_transfer = None
    if transfers and layout.ep > 1:  # the transfers' own groups, after the others, every rank
        ep_transfer, _ = _create_all(layout.ep_groups(), rank, world, reuse_world=False)
    return LayoutGroups(layout, ep_group, edp_group, ep_ranks, edp_ranks, ep_transfer)


def _create_all(
    groups: list[list[int]], rank: int, world: int, *, reuse_world: bool = True
) -> tuple[Any, tuple[int, ...]]:
    """Create every group in `groups` (in order, on every rank); this rank's and its ranks. A
    world group is the default group (`reuse_world`; else new); one-rank groups are created
    too (None would mean no process group at all)."""
    mine: Any = None
    mine_ranks: tuple[int, ...] = ()
    for ranks in groups:
        whole = reuse_world and len(ranks) == world
        group = dist.group.WORLD if whole else dist.new_group(ranks)
        if rank in ranks:
            mine, mine_ranks = group, tuple(ranks)
    return mine, mine_ranks


def expert_weights(model: nn.Module) -> list[nn.Parameter]:
    """The stacked slot weights (`[S, ...]` each) of every `poise.nn.MoE` in `model`, in module
    order (`model` may itself be one `MoE`)."""
    return [w for m in find_moe_layers(model) for w in m.experts.weights()]


def all_reduce_expert_grads(model: nn.Module, edp_group: Any, *, check: bool = True) -> None:
    """Sum the expert gradients of every `poise.nn.MoE` in `model` over `edp_group` (one flat
    all-reduce; a no-op for None or one rank). Weights without a gradient contribute zeros.
    `check`: first compare the slot maps across the group (small all-reduces) and raise
    `PlanError` when they differ: the sum is slot by slot."""
    if edp_group is None or dist.get_world_size(edp_group) == 1:
        return
    layers = find_moe_layers(model)
    if check and layers:
        maps = [torch.as_tensor(m.routing.slots.expert, dtype=torch.int64) for m in layers]
        if _spread(torch.cat(maps), edp_group).any():
            raise PlanError(
                "the ranks of an expert-data-parallel group hold different experts in their "
                "slots; their gradients cannot be summed slot by slot (plan every EP group alike)",
                field="routing.slots",
            )
    params = expert_weights(model)
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    buf = flat.to(comm_device(edp_group, flat.device))
    comm.all_reduce(buf, group=edp_group)
    for g, summed in zip(grads, buf.to(flat.device).split([g.numel() for g in grads]), strict=True):
        g.copy_(summed.view_as(g))


def _spread(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Element-wise max minus min of `t` over `group` (two all-reduces; collective)."""
    device = comm_device(group, t.device)
    lo, hi = t.to(device), t.clone().to(device)
    comm.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    comm.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return hi - lo


@torch.no_grad()
def replicas_agree(model: nn.Module, edp_group: Any, atol: float = 0.0) -> bool:
    """Whether every rank of `edp_group` holds the same expert weights (max |difference| <=
    `atol`); collective over the group. True for None or a group of one rank."""
    if edp_group is None or dist.get_world_size(edp_group) == 1:
        return True
    params = expert_weights(model)
    if not params:
        return True
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    return bool(_spread(flat, edp_group).abs().max() <= atol)
