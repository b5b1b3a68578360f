"""Expert rows between the slots of one layer's ranks: routes and one packed all-to-all.

Every rank holds a layer's experts as stacked tensors, one row per slot (`w_in [S, D, H]`,
`w_gate [S, D, H]`, `w_out [S, H, D]`); the layer's `SlotMap` on that rank says which expert a
slot holds (`poise.nn.slots`). All ranks derive the same maps from the same plan, so each rank
works out alone which rows it sends where and which it receives (`Routes`); `exchange` moves
them. Trans, Agg and migration (`poise.runtime.moves.transfers`) are built on it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from poise.core.errors import PoiseError
from poise.nn import comm
from poise.nn.slots import SlotMap
from poise.runtime.moves.host_link import Channel, half_bytes

Sink = Callable[[torch.Tensor, list[torch.Tensor]], None]
"""Receives rows: `sink(dst_slots[n], rows)` with one `[n, ...]` tensor per stream tensor."""


class TransferError(PoiseError):
    """Slot maps or tensors that a transfer cannot work with (no home, shapes that disagree)."""


# ------------------------------------------------------------------------------------ routes
@dataclass(frozen=True)
class Routes:
    """Row i goes from slot `src_slot[i]` of rank `src_rank[i]` to slot `dst_slot[i]` of rank
    `dst_rank[i]` (all `[N]` int64), sorted by (src_rank, dst_rank, dst_slot) so that sender and
    receiver list the rows of one pair of ranks in the same order."""

    src_rank: np.ndarray
    src_slot: np.ndarray
    dst_rank: np.ndarray
    dst_slot: np.ndarray

    @classmethod
    def build(cls, rows: list[tuple[int, int, int, int]]) -> Routes:
        """From `(src_rank, src_slot, dst_rank, dst_slot)` tuples in any order."""
        a = np.array(rows, dtype=np.int64).reshape(-1, 4)
        a = a[np.lexsort((a[:, 3], a[:, 2], a[:, 0]))]
        return cls(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy())

    def __len__(self) -> int:
        return int(self.src_rank.shape[0])

    def between(self, src: int, dst: int) -> np.ndarray:
        """`[n]` indices of the rows going from rank `src` to rank `dst`, in route order."""
        return np.nonzero((self.src_rank == src) & (self.dst_rank == dst))[0]

    def remote_rows(self) -> int:
        """Rows that cross between two different ranks (all ranks together)."""
        return int(np.count_nonzero(self.src_rank != self.dst_rank))

    def swapped(self) -> Routes:
        """The same rows travelling the other way."""
        return Routes.build(
            list(zip(self.dst_rank, self.dst_slot, self.src_rank, self.src_slot, strict=True))
        )

    def select(self, mask: np.ndarray) -> Routes:
        return Routes(
            self.src_rank[mask], self.src_slot[mask], self.dst_rank[mask], self.dst_slot[mask]
        )


def home_slots(maps: Sequence[SlotMap]) -> dict[int, tuple[int, int]]:
    """`{expert: (rank, slot)}` of each held expert's home. `TransferError` when an expert held
    somewhere has no home, or two."""
    homes: dict[int, tuple[int, int]] = {}
    held: set[int] = set()
    for rank, m in enumerate(maps):
        held.update(int(e) for e in m.expert[m.expert >= 0])
        for slot in np.flatnonzero(m.home & (m.expert >= 0)):
            expert = int(m.expert[slot])
            if expert in homes:
                raise TransferError(f"expert {expert} has two homes", field="slots.home")
            homes[expert] = (rank, int(slot))
    missing = sorted(held - homes.keys())
    if missing:
        raise TransferError(f"experts {missing} are held but have no home", field="slots.home")
    return homes


def trans_routes(maps: Sequence[SlotMap]) -> Routes:
    """Home slot -> every replica slot of the same expert."""
    homes = home_slots(maps)
    rows = []
    for rank, m in enumerate(maps):
        for slot in np.nonzero((m.expert >= 0) & ~m.home)[0]:
            src_rank, src_slot = homes[int(m.expert[slot])]
            rows.append((src_rank, src_slot, rank, int(slot)))
    return Routes.build(rows)


def agg_routes(maps: Sequence[SlotMap]) -> Routes:
    """Replica slot -> its expert's home slot (Trans travelling back)."""
    return trans_routes(maps).swapped()


def migration_routes(
    old_maps: Sequence[SlotMap], new_maps: Sequence[SlotMap]
) -> tuple[Routes, Routes]:
    """`(homes, replicas)`: every slot of `new_maps` filled from the expert's home in
    `old_maps`; `homes` are the rows that become homes (they carry optimizer state)."""
    if len(old_maps) != len(new_maps):
        raise TransferError(
            f"{len(old_maps)} old slot maps but {len(new_maps)} new", field="slots.ranks"
        )
    old_homes = home_slots(old_maps)
    home_slots(new_maps)  # the new maps must be consistent too
    homes, replicas = [], []
    for rank, m in enumerate(new_maps):
        for slot in np.nonzero(m.expert >= 0)[0]:
            expert = int(m.expert[slot])
            if expert not in old_homes:
                raise TransferError(
                    f"expert {expert} has no home in the old placement", field="slots.home"
                )
            src_rank, src_slot = old_homes[expert]
            (homes if m.home[slot] else replicas).append((src_rank, src_slot, rank, int(slot)))
    return Routes.build(homes), Routes.build(replicas)


# ---------------------------------------------------------------------------------- exchange
@dataclass
class Stream:
    """Rows of `sources` (each `[S, ...]`) moving along `routes`; `sink` places received rows."""

    routes: Routes
    sources: list[torch.Tensor]
    sink: Sink

    def row_numel(self) -> int:
        return sum(_row_numel(t) for t in self.sources)

    def row_bytes(self) -> int:
        return sum(_row_numel(t) * t.element_size() for t in self.sources)


def _row_numel(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


@dataclass
class Pending:
    """A transfer in flight; `wait()` completes it (idempotent). `sent_bytes`/`received_bytes`:
    this rank's traffic to and from other ranks; `total_bytes`: all ranks' together."""

    sent_bytes: int
    received_bytes: int
    total_bytes: int
    _finish: Callable[[], None] | None = None

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


P = ParamSpec("P")
T = TypeVar("T", bound=Pending)


def completed(start: Callable[P, T]) -> Callable[P, T]:
    """The `*_async` transfer `start` as one that finishes before returning its `Pending`."""

    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        """The transfer, completed before returning (its `Pending` carries the byte counts)."""
        pending = start(*args, **kwargs)
        pending.wait()
        return pending

    return run


# The most one rank sends in one call through shared memory: a channel's region is twice that
# and is kept for the run, so a larger call goes through the group.
LINK_MAX_BYTES = 128 * 2**20


def exchange(
    streams: Sequence[Stream],
    rank: int,
    world_size: int,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    link: Channel | None = None,
    link_max_bytes: int | None = None,
    scratch: Scratch | None = None,
) -> Pending:
    """Move the rows of every stream (weights, moments) with one `all_to_all_single` on `group`
    with variable splits (each peer's rows packed into one flat buffer, rows that stay on a rank
    copied locally, no collective where no row crosses ranks). Every rank must call it with
    streams built from the same routes. `link`: through shared memory instead (a `HostLink`
    channel of the same ranks) where the largest sender's rows fit in `link_max_bytes` (default
    `LINK_MAX_BYTES`), which every rank decides from the routes alone. `scratch`: pack into its
    reused buffers where the rows are on the CPU and the call is synchronous. Rows are read
    (copied) from the sources now; sinks run at `wait()`, one source rank at a time in ascending
    order (the local rows at this rank's turn), so additive sinks sum in a fixed order."""
    _check_streams(streams)
    dtype = _buffer_dtype(streams)
    numel = pair_numel(streams, world_size)
    nbytes = pair_numel(streams, world_size, in_bytes=True)
    sent, received, total = int(nbytes[rank].sum()), int(nbytes[:, rank].sum()), int(nbytes.sum())
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(world_size)]
    local: list[tuple[Stream, torch.Tensor, list[torch.Tensor]]] = []
    for stream in streams:
        r = stream.routes
        for peer in range(world_size):
            out = r.between(rank, peer)
            if not out.size:
                continue
            src = r.src_slot[out]
            if peer == rank:
                rows = [t.detach().index_select(0, _index(src, t)) for t in stream.sources]
                local.append((stream, _index(r.dst_slot[out], rows[0]), rows))
            else:
                idx = _index(src, stream.sources[0])
                parts[peer].extend((t.detach(), idx) for t in stream.sources)

    def place(chunks: Sequence[torch.Tensor | None]) -> None:
        """Run the sinks: `chunks[peer]` what `peer` sent this rank (flat), in rank order."""
        for peer in range(world_size):
            if peer == rank:
                for stream, dst, rows in local:
                    stream.sink(dst, rows)
            elif chunks[peer] is not None:
                _unpack(streams, chunks[peer], peer, rank)

    if not any(s.routes.remote_rows() for s in streams):
        return Pending(0, 0, 0, lambda: place([None] * world_size))
    if link is not None:
        cap = LINK_MAX_BYTES if link_max_bytes is None else link_max_bytes
        # above the cap, the link's region would stay that large for the rest of the run
        if half_bytes(numel, torch.empty((), dtype=dtype).element_size()) <= cap:
            turn = link.start(numel, lambda dst, out: gather_rows(parts[dst], out), dtype)
            if turn is not None:
                return Pending(sent, received, total, lambda: place(turn.wait()))
    device = streams[0].sources[0].device
    send_numel, recv_numel = numel[rank].tolist(), numel[:, rank].tolist()
    # a fresh `Scratch` where there is none to reuse: its buffers are new
    reuse = scratch if scratch is not None and not async_op and device.type == "cpu" else Scratch()
    send = reuse.take("send", sum(send_numel), dtype, device)
    for items, buf in zip(parts, send.split(send_numel), strict=True):
        if items:
            gather_rows(items, buf)
    recv = reuse.take("recv", sum(recv_numel), dtype, device)
    work = comm.all_to_all_single(
        recv, send, recv_numel, send_numel, group=group, async_op=async_op
    )
    chunks = [c if p != rank and c.numel() else None for p, c in enumerate(recv.split(recv_numel))]

    def finish() -> None:
        if work is not None:
            work.wait()
        place(chunks)

    return Pending(sent, received, total, finish)


class Scratch:
    """Grow-only CPU buffers for the packed rows of synchronous exchanges (migrations), kept
    between calls: a fresh buffer above glibc's mmap threshold is mapped anew and page-faulted
    on first touch at every call. They stay as large as the largest call; CUDA's caching
    allocator already reuses its blocks, so only CPU rows use them."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A `[numel]` view of buffer `name`, reallocated where smaller or of another dtype or
        device; its contents are whatever the last call left."""
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or (buffer.dtype, buffer.device) != (dtype, device)
            or buffer.numel() < numel
        ):
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def gather_rows(items: Sequence[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
    """Write the rows `index` of each `(tensor [S, ...], index [n])` one after another into the
    flat `out`: one copy, no staging buffer."""
    at = 0
    for t, index in items:
        n = len(index) * _row_numel(t)
        dst = out[at : at + n].view(len(index), *t.shape[1:])
        if dst.dtype == t.dtype:
            torch.index_select(t, 0, index, out=dst)
        else:
            dst.copy_(t.index_select(0, index))
        at += n


def pair_numel(streams: Sequence[Stream], world_size: int, in_bytes: bool = False) -> np.ndarray:
    """`[W, W]` elements (`in_bytes`: bytes) every rank sends every other (zero diagonal), from
    the routes alone: the same on every rank."""
    numel = np.zeros((world_size, world_size), dtype=np.int64)
    for stream in streams:
        r = stream.routes
        row = stream.row_bytes() if in_bytes else stream.row_numel()
        np.add.at(numel, (r.src_rank, r.dst_rank), row)
    np.fill_diagonal(numel, 0)
    return numel


def _unpack(streams: Sequence[Stream], chunk: torch.Tensor, src: int, rank: int) -> None:
    """Hand the rows one peer sent to each stream's sink, in the order they were packed."""
    at = 0
    for stream in streams:
        r = stream.routes
        idx = r.between(src, rank)
        if not idx.size:
            continue
        rows = []
        for t in stream.sources:
            n = idx.size * _row_numel(t)
            rows.append(chunk[at : at + n].reshape(idx.size, *t.shape[1:]).to(t.dtype))
            at += n
        stream.sink(_index(r.dst_slot[idx], chunk), rows)


def _index(slots: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(slots, dtype=torch.long, device=like.device)


def _buffer_dtype(streams: Sequence[Stream]) -> torch.dtype:
    dtypes = [t.dtype for s in streams for t in s.sources]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def _check_streams(streams: Sequence[Stream]) -> None:
    for s in streams:
        if not s.sources:
            raise TransferError("a stream needs at least one tensor", field="tensors")
        slots = {int(t.shape[0]) for t in s.sources}
        if len(slots) != 1:
            raise TransferError(
                f"tensors disagree on the slot count: {sorted(slots)}", field="tensors"
            )
