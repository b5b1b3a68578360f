"""Expert rows between the ranks of one host through shared memory, not the process group:
gloo sends every byte through TCP sockets, even between processes of one machine, far slower
than copying the rows (as NCCL uses shared memory or NVLink within a node, this is that path).

    link = HostLink.connect(group)             # collective; None where the ranks span hosts
    channel = link.channel("trans-3")           # one per call site (a layer's Trans, its Agg)
    sent = channel.start(numel, write, dtype)   # numel [W, W] elements between every two ranks
    received = sent.wait()                      # [W] views of what each rank sent this one

Each rank owns one region per channel (a file under `/dev/shm`, mapped by every rank, unlinked
once mapped), cut in two halves used by turns. `start` writes this rank's rows into its half
at offsets every rank computes from `numel` alone (`segment_offsets`), then launches a
one-element all-reduce as the barrier; `wait` waits for it and returns views into the senders'
halves (no copy).

Two halves suffice: a rank writes turn `n + 2` into turn `n`'s half only after turn `n + 1`'s
barrier, which every rank reaches by starting turn `n + 1`, and a rank starts a turn only once
it has read (`wait`) or copied out (`start` does) the one before. The barrier also orders the
writes before the reads. A region grows, collectively (every rank has the same `numel`), to the
next power of two when a turn needs more; it never shrinks. Regions are reserved when made
(`posix_fallocate`); where some rank cannot reserve or map one (a small `/dev/shm`), every rank
turns the channel off together and `start` returns None from then on: `exchange` then moves
those rows through the group.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from poise.nn import comm

ALIGN = 64  # bytes: each destination's segment starts on a cache line

Writer = Callable[[int, torch.Tensor], None]
"""`write(dst, out)`: fill the flat `out` with the rows for rank `dst`."""


def shm_dir() -> Path:
    """Where the regions' files live: `/dev/shm`, memory-backed and local to the host (a network
    file system is neither)."""
    return Path("/dev/shm")


def _map(path: Path, size: int, create: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """Map `size` bytes of the file at `path` as a uint8 tensor sharing the mapping. `create`:
    make the file and reserve its blocks (`posix_fallocate` where the OS has it), so a full
    `/dev/shm` fails here with `OSError`, not later with SIGBUS on a write."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        elif create:
            os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def segment_offsets(numel: np.ndarray, itemsize: int) -> np.ndarray:
    """`[W, W]` byte offsets: where, in sender s's half, the segment for destination d starts
    (`numel[s, :d]` elements before it, each segment rounded up to `ALIGN` bytes)."""
    size = -(-np.asarray(numel, dtype=np.int64) * itemsize // ALIGN) * ALIGN
    return np.concatenate([np.zeros((size.shape[0], 1), np.int64), np.cumsum(size, 1)[:, :-1]], 1)


def half_bytes(numel: np.ndarray, itemsize: int) -> int:
    """The bytes the largest sender's half needs for `numel [W, W]`."""
    size = -(-np.asarray(numel, dtype=np.int64) * itemsize // ALIGN) * ALIGN
    return int(size.sum(axis=1).max()) if size.size else 0


@dataclass
class HostTransfer:
    """One turn in flight: `wait()` returns, per source rank, a view of the elements it sent
    this rank (`None` for itself and for ranks that sent nothing)."""

    work: dist.Work | None
    views: list[torch.Tensor | None]
    flag: torch.Tensor | None = None  # the barrier's tensor, alive until it completes
    read: bool = False  # the caller has had the views (and reads them at once)

    def wait(self) -> list[torch.Tensor | None]:
        self._barrier()
        self.read = True
        return self.views

    def keep(self) -> None:
        """Copy the views out of the senders' regions, freeing their half for the turn after
        next (a turn started before this one is read)."""
        self._barrier()
        self.views = [None if v is None else v.clone() for v in self.views]

    def _barrier(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


@dataclass
class Channel:
    """One call site's regions (module docstring). Every rank of the link must use its
    channels in the same order (they issue collectives on the group)."""

    link: HostLink
    key: str
    half: int = 0  # bytes per half
    turns: int = 0
    peers: list[torch.Tensor] = field(default_factory=list)  # [W] each rank's region
    _maps: list[mmap.mmap] = field(default_factory=list)
    _last: HostTransfer | None = None
    disabled: bool = False  # some rank could not reserve a region: rows go another way

    def start(self, numel: np.ndarray, write: Writer, dtype: torch.dtype) -> HostTransfer | None:
        """Write this rank's `numel[rank, d]` elements of `dtype` for every destination d
        (`write`; `numel [W, W]` the same on every rank) and launch the turn's barrier. None, on
        every rank, when the channel is off (`disabled`): the caller moves the rows another way."""
        if self.disabled:
            return None
        if self._last is not None and not self._last.read:
            self._last.keep()  # every turn is read before the next starts (two halves suffice)
        link, rank = self.link, self.link.rank
        numel = np.asarray(numel, dtype=np.int64)
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = half_bytes(numel, itemsize)
        if need > self.half and not self._grow(need):
            return None
        base = (self.turns % 2) * self.half
        self.turns += 1
        offsets = segment_offsets(numel, itemsize)

        def segment(src: int, dst: int) -> torch.Tensor | None:
            """What `src` sends `dst`, in `src`'s half (None to itself, or when nothing)."""
            n = int(numel[src, dst])
            if src == dst or n == 0:
                return None
            at = base + int(offsets[src, dst])
            return self.peers[src][at : at + n * itemsize].view(dtype)

        for dst in range(link.world):
            if (out := segment(rank, dst)) is not None:
                write(dst, out)
        flag = torch.zeros(1)  # one per turn: turns of several channels are in flight at once
        work = comm.all_reduce(flag, group=link.group, async_op=True)
        views = [segment(src, rank) for src in range(link.world)]
        self._last = HostTransfer(work, views, flag)
        return self._last

    def _grow(self, need: int) -> bool:
        """Replace this channel's regions by ones of `2 * half` bytes, `half` the next power of
        two >= `need`. Collective; False, and the channel `disabled` on every rank, when some
        rank could not reserve or map them (containers often give `/dev/shm` 64 MiB)."""
        link = self.link
        half = 1 << max(12, (need - 1).bit_length())
        name = f"{link.prefix}-{self.key}-{half}"
        path = shm_dir() / f"{name}-{link.rank}"
        mine = None
        try:
            with contextlib.suppress(OSError):
                mine = _map(path, 2 * half, create=True)
            if not link.agree(mine is not None):  # every rank's file exists
                self.disabled = True
                return False
            regions: list[tuple[mmap.mmap, torch.Tensor]] = []
            with contextlib.suppress(OSError):
                for r in range(link.world):
                    peer = shm_dir() / f"{name}-{r}"
                    regions.append(mine if r == link.rank else _map(peer, 2 * half, create=False))
            if not link.agree(len(regions) == link.world):  # every rank has mapped every file
                self.disabled = True
                return False
        finally:
            path.unlink(missing_ok=True)
        self.half = half
        self._maps, self.peers = [m for m, _ in regions], [t for _, t in regions]
        return True


class HostLink:
    """Shared-memory channels among the ranks of `group` (module docstring); make it with
    `connect`."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int, prefix: str):
        self.group = group
        self.rank = rank
        self.world = world
        self.prefix = prefix
        self.channels: dict[str, Channel] = {}

    @classmethod
    def connect(cls, group: dist.ProcessGroup | None = None) -> HostLink | None:
        """Collective over a gloo `group`: a link when every rank maps the same shared memory
        as its rank 0 (checked by reading a file rank 0 writes, not by host names, which
        containers repeat), else None."""
        if not dist.is_initialized() or dist.get_backend(group) != "gloo":
            return None
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if world < 2:
            return None
        token = torch.zeros(2, dtype=torch.int64)
        if rank == 0:
            token[0] = secrets.randbits(62)
        root = 0 if group is None else dist.get_global_rank(group, 0)
        comm.broadcast(token, src=root, group=group)
        prefix = f"poise-{int(token[0]):016x}"
        probe = shm_dir() / f"{prefix}-probe"
        if rank == 0:
            with contextlib.suppress(OSError):  # no /dev/shm, or unwritable: no rank reads it
                probe.write_text(prefix)
        comm.barrier(group=group)
        ok = False
        with contextlib.suppress(OSError):
            ok = probe.read_text() == prefix
        link = cls(group, rank, world, prefix)
        seen = link.agree(ok)  # every rank read it
        if rank == 0:
            probe.unlink(missing_ok=True)
        return link if seen else None

    def agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank of the group (collective)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        comm.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(int(flag) == 1)

    def channel(self, key: str) -> Channel:
        """The channel named `key` (letters, digits, `-`), made on first use."""
        if key not in self.channels:
            if not key.replace("-", "").isalnum():
                raise ValueError(f"channel keys are letters, digits and '-', got {key!r}")
            self.channels[key] = Channel(self, key)
        return self.channels[key]


__all__ = ["ALIGN", "Channel", "HostLink", "HostTransfer", "half_bytes", "segment_offsets"]
