"""Trans, Agg and migration: moving expert rows between the slots of the ranks of one layer.

- Trans (`trans`, `trans_async`): each replica slot gets its home's current weights.
- Agg (`agg`, `agg_async`): each home slot's gradient gains the sum of its replicas' gradients,
  added in ascending rank of the replica holder (a deterministic sum); replica gradients become
  zero, so the optimizer's mathematics on the owner is exactly that of static EP.
- Migration (`migrate`): a new placement takes effect. Each new home slot gets the old home's
  weights and optimizer moments (every state tensor shaped like the parameter: AdamW's
  `exp_avg`, `exp_avg_sq`); each replica slot gets the weights and zero moments; empty slots
  become zero. Per-tensor step counts are untouched (every rank steps every tensor).

Each is one `exchange` per layer (`poise.runtime.moves.exchange`: routes from the slot maps,
one packed all-to-all; its names are re-exported here). The `*_async` variants return a
`Pending` whose `wait()` finishes the transfer, so Trans of layer l+1 can run under layer l's
forward and Agg under the backward of earlier layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from poise.nn.slots import SlotMap

# `exchange` is called through this module's globals: `poise.train.faults` patches it here
from poise.runtime.moves.exchange import (
    LINK_MAX_BYTES,
    Pending,
    Routes,
    Scratch,
    Sink,
    Stream,
    TransferError,
    _index,
    agg_routes,
    exchange,
    gather_rows,
    home_slots,
    migration_routes,
    pair_numel,
    trans_routes,
)
from poise.runtime.moves.host_link import Channel


# --------------------------------------------------------------------------------- Trans/Agg
def trans_async(
    params: Sequence[torch.Tensor],
    maps: Sequence[SlotMap],
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    routes: Routes | None = None,
    link: Channel | None = None,
) -> Pending:
    """Start Trans: every replica slot of `params` (each `[S, ...]`) receives its home's rows,
    written at `wait()`. `routes`: `trans_routes(maps)`, passed to skip recomputing them each
    step; `link`: through shared memory (`exchange`)."""
    routes = routes if routes is not None else trans_routes(maps)
    targets = list(params)

    def sink(dst: torch.Tensor, rows: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, x in zip(targets, rows, strict=True):
                t.index_copy_(0, dst, x)

    stream = Stream(routes, targets, sink)
    return exchange([stream], rank, len(maps), group=group, async_op=True, link=link)


def trans(
    params: Sequence[torch.Tensor],
    maps: Sequence[SlotMap],
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    routes: Routes | None = None,
) -> Pending:
    """Trans, completed before returning (the returned `Pending` carries the byte counts)."""
    pending = trans_async(params, maps, rank, group=group, routes=routes)
    pending.wait()
    return pending


def agg_async(
    grads: Sequence[torch.Tensor],
    maps: Sequence[SlotMap],
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    routes: Routes | None = None,
    link: Channel | None = None,
) -> Pending:
    """Start Agg on gradients `grads` (each `[S, ...]`, laid out as the parameters). Replica
    rows are packed and zeroed now, so gradients accumulated into them later (a further
    micro-batch) are not lost; at `wait()` each home row gains its replicas' rows in ascending
    rank of the sender. `routes` defaults to `agg_routes(maps)`; `link` as in `trans_async`."""
    routes = routes if routes is not None else agg_routes(maps)
    targets = list(grads)

    def sink(dst: torch.Tensor, rows: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, x in zip(targets, rows, strict=True):
                t.index_add_(0, dst, x)

    pending = exchange(
        [Stream(routes, targets, sink)], rank, len(maps), group=group, async_op=True, link=link
    )
    mine = routes.src_slot[routes.src_rank == rank]
    if mine.size:
        with torch.no_grad():
            for t in targets:
                t.index_fill_(0, _index(mine, t), 0.0)
    return pending


def agg(
    grads: Sequence[torch.Tensor],
    maps: Sequence[SlotMap],
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    routes: Routes | None = None,
) -> Pending:
    """Agg, completed before returning."""
    pending = agg_async(grads, maps, rank, group=group, routes=routes)
    pending.wait()
    return pending


# --------------------------------------------------------------------------------- migration
@dataclass(frozen=True)
class Migration:
    """What `migrate` moved. `home_*`: rows that became homes elsewhere (weights and optimizer
    state); `replica_*`: replica fills (weights). `*_bytes`: this rank's outgoing traffic;
    `*_total_bytes`: all ranks' together; `moved_homes`: experts whose home changed rank;
    `relaid_rows`/`relaid_bytes`: this rank's slots rewritten in place (weights and moments)."""

    home_bytes: int
    replica_bytes: int
    home_total_bytes: int
    replica_total_bytes: int
    moved_homes: int
    relaid_rows: int = 0
    relaid_bytes: int = 0


def state_tensors(
    optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Per parameter, its optimizer state tensors shaped like it (AdamW: `exp_avg`,
    `exp_avg_sq`), in key order; scalars such as `step` are left out."""
    out: list[list[torch.Tensor]] = []
    for p in params:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        out.append(
            [
                state[k]
                for k in sorted(state, key=str)
                if isinstance(state[k], torch.Tensor) and state[k].shape == p.shape
            ]
        )
    return out


def migrate(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    old_maps: Sequence[SlotMap],
    new_maps: Sequence[SlotMap],
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    fill_replicas: bool = True,
    link: Channel | None = None,
    link_max_bytes: int | None = None,
    scratch: Scratch | None = None,
) -> Migration:
    """Re-lay `params` (each `[S, ...]`) and their optimizer moments from `old_maps` to
    `new_maps`: one collective, plus a tiny one that checks every rank has the same state.

    Afterwards every held slot has its expert's current weights (replicas too: no Trans is
    needed), home slots the old home's moments, other slots zero moments, empty slots zero
    weights. Tensors are updated in place (the optimizer keeps its references). Only rows that
    change are touched: a home that keeps its rank and slot is neither copied nor rewritten;
    an arriving home's row is written once, other rewritten rows (replica, empty) are cleared.

    `fill_replicas=False`: homes only, replica slots left zero (the compressed Trans fills
    them, `poise.runtime.moves.compressed_trans`). `link`, `link_max_bytes`: through shared
    memory as in `exchange`. `scratch`: reused buffers for the packed rows (`Scratch`; the
    caller keeps it between switches)."""
    params = list(params)
    moments = state_tensors(optimizer, params)
    _check_same_state(moments, group)
    homes, replicas = migration_routes(old_maps, new_maps)
    if not fill_replicas:
        replicas = Routes.build([])
    staying = (homes.src_rank == homes.dst_rank) & (homes.src_slot == homes.dst_slot)
    moving = homes.select(~staying)
    kept = homes.dst_slot[staying & (homes.dst_rank == rank)]
    slots = int(params[0].shape[0]) if params else 0
    rewritten = np.setdiff1d(np.arange(slots), kept)
    # an arriving home's row is written whole (weights and moments): not cleared first
    cleared = np.setdiff1d(rewritten, moving.dst_slot[moving.dst_rank == rank])
    flat_moments = [m for ms in moments for m in ms]
    every = [*params, *flat_moments]

    def write(targets: list[torch.Tensor]) -> Sink:
        def sink(dst: torch.Tensor, rows: list[torch.Tensor]) -> None:
            for t, x in zip(targets, rows, strict=True):
                t.index_copy_(0, dst, x)

        return sink

    with torch.no_grad():
        streams = [Stream(moving, every, write(every)), Stream(replicas, params, write(params))]
        pending = exchange(
            streams, rank, len(new_maps), group=group, link=link, link_max_bytes=link_max_bytes,
            scratch=scratch,
        )  # source rows read now  # fmt: skip
        if cleared.size:
            clear = torch.as_tensor(cleared, dtype=torch.long, device=params[0].device)
            for t in every:
                t.index_fill_(0, clear.to(t.device), 0.0)
        pending.wait()
    home_row = streams[0].row_bytes()
    replica_row = streams[1].row_bytes()
    return Migration(
        home_bytes=home_row * int(np.count_nonzero(_leaving(homes, rank))),
        replica_bytes=replica_row * int(np.count_nonzero(_leaving(replicas, rank))),
        home_total_bytes=home_row * homes.remote_rows(),
        replica_total_bytes=replica_row * replicas.remote_rows(),
        moved_homes=homes.remote_rows(),
        relaid_rows=int(rewritten.size),
        relaid_bytes=home_row * int(rewritten.size),
    )


def _leaving(routes: Routes, rank: int) -> np.ndarray:
    return (routes.src_rank == rank) & (routes.dst_rank != rank)


def _check_same_state(moments: list[list[torch.Tensor]], group: dist.ProcessGroup | None) -> None:
    """Every rank must move the same number of state tensors, or the packed rows disagree."""
    if not dist.is_available() or not dist.is_initialized():
        return
    n = sum(len(ms) for ms in moments)
    device = moments[0][0].device if n else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([n, -n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != -int(t[1]):
        raise TransferError(
            f"ranks hold different optimizer state ({-int(t[1])} to {int(t[0])} tensors; this "
            f"rank {n}): step every rank's optimizer before migrating",
            field="optimizer.state",
        )


__all__ = [
    "LINK_MAX_BYTES",
    "Migration",
    "Pending",
    "Routes",
    "Scratch",
    "Sink",
    "Stream",
    "TransferError",
    "agg",
    "agg_async",
    "agg_routes",
    "exchange",
    "gather_rows",
    "home_slots",
    "migrate",
    "migration_routes",
    "pair_numel",
    "state_tensors",
    "trans",
    "trans_async",
    "trans_routes",
]
