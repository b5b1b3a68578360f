"""The training step's gradient reductions: the dense all-reduce, and the global norm with
clipping (`poise.train.loop` calls both, in that order, around the Balancer's Agg).

    summed = sync_dense(dense, scalars, world, device)          # [n] scalars summed too
    norm = clip_global_norm(model, dense, ep, ep_group, device, clip)

Dense parameters are replicated on every rank, so their gradients are summed over the world in
one all-reduce, the step's scalars (loss sums, dropped assignments) riding along. Expert
gradients are already complete in their home slots (the dispatcher's backward and Agg), so the
norm sums each expert once: its home slot's squares, over the EP group (with a layout every EP
group holds every expert). Squares are summed per tensor in float64 (`poise.nn.grad_norm`).

Under FSDP2 (`fsdp: true`, `poise.nn.fsdp.shard_dense`) the dense parameters are `DTensor`s whose
gradients FSDP has already summed into each rank's shard (divide factor 1): `sync_dense` leaves
them out (its all-reduce carries the scalars, and any dense parameter FSDP does not hold), the
norm sums their shards' squares over the mesh, and clipping scales the local shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from poise.nn import comm
from poise.nn.comm import comm_device
from poise.nn.fsdp import is_dtensor, local_tensor
from poise.nn.grad_norm import squared_norm, squared_norm_sum
from poise.nn.moe import find_moe_layers


def sync_dense(
    dense: list[torch.nn.Parameter], stats: torch.Tensor, world: int, device: torch.device
) -> torch.Tensor:
    """Sum the `dense` parameters' gradients (a missing one as zeros) and `stats [n]` over the
    world in one all-reduce; the gradients are replaced by the sums, the summed `stats`
    returned (unchanged on one rank). DTensor parameters (FSDP's: reduced already) are left
    out."""
    dense = [p for p in dense if not is_dtensor(p)]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
    if world == 1:
        return stats
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [stats.float().reshape(-1)])
    buf = flat.to(comm_device(None, device))
    comm.all_reduce(buf)
    flat = buf.to(device)
    offset = 0
    for p, g in zip(dense, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
        offset += n
    return flat[offset:]


def clip_global_norm(
    model: torch.nn.Module,
    dense: list[torch.nn.Parameter],
    ep: int,
    ep_group: dist.ProcessGroup | None,
    device: torch.device,
    clip: float,
) -> float:
    """The global gradient norm (the `dense` gradients once; each MoE layer's home slots, the
    leading ones, summed over `ep_group` when `ep` > 1: replica and empty slots hold no gradient
    of their own); every gradient of `model` scaled in place to norm `clip` when above it
    (`clip` 0: never)."""
    # plain gradients as they are, FSDP's DTensor shards summed over their mesh
    dense_sq = squared_norm_sum((p.grad for p in dense if p.grad is not None), device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    for moe in find_moe_layers(model):
        homes = int(moe.routing.slots.home.sum())  # the leading slots (`slot_maps`)
        for w in moe.experts.weights():
            if w.grad is not None:
                expert_sq += squared_norm(w.grad[:homes])
    if ep > 1:  # each expert once: over the EP group (the world without a layout)
        t = expert_sq.to(comm_device(ep_group, device))
        comm.all_reduce(t, group=ep_group)
        expert_sq = t.to(device)
    norm = float((dense_sq + expert_sq).sqrt())
    if clip > 0 and norm > clip:
        scale = clip / (norm + 1e-6)
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, scale)
    return norm


__all__ = ["clip_global_norm", "sync_dense"]
