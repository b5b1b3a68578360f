"""An attention + MoE block under MP + EP + ESP (Parm, arXiv 2407.00599), and its state.

`parallel_block` is `poise.models.gpt.Block` with `ParallelAttention` and `ParallelMoE`;
`load_full_state` shards the single-process block's state dict onto this rank, `full_state`
gathers it back; after backward, `sync_parallel_grads` sums gradients over the data-parallel
replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import ConfigError
from poise.models.gpt import Block, GPTConfig
from poise.nn import comm
from poise.runtime.parm.choice import ScheduleChooser
from poise.runtime.parm.groups import ParallelGroups
from poise.runtime.parm.parallel_moe import PAUSE_MP, ParallelMoE, ScheduleChoice
from poise.runtime.parm.tensor_parallel import ParallelAttention, value_or_grad


def parallel_block(
    cfg: GPTConfig,
    groups: ParallelGroups,
    *,
    schedule: ScheduleChoice = "auto",
    chooser: ScheduleChooser | None = None,
    full_state: Mapping[str, torch.Tensor] | None = None,
    **moe_kwargs: Any,
) -> Block:
    """`poise.models.gpt.Block` under MP + EP + ESP: attention heads split over the MP group,
    a `ParallelMoE` as FFN. `full_state`: the single-process block's state dict to shard onto
    this rank (cut locally); `moe_kwargs` go to `ParallelMoE` (`init_seed`, ...)."""
    cfg.validate()
    groups.check_model(heads=cfg.heads, d_expert=cfg.d_expert, num_experts=cfg.num_experts)
    moe = ParallelMoE(
        cfg.d_model,
        cfg.d_expert,
        cfg.num_experts,
        cfg.top_k,
        groups=groups,
        schedule=schedule,
        chooser=chooser,
        activation=cfg.activation,  # type: ignore[arg-type]
        capacity_factor=cfg.capacity_factor,
        **moe_kwargs,
    )
    block = Block(cfg, moe)
    block.attn = ParallelAttention.from_attention(block.attn, groups)  # type: ignore[assignment]
    if full_state is not None:
        load_full_state(block, full_state)
    return block


_Sharded = (ParallelAttention, ParallelMoE)


def _sharded_modules(model: nn.Module) -> dict[str, nn.Module]:
    """`{prefix: module}` of the sharded submodules (prefix ends with '.', '' for the root)."""
    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if isinstance(m, _Sharded) and not any(name.startswith(p) for p in out if p):
            out[f"{name}." if name else ""] = m
    return out


def _plain_items(model: nn.Module, prefixes: list[str]) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers outside the sharded submodules."""
    items = dict(model.named_parameters())
    items.update({k: v for k, v in model.state_dict(keep_vars=True).items() if k not in items})
    return {k: v for k, v in items.items() if not any(k.startswith(p) for p in prefixes)}


@torch.no_grad()
def load_full_state(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Load the single-process model's state dict `sd` onto this rank: sharded submodules
    (`ParallelAttention`, `ParallelMoE`) take their shards, everything else is copied."""
    sharded = _sharded_modules(model)
    for prefix, m in sharded.items():
        m.load_full_state_dict({k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)})  # type: ignore[operator]
    for name, t in _plain_items(model, list(sharded)).items():
        if name not in sd:
            raise ConfigError("missing from the full state dict", field=name)
        t.copy_(sd[name])


def full_state(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """The single-process model's state dict (or, `grads=True`, its gradients; None reads as
    zero) in full shape, gathered from the ranks: a collective over the MP and EP groups."""
    sharded = _sharded_modules(model)
    out: dict[str, torch.Tensor] = {}
    for prefix, m in sharded.items():
        for k, v in m.full_state_dict(grads).items():  # type: ignore[operator]
            out[prefix + k] = v
    params = dict(model.named_parameters())
    for name, t in _plain_items(model, list(sharded)).items():
        if not grads or name in params:  # buffers have no gradient
            out[name] = value_or_grad(t, grads).clone()
    return out


def sync_parallel_grads(model: nn.Module, groups: ParallelGroups) -> None:
    """Sum gradients over the data-parallel replicas (each node runs its own batch): non-expert
    parameters over the EP group; routers of `ParallelMoE` layers whose last schedule paused MP
    (each rank gated `T / M` tokens) over the world. Expert shards, held once each, stay."""
    experts: set[int] = set()
    routers: set[int] = set()
    for m in model.modules():
        if isinstance(m, ParallelMoE):
            experts.update(id(p) for p in m.experts.parameters())
            if m.last_schedule in PAUSE_MP:
                routers.update(id(p) for p in m.router.parameters())
    world, ep = [], []
    for p in model.parameters():
        if p.grad is None or id(p) in experts:
            continue
        (world if id(p) in routers else ep).append(p)
    _all_reduce_grads(world, groups.world_group)
    _all_reduce_grads(ep, groups.ep_group)


def _all_reduce_grads(params: list[nn.Parameter], group: Any) -> None:
    if not params or dist.get_world_size(group) == 1:
        return
    grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
