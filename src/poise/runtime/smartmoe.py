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
groups of ep ranks (ranks [g ep, (g+1) ep)); each group holds every expert, E / ep per rank, and
runs `poise.nn.MoE`'s expert parallelism on its own tokens. The ranks at the same position of
every EP group (ranks {i, i + ep, i + 2 ep, ...}) form an EDP group: they hold the same experts
in the same slots and all-reduce those experts' gradients before the optimizer step.

Why SUM (not mean). `poise.nn.MoE`'s backward already sums, into each slot, the gradient
contributions of every rank of the EP group (the dispatcher returns them); the routers' and the
dense parameters' gradients are summed over the ranks (`sync_router_grads`, the training loop's
dense all-reduce) with each rank's loss normalised by the *global* token count. Summing the EDP
copies therefore gives every copy the gradient of the sum of all D ranks' losses: what one
process computing the whole global batch gets (tests/test_runtime_layouts.py checks it to
1e-5). A mean would divide the expert gradients by edp and no others. Every copy then takes the
same optimizer step from the same state, so the replicas stay identical without any weight
broadcast.

Groups are created once (`dist.new_group` is collective: every rank creates every group, in the
same order); nothing here creates groups per step. Pipeline layouts (pp > 1) are refused: Poise
has no pipeline executor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import ConfigError, PlanError
from poise.layouts.pool import Layout
from poise.nn.comm import comm_device
from poise.nn.moe import MoE, find_moe_layers


@dataclass(frozen=True)
class LayoutGroups:
    """This rank's process groups in `layout`: `ep` (its EP group; the default group when ep is
    the world) and `edp` (its EDP group; None when edp = 1), with their global ranks;
    `ep_transfer`: a second group over the EP group's ranks, for the Balancer's Trans, Agg and
    migration (`poise.runtime.moves.transfer_group`; None where ep is 1)."""

    layout: Layout
    rank: int
    ep: Any
    edp: Any
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]
    ep_transfer: Any = None

    @property
    def ep_rank(self) -> int:
        """Position in the EP group (= the rank inside `ep`)."""
        return self.ep_ranks.index(self.rank)

    @property
    def edp_rank(self) -> int:
        """Which replica of the expert set this rank belongs to (= its EP group's index)."""
        return self.edp_ranks.index(self.rank)

    def expert_parallel_kwargs(self) -> dict[str, Any]:
        """`group` and `num_slots` for `poise.nn.apply_expert_parallel` (E / ep experts per
        rank)."""
        return {"group": self.ep, "num_slots": self.layout.experts_per_device}


def create_groups(layout: Layout, *, transfers: bool = True) -> LayoutGroups:
    """Create every EP and EDP group of `layout` (collective: call it on every rank, once) and
    return this rank's; with `transfers`, a second group per EP group for the Balancer's
    transfers (`LayoutGroups.ep_transfer`; static EP moves no expert and needs none). Raises
    `ConfigError` without an initialised process group, when the layout is for another world
    size, or for a pipeline layout."""
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
    return LayoutGroups(layout, rank, ep_group, edp_group, ep_ranks, edp_ranks, ep_transfer)


def _create_all(
    groups: list[list[int]], rank: int, world: int, *, reuse_world: bool = True
) -> tuple[Any, tuple[int, ...]]:
    """Create every group in `groups` (in order, on every rank) and return this rank's group
    and its ranks. A group of the whole world is the default group (`reuse_world`; else a new
    one). Groups of one rank are created too (None would mean no process group at all)."""
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
    """Sum the expert gradients of every `poise.nn.MoE` in `model` over `edp_group` (one
    all-reduce of one flat buffer); see the module docstring for why SUM. Weights without a
    gradient (no token reached this rank's slots) contribute zeros and get the sum. A no-op
    for `edp_group` None or of one rank.

    `check`: first compare the slot maps (which expert each slot holds, per layer) across the
    group (a small all-reduce) and raise `PlanError` when they differ: the sum is slot by slot,
    so every replica must keep its experts in the same slots."""
    if edp_group is None or dist.get_world_size(edp_group) == 1:
        return
    layers = find_moe_layers(model)
    if check:
        _check_slots_agree(layers, edp_group)
    params = expert_weights(model)
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _all_reduce_flat([p.grad for p in params if p.grad is not None], edp_group)


def _all_reduce_flat(tensors: Iterable[torch.Tensor], group: Any) -> None:
    tensors = list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    buf = flat.to(comm_device(group, flat.device))
    dist.all_reduce(buf, group=group)
    flat = buf.to(flat.device)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _check_slots_agree(layers: list[MoE], group: Any) -> None:
    if not layers:
        return
    maps = torch.cat([torch.as_tensor(m.routing.slots.expert, dtype=torch.int64) for m in layers])
    device = comm_device(group, torch.device("cpu"))
    lo, hi = maps.to(device), maps.clone().to(device)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise PlanError(
            "the ranks of an expert-data-parallel group hold different experts in their slots; "
            "their gradients cannot be summed slot by slot (plan every EP group alike)",
            field="routing.slots",
        )


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
    device = comm_device(edp_group, flat.device)
    lo, hi = flat.to(device), flat.clone().to(device)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=edp_group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=edp_group)
    return bool((hi - lo).abs().max() <= atol)


__all__ = [
    "LayoutGroups",
    "all_reduce_expert_grads",
    "create_groups",
    "expert_weights",
    "replicas_agree",
]
