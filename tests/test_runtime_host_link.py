"""Shared-memory channels between the ranks of one host (`poise.runtime.moves.host_link`).

Turns of random sizes (growing regions) and random data on 2 and 3 gloo ranks, with ranks that
read late or start a turn before reading the last: every rank must receive exactly what each
other rank wrote for it in that turn. The offsets are checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from poise.runtime.launch import run_ranks
from poise.runtime.moves.host_link import ALIGN, half_bytes, segment_offsets

TURNS = 12


def _turn(seed: int, turn: int, W: int) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """`numel [W, W]` (zero diagonal, some zero pairs, sizes up to ~64 KB) and the data
    `data[src][dst]` of one turn, the same on every rank."""
    rng = np.random.default_rng(1000 * seed + turn)
    numel = rng.integers(0, 4 ** rng.integers(1, 8), size=(W, W))
    numel[rng.random((W, W)) < 0.2] = 0
    np.fill_diagonal(numel, 0)
    data = [[rng.standard_normal(int(numel[s, d])).astype(np.float32) for d in range(W)]
            for s in range(W)]  # fmt: skip
    return numel, data


def _rank_turns(rank: int, W: int, seed: int) -> list[list[np.ndarray | None]]:
    import time

    import torch

    from poise.runtime.moves.host_link import HostLink

    link = HostLink.connect()
    assert link is not None
    channel = link.channel("test-0")
    got: list[list[np.ndarray | None]] = []
    pending = None
    for turn in range(TURNS):
        numel, data = _turn(seed, turn, W)

        def write(dst: int, out: torch.Tensor, data=data) -> None:
            out.copy_(torch.from_numpy(data[rank][dst]))

        started = channel.start(numel, write, torch.float32)
        if pending is not None:  # the turn before, read only now: `start` had to keep it
            got.append([None if v is None else v.numpy().copy() for v in pending.wait()])
            pending = None
        if (turn + rank) % 3 == 0:
            pending = started  # read after the next turn has started
            continue
        if (turn + rank) % 2:
            time.sleep(0.02)  # a late reader: the others run ahead into the next turn
        got.append([None if v is None else v.numpy().copy() for v in started.wait()])
    if pending is not None:
        got.append([None if v is None else v.numpy().copy() for v in pending.wait()])
    return got


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_turn_delivers_what_each_rank_wrote(world_size: int) -> None:
    seed = 7 + world_size
    results = run_ranks(_rank_turns, world_size, seed)
    for rank, got in enumerate(results):
        assert len(got) == TURNS
        for turn, views in enumerate(got):
            numel, data = _turn(seed, turn, world_size)
            for src in range(world_size):
                if src == rank or numel[src, rank] == 0:
                    assert views[src] is None
                else:
                    np.testing.assert_array_equal(views[src], data[src][rank])


def _rank_no_room(rank: int, W: int) -> dict:
    """Two channels that cannot get their regions: `huge` asks every rank for 2**42 floats (no
    `/dev/shm` has them), then for a few (still off: it stays off); `taken` asks for a few, but
    rank 1's file name is already taken (rank 0 alone could map its own). Then an exchange
    through each channel."""
    import torch

    from poise.runtime.moves import exchange as ex
    from poise.runtime.moves.host_link import HostLink, shm_dir

    link = HostLink.connect()
    assert link is not None
    small = np.full((W, W), 100)
    np.fill_diagonal(small, 0)
    written: list[int] = []

    def write(dst: int, out: torch.Tensor) -> None:
        written.append(dst)

    huge = link.channel("huge")
    turns = [
        huge.start(small * 2**36, write, torch.float32),
        huge.start(small, write, torch.float32),
    ]
    taken = link.channel("taken")
    squat = shm_dir() / f"{link.prefix}-taken-4096-1"  # the file rank 1 would make
    if rank == 1:
        squat.write_bytes(b"")
    link.agree(True)  # rank 1's squat is in place before rank 0 starts
    turns.append(taken.start(small, write, torch.float32))
    squat.unlink(missing_ok=True)
    rows = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank  # [slots, 2]
    routes = ex.Routes.build([(r, 0, (r + 1) % W, 2) for r in range(W)])  # slot 0 -> next slot 2
    got: list[list[float]] = []

    def sink(dst: torch.Tensor, received: list[torch.Tensor]) -> None:
        got.append(received[0].reshape(-1).tolist())

    for channel in (huge, taken):
        ex.exchange([ex.Stream(routes, [rows], sink)], rank, W, link=channel).wait()
    return {
        "turns": [t is None for t in turns],
        "disabled": [huge.disabled, taken.disabled],
        "written": written,
        "got": got,
    }


@pytest.mark.dist
def test_a_rank_without_room_turns_the_channel_off_everywhere() -> None:
    """No rank writes, every rank's channel is off (and stays off), and `exchange` through it
    still delivers (through the group)."""
    results = run_ranks(_rank_no_room, 2)
    for rank, res in enumerate(results):
        assert res["turns"] == [True, True, True] and res["disabled"] == [True, True]
        assert res["written"] == []
        other = [10.0 * (1 - rank), 10.0 * (1 - rank) + 1]  # the other rank's slot 0
        assert res["got"] == [other, other]


def test_segments_are_aligned_and_in_destination_order() -> None:
    numel = np.array([[0, 3, 20], [17, 0, 0], [1, 1, 0]])
    off = segment_offsets(numel, 4)
    # sender 0: [0 el -> 0 B][3 el = 12 B -> 64][20 el = 80 B -> 128]
    np.testing.assert_array_equal(off[0], [0, 0, 64])
    np.testing.assert_array_equal(off[1], [0, 128, 128])  # 17 el = 68 B -> 128
    np.testing.assert_array_equal(off[2], [0, 64, 128])
    assert (off % ALIGN == 0).all()
    assert half_bytes(numel, 4) == 64 + 128  # sender 0's 192 B is the largest
