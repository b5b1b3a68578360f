"""`poise.runtime.loads`: one step's counts, rows, flags and seconds from every rank, by
hand on one process and on two gloo ranks (each rank's figures known, so the table is too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poise.nn import MoE, MoEConfig, apply_expert_parallel
from poise.nn.moe import NonFiniteInputError
from poise.runtime.launch import run_ranks
from poise.runtime.loads import gather_step
from poise.runtime.moves.layer_state import LayerState
from poise.runtime.selfcal import fit as selfcal

E = 4  # experts


def _layers(world: int, group) -> list[LayerState]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, E, 2)), MoE(MoEConfig(8, 16, E, 2)))
    apply_expert_parallel(model, group, num_slots=E // world)
    return [LayerState(m, i) for i, m in enumerate(model)]


def _fill(layers: list[LayerState], rank: int) -> None:
    """What the Balancer's forward hooks leave for a step: layer l of rank r routed
    `[10 l + r, 1, 2, 3]` tokens and computed `5 + l + 10 r` rows."""
    for layer, state in enumerate(layers):
        state.counts = torch.tensor([10 * layer + rank, 1, 2, 3])
        state.rows = 5 + layer + 10 * rank


def test_one_rank_by_hand() -> None:
    layers = _layers(1, None)
    _fill(layers, 0)
    seconds = [0.5, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
    g = gather_step(layers, E, seconds, None, 1, step=7)
    assert g.counts.shape == (2, 1, E)
    assert g.counts[:, 0].tolist() == [[0, 1, 2, 3], [10, 1, 2, 3]]
    assert g.computed.tolist() == [[5.0], [6.0]]
    np.testing.assert_allclose(g.rank_seconds, [seconds])
    np.testing.assert_allclose(g.measured, seconds)
    assert g.rank_experts.tolist() == pytest.approx([0.04])
    # the step's counts and rows are taken: the next step starts from nothing
    assert all(s.counts.numel() == 0 and s.rows == 0 for s in layers)
    g = gather_step(layers, E, seconds, None, 1, step=8)
    assert g.counts.sum() == 0 and g.computed.sum() == 0


def test_a_non_finite_input_raises_at_the_gather() -> None:
    layers = _layers(1, None)
    x = torch.randn(6, 8)
    x[2, 3] = float("nan")
    layers[1].layer(x)  # the layer flags it without synchronising
    with pytest.raises(NonFiniteInputError, match="step 3"):
        gather_step(layers, E, [0.0] * len(selfcal.MEASURED), None, 1, step=3)


def _two(rank: int, world: int) -> dict:
    import torch.distributed as dist

    layers = _layers(world, dist.group.WORLD)
    _fill(layers, rank)
    # rank 1 is slower everywhere except in the collectives (a2a, transfers, boundary, migration)
    seconds = np.array([0.5, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06]) * (1 + rank)
    return {"g": gather_step(layers, E, seconds.tolist(), dist.group.WORLD, world, step=1)}


@pytest.mark.dist
def test_two_ranks_see_the_same_table() -> None:
    out = run_ranks(_two, 2)
    g = out[0]["g"]
    for key in ("counts", "computed", "rank_seconds", "measured", "rank_experts"):
        np.testing.assert_array_equal(getattr(g, key), getattr(out[1]["g"], key))
    # counts [L, D, E]: layer l of rank r routed [10 l + r, 1, 2, 3]
    assert g.counts.tolist() == [[[0, 1, 2, 3], [1, 1, 2, 3]], [[10, 1, 2, 3], [11, 1, 2, 3]]]
    assert g.computed.tolist() == [[5.0, 15.0], [6.0, 16.0]]  # [L, D]
    base = np.array([0.5, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06])
    np.testing.assert_allclose(g.rank_seconds, [base, 2 * base])
    want = 2 * base  # the slowest rank's, except the collectives: the fastest rank's
    waited = [selfcal.A2A, selfcal.TRANSFERS, selfcal.BOUNDARY, selfcal.MIGRATE]
    want[waited] = base[waited]
    np.testing.assert_allclose(g.measured, want)
    np.testing.assert_allclose(g.rank_experts, [0.04, 0.08])


def _two_groups(rank: int, world: int) -> dict:
    """Two EP groups of two ranks, {0, 1} and {2, 3}: each gathers its own; with the world as
    the vote group, both see the larger figures."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    layers = _layers(2, group)
    _fill(layers, rank % 2)
    seconds = (np.array([0.5, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06]) * (1 + rank)).tolist()
    own = gather_step(layers, E, seconds, group, 2, step=1)
    _fill(layers, rank % 2)
    voted = gather_step(layers, E, seconds, group, 2, step=2, vote_group=dist.group.WORLD)
    return {"own": own, "voted": voted}


@pytest.mark.dist
def test_a_vote_group_sees_the_largest_figures_of_its_groups() -> None:
    out = run_ranks(_two_groups, 4)
    a, b = out[0]["own"], out[2]["own"]
    assert not np.allclose(a.measured, b.measured)  # the groups measured differently
    for r in range(4):
        voted = out[r]["voted"]
        np.testing.assert_allclose(voted.measured, np.maximum(a.measured, b.measured))
        np.testing.assert_allclose(voted.rank_experts, np.maximum(a.rank_experts, b.rank_experts))
        own = out[r]["own"]
        np.testing.assert_array_equal(voted.counts, own.counts)  # counts stay the group's
