"""Trans, Agg and migration: moving expert rows between the slots of the ranks of one layer.

- Trans (`trans`, `trans_async`): each replica slot gets its home's current weights.
- Agg (`agg_async`): each home slot's gradient gains the sum of its replicas' gradients,
  added in ascending rank of the replica holder (a deterministic sum); replica gradients become
  zero, so the optimizer's mathematics on the owner is exactly that of static EP.
- Migration (`migrate`): a new placement takes effect. Each new home slot gets the old home's
  weights and optimizer moments (every state tensor shaped like the parameter: AdamW's
  `exp_avg`, `exp_avg_sq`); each replica slot gets the weights and zero moments; empty slots
  become zero. Per-tensor step counts are untouched (every rank steps every tensor).

Each is one `exchange` per layer (`poise.runtime.moves.exchange`). The `*_async` variants
return a `Pending` whose `wait()` finishes the transfer, so Trans of layer l+1 can run under
layer l's forward and Agg under the backward of earlier layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from poise.nn import comm
from poise.nn.slots import SlotMap

# `exchange` is called through this module's globals: `poise.train.faults` patches it here
from poise.runtime.moves.exchange import (
    Pending,
    Routes,
    Scratch,
    Sink,
    Stream,
    TransferError,
    _index,
    agg_routes,
    completed,
    exchange,
    migration_routes,
    trans_routes,
)
from poise.runtime.moves.host_link import Channel


def _sink(targets: list[torch.Tensor], add: bool = False) -> Sink:
    """Copies (`add`: adds) the received rows into their slots of `targets`."""

    def sink(dst: torch.Tensor, rows: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, x in zip(targets, rows, strict=True):
                (t.index_add_ if add else t.index_copy_)(0, dst, x)

    return sink


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
    stream = Stream(routes, targets, _sink(targets))
    return exchange([stream], rank, len(maps), group=group, async_op=True, link=link)


trans = completed(trans_async)


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
    micro-batch) are not lost; they are added into their home rows at `wait()`. `routes`
    defaults to `agg_routes(maps)`; `link` as in `trans_async`."""
    routes = routes if routes is not None else agg_routes(maps)
    targets = list(grads)
    stream = Stream(routes, targets, _sink(targets, add=True))
    pending = exchange([stream], rank, len(maps), group=group, async_op=True, link=link)
    mine = routes.src_slot[routes.src_rank == rank]
    if mine.size:
        with torch.no_grad():
            for t in targets:
                t.index_fill_(0, _index(mine, t), 0.0)
    return pending


# --------------------------------------------------------------------------------- migration
@dataclass(frozen=True)
class Migration:
    """What `migrate` moved. `home_bytes`: this rank's outgoing home rows (weights and
    optimizer state); `home_total_bytes`: all ranks' together; `moved_homes`: experts whose
    home changed rank; `relaid_rows`/`relaid_bytes`: this rank's slots rewritten in place
    (weights and moments)."""

    home_bytes: int
    home_total_bytes: int
    moved_homes: int
    relaid_rows: int = 0
    relaid_bytes: int = 0


class HasState(Protocol):
    """What migration reads of an optimizer: `state[p]`, a dict per parameter (a torch
    optimizer, or `optimizer_state.ExpertStates` over a container of them)."""

    @property
    def state(self) -> Mapping[Any, Any]: ...


def state_tensors(
    optimizer: HasState | None, params: Sequence[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Per parameter, its optimizer state tensors shaped like it (AdamW: `exp_avg`,
    `exp_avg_sq`), in key order; scalars such as `step` are left out."""
    out: list[list[torch.Tensor]] = []
    for p in params:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        values = [state[k] for k in sorted(state, key=str)]
        out.append([v for v in values if isinstance(v, torch.Tensor) and v.shape == p.shape])
    return out


def migrate(
    params: Sequence[torch.Tensor],
    optimizer: HasState | None,
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
    `new_maps` (module docstring) in place, the optimizer keeping its references: one
    collective, plus a tiny one that checks every rank has the same state. Only rows that
    change are touched: a home that keeps its rank and slot is neither copied nor rewritten; an
    arriving home's row is written once, other rewritten rows (replica, empty) are cleared.
    `fill_replicas=False`: homes only, replica slots left zero (the compressed Trans fills
    them). `link`, `link_max_bytes`, `scratch` (kept by the caller between switches): as in
    `exchange`."""
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
    every = [*params, *(m for ms in moments for m in ms)]
    with torch.no_grad():
        streams = [Stream(moving, every, _sink(every)), Stream(replicas, params, _sink(params))]
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
    leaving = (homes.src_rank == rank) & (homes.dst_rank != rank)
    return Migration(
        home_bytes=home_row * int(np.count_nonzero(leaving)),
        home_total_bytes=home_row * homes.remote_rows(),
        moved_homes=homes.remote_rows(),
        relaid_rows=int(rewritten.size),
        relaid_bytes=home_row * int(rewritten.size),
    )


def _check_same_state(moments: list[list[torch.Tensor]], group: dist.ProcessGroup | None) -> None:
    """Every rank must move the same number of state tensors, or the packed rows disagree."""
    if not dist.is_available() or not dist.is_initialized():
        return
    n = sum(len(ms) for ms in moments)
    device = moments[0][0].device if n else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([n, -n], dtype=torch.long, device=device)
    comm.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != -int(t[1]):
        raise TransferError(
            f"ranks hold different optimizer state ({-int(t[1])} to {int(t[0])} tensors; this "
            f"rank {n}): step every rank's optimizer before migrating",
            field="optimizer.state",
        )


__all__ = ["HasState", "Migration", "agg_async", "migrate", "state_tensors", "trans", "trans_async"]
