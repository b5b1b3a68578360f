"""`poise.runtime.moves.transfer_group`: the transfers' own process group, on real gloo ranks."""

from __future__ import annotations

import pytest

from poise.runtime.launch import run_ranks


def _groups(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from poise.runtime.moves.transfer_group import spans_world, transfer_group

    sub = dist.new_group([0, 1])  # collective on every rank, in the same order
    own = transfer_group(None)  # the world: a new group over every rank
    out = {
        "own_is_world": own is dist.group.WORLD or own is None,
        "own_ranks": dist.get_process_group_ranks(own),
        "spans": (spans_world(None), spans_world(dist.group.WORLD), spans_world(own)),
        "sub_spans": spans_world(sub) if rank < 2 else None,
        # a subgroup comes back as it is: making one per subgroup needs every rank's call
        "sub_kept": transfer_group(sub) is sub if rank < 2 else None,
    }
    # The new group works beside the world's: an all-reduce in flight on it while one on the
    # world is issued and finished, both summed over every rank.
    pending = torch.tensor([float(rank)])
    handle = dist.all_reduce(pending, group=own, async_op=True)
    first = torch.tensor([1.0])
    dist.all_reduce(first)
    handle.wait()
    out["sums"] = (float(first), float(pending))
    return out


@pytest.mark.dist
def test_transfers_get_a_group_of_their_own_over_the_same_ranks() -> None:
    results = run_ranks(_groups, 3, timeout_s=120)  # a rank left behind hangs the others
    for r in results:
        assert not r["own_is_world"]
        assert r["own_ranks"] == [0, 1, 2]
        assert r["spans"] == (True, True, True)
        assert r["sums"] == (3.0, 3.0)
    assert [r["sub_spans"] for r in results] == [False, False, None]
    assert [r["sub_kept"] for r in results] == [True, True, None]


def test_without_a_process_group_the_group_is_given_back() -> None:
    from poise.runtime.moves.transfer_group import transfer_group

    marker = object()
    assert transfer_group(marker) is marker  # type: ignore[arg-type]
    assert transfer_group(None) is None
