"""Compressed Trans: replicas filled with the shared expert plus each expert's top-k residual
(HybridEP's parameter-efficient migration, arXiv 2510.19470 §IV-B), on the ranks of one layer.

The shared expert (`shared_experts`, `[*row]` per tensor) is the mean of the E experts' home
rows: each rank sums its own, one `all_reduce` (SUM) adds the ranks' sums, so every rank holds
the same bits; bytes (all ranks, ring): `2 (D - 1) sum_t numel(row_t) b_v`. HybridEP
synchronises it every iteration; the Balancer refreshes it whenever a plan is applied and
reuses it for the Trans in between (one all-reduce per plan).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from poise.nn import comm
from poise.nn.slots import SlotMap
from poise.runtime.hybridep import compress as cz
from poise.runtime.moves.exchange import Pending, Routes, Stream, completed, exchange, trans_routes


@dataclass
class CompressedPending(Pending):
    """A compressed Trans in flight. `total_bytes` includes the shared-expert all-reduce;
    `payload_bytes`: packed rows; `shared_bytes`: the all-reduce (0 when a shared expert was
    passed in); `dense_bytes`: the same rows uncompressed; `shared`: the shared expert used
    (one `[*row]` per tensor)."""

    payload_bytes: int = 0
    shared_bytes: int = 0
    dense_bytes: int = 0
    shared: list[torch.Tensor] = field(default_factory=list)


def shared_experts(
    params: Sequence[torch.Tensor],
    maps: Sequence[SlotMap],
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[torch.Tensor], int]:
    """`([shared [*row] per tensor], bytes)`: the mean of the layer's experts' home rows of
    `params` (each `[S, *row]`), the same on every rank, and the all-reduce's bytes (all ranks,
    ring). Collective when `len(maps) > 1`."""
    m = maps[rank]
    experts = sum(int(np.count_nonzero(x.home & (x.expert >= 0))) for x in maps)
    home = torch.as_tensor(np.flatnonzero(m.home & (m.expert >= 0)), device=params[0].device)
    with torch.no_grad():
        total = torch.cat([p.detach().index_select(0, home).sum(dim=0).reshape(-1) for p in params])
    world = len(maps)
    moved = 0
    if world > 1:
        comm.all_reduce(total, group=group)
        moved = 2 * (world - 1) * total.numel() * total.element_size()
    total /= max(experts, 1)
    sizes = [math.prod(p.shape[1:]) for p in params]
    return [x.view(p.shape[1:]) for x, p in zip(total.split(sizes), params, strict=True)], moved


def trans_compressed_async(
    params: Sequence[torch.Tensor],
    maps: Sequence[SlotMap],
    rank: int,
    ratio: float,
    *,
    shared: Sequence[torch.Tensor] | None = None,
    group: dist.ProcessGroup | None = None,
    routes: Routes | None = None,
) -> CompressedPending:
    """Start a compressed Trans of `params` (each `[S, *row]`): one `exchange` of each
    replica's packed row (`compress.encode`, `compress.pack`); at `wait()` the receiver writes
    `shared + residual` into the replica slot. `shared`: the layer's shared expert, the same on
    sender and receiver: a previous call's `CompressedPending.shared`, or None to compute it now
    (`shared_experts`). Collective: all ranks, same maps, all passing a shared expert or none."""
    routes = routes if routes is not None else trans_routes(maps)
    params = list(params)
    shared_bytes = 0
    if shared is None:
        shared, shared_bytes = shared_experts(params, maps, rank, group=group)
    shared = list(shared)
    shapes = [tuple(p.shape[1:]) for p in params]
    widths = [cz.packed_bytes(s, ratio, p.dtype) for s, p in zip(shapes, params, strict=True)]
    offsets = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    slots = int(params[0].shape[0])
    payload = torch.zeros(slots, int(offsets[-1]), dtype=torch.uint8, device=params[0].device)
    mine = np.unique(routes.src_slot[routes.src_rank == rank])
    if mine.size:
        idx = torch.as_tensor(mine, device=params[0].device)
        with torch.no_grad():
            for i, (p, s) in enumerate(zip(params, shared, strict=True)):
                enc = cz.encode(p.detach().index_select(0, idx), s, ratio)
                payload[idx, offsets[i] : offsets[i + 1]] = cz.pack(enc)

    def sink(dst: torch.Tensor, rows: list[torch.Tensor]) -> None:
        buf = rows[0]
        with torch.no_grad():
            for i, (p, s) in enumerate(zip(params, shared, strict=True)):
                enc = cz.unpack(buf[:, offsets[i] : offsets[i + 1]], shapes[i], ratio, p.dtype)
                p.index_copy_(0, dst, cz.decode(enc, s))

    world = len(maps)
    pending = exchange([Stream(routes, [payload], sink)], rank, world, group=group, async_op=True)
    dense_row = sum(math.prod(s) * p.element_size() for s, p in zip(shapes, params, strict=True))
    return CompressedPending(
        sent_bytes=pending.sent_bytes,
        received_bytes=pending.received_bytes,
        total_bytes=pending.total_bytes + shared_bytes,
        _finish=pending.wait,
        payload_bytes=pending.total_bytes,
        shared_bytes=shared_bytes,
        dense_bytes=dense_row * routes.remote_rows(),
        shared=shared,
    )


trans_compressed = completed(trans_compressed_async)


__all__ = ["CompressedPending", "shared_experts", "trans_compressed", "trans_compressed_async"]
