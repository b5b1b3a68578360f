import pytest

from poise.runtime.launch import RankFailedError, run_ranks

pytestmark = pytest.mark.dist


def _sum_ranks(rank: int, world_size: int, scale: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t.item()) + world_size * 1000


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(_sum_ranks, 2, 3) == [2003, 2003]


def test_a_failing_rank_fails_the_run_with_its_message() -> None:
    with pytest.raises(RankFailedError, match="rank 1: ValueError: rank one refuses"):
        run_ranks(_fail_on_rank_one, 2, collective_timeout_s=10)
