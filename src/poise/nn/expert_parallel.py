"""Attach expert parallelism to a model of compute-only `MoE` layers, from outside.

    model = MyModel(...)                                  # MoE(MoEConfig(...)) layers inside
    apply_expert_parallel(model, dist.group.WORLD)        # on every rank, before the optimizer
    opt = torch.optim.AdamW(model.parameters())

The group may be a `DeviceMesh` instead: a 1-D one, or the dimension named `ep` of a larger one
(`apply_expert_parallel(model, mesh)` or `mesh["ep"]`; `poise.nn.fsdp.ep_mesh` builds one with
data parallelism beside it, and `poise.nn.fsdp.shard_dense` shards the dense parameters over it
with FSDP2).

For every `MoE` of the model: the group's size `D` must fit the experts (D divides E, or E
divides D); the layer keeps this rank's `P` slots of static EP (`P = num_slots`, default
`E / D`; more leaves room for the Balancer's replicas), copying each held expert's weights from
the full layer, so a model initialised or loaded on one device converts exactly; a `Dispatcher`
over the group replaces the local one. Then one all-gather compares every layer's configuration
and router weights across the ranks (`ConfigError` at once, instead of a hang in a later
collective). The expert weights are new parameters: build the optimizer afterwards.

Each converted layer's `state_dict` names its experts per expert (`<layer>.experts.<w>.expert_<e>`,
this rank's homes: `poise.nn.expert_keys`), so a DCP checkpointer saves every rank's experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import ConfigError
from poise.nn import comm
from poise.nn.comm import comm_device
from poise.nn.dispatch import Dispatcher, RankRouting
from poise.nn.expert_keys import register_expert_keys
from poise.nn.fsdp import ep_group_of, is_device_mesh
from poise.nn.moe import EXPERT_WEIGHTS, MoE, check_world, default_slots, find_moe_layers
from poise.util.digest import digest


def apply_expert_parallel(
    model: nn.Module, group: Any, *, num_slots: int | None = None
) -> list[MoE]:
    """Make every `MoE` of `model` expert parallel over `group` (a process group, or a
    `DeviceMesh`: a 1-D one or its `ep` dimension; None: this process alone, a group of one
    rank that still gets `num_slots` slots). Collective over
    `group` (one all-gather); returns the layers. Raises `ConfigError` naming the field: a
    group that does not fit the experts (`world_size`), too few slots (`num_slots`), a layer
    already expert parallel (`group`), ranks that disagree on the layers (`moe`)."""
    layers = find_moe_layers(model)
    if not layers:
        raise ConfigError("the model has no poise.nn.MoE layer", field="model")
    if is_device_mesh(group):
        group = ep_group_of(group)
    if group is None:
        world, rank = 1, 0
    elif not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("no process group is initialised", field="group")
    else:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    for m in layers:
        if m.expert_parallel:
            raise ConfigError("the MoE layer is already expert parallel", field="group")
        check_world(m.num_experts, world)
        need = default_slots(m.num_experts, world)
        slots = need if num_slots is None else int(num_slots)
        if slots < need:
            raise ConfigError(
                f"{m.num_experts} experts on {world} ranks need >= {need} slots, got {slots}",
                field="num_slots",
            )
    for m in layers:
        _keep_rank_slots(m, group, world, rank, num_slots)
    if world > 1:
        check_ranks_agree(layers, group)
    return layers


@torch.no_grad()
def _keep_rank_slots(m: MoE, group: Any, world: int, rank: int, num_slots: int | None) -> None:
    """Shrink `m`'s experts `[E, ...]` to this rank's static slots `[P, ...]` and install the
    dispatcher over `group`."""
    E = m.num_experts
    slots = default_slots(E, world) if num_slots is None else int(num_slots)
    routing = RankRouting.static(E, world, rank, slots)
    held = torch.as_tensor(routing.slots.expert, dtype=torch.long)
    for name in EXPERT_WEIGHTS:
        full = getattr(m.experts, name)
        if full is None:
            continue
        rows = full.new_zeros((slots, *full.shape[1:]))
        mine = (held >= 0).nonzero().flatten()
        rows[mine.to(rows.device)] = full[held[mine].to(full.device)]
        setattr(m.experts, name, nn.Parameter(rows, requires_grad=full.requires_grad))
    m.experts.num_slots = slots
    m.routing = routing
    m.dispatcher = Dispatcher(E, m.top_k, group, m.config.overlap_degree)
    m.group, m.world, m.rank = group, world, rank
    m.expert_parallel = True
    m.experts.expert_parallel = world > 1  # `Experts.forward` refuses FSDP over them
    register_expert_keys(m)


def check_ranks_agree(layers: list[MoE], group: Any) -> None:
    """Compare (number of layers, digest of their configurations, digest of their router
    weights) across the ranks of `group` in one all-gather; `ConfigError` (field `moe`) on
    every rank when any differ. Collective."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor(
        [
            len(layers),
            digest(*(m.config_digest() for m in layers)),
            digest(*(m.router.weight for m in layers)),
        ],
        dtype=torch.long,
    )
    mine = mine.to(comm_device(group, layers[0].router.weight.device))
    got = [torch.empty_like(mine) for _ in range(world)]
    comm.all_gather(got, mine, group=group)
    table = torch.stack(got).cpu()  # [D, 3]
    checks = (
        (0, "number of MoE layers", "build the model alike on every rank"),
        (1, "MoE configuration", "build the layers alike on every rank"),
        (2, "MoE router weights", "seed every rank alike"),
    )
    for col, what, hint in checks:
        other = (table[:, col] != table[rank, col]).nonzero().flatten().tolist()
        if other:
            raise ConfigError(
                f"the {what} on rank {rank} differs from rank(s) {other} ({hint})", field="moe"
            )


__all__ = ["apply_expert_parallel", "check_ranks_agree"]
