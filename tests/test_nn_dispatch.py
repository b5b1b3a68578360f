"""Dispatcher: integer routes equal `Assignment.split`, index helpers by hand, routings; on 3
gloo ranks (6 experts): overlap chunks give the n=1 results, and bad input (NaN, disagreeing
routings, configurations or router weights, a world that does not fit) is one error on every
rank instead of a hang."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Assignment, Placement
from poise.nn import MoE, MoEConfig, apply_expert_parallel, raise_if_nonfinite
from poise.nn.dispatch import RankRouting, gather_index, inverse, split_parts
from poise.nn.slots import SlotMap, slot_maps
from poise.runtime.launch import run_ranks

from .test_nn_moe import Case, check_against_reference, run_case


def test_gather_index_and_split_parts_by_hand():
    # Buffer blocks of lengths [2, 0, 3, 1] (block ids 0..3); read blocks 2, 0, 3.
    assert gather_index(np.array([2, 0, 3, 1]), np.array([2, 0, 3])).tolist() == [2, 3, 4, 0, 1, 5]
    assert split_parts(np.array([5, 0, 2]), 3).tolist() == [[2, 0, 1], [2, 0, 1], [1, 0, 0]]
    assert inverse(np.array([2, 0, 1])).tolist() == [1, 2, 0]


@st.composite
def plans(draw: st.DrawFn) -> tuple[Placement, Assignment, np.ndarray]:
    world = draw(st.sampled_from([2, 3, 4]))
    experts = world * draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    home = rng.integers(0, world, experts)
    placement = Placement.from_homes(home[None, :], world, experts)
    placement.copies[0] |= (rng.random((world, experts)) < 0.3).astype(np.int32)
    kind = draw(st.sampled_from(["even", "home", "random", "group"]))
    if kind == "even":
        assignment = Assignment.even(placement)
    elif kind == "home":
        assignment = Assignment.to_home(placement)
    elif kind == "random":
        w = rng.random((1, experts, world)) * (placement.copies.transpose(0, 2, 1) > 0)
        assignment = Assignment(w / w.sum(axis=2, keepdims=True))
    else:
        size = 2 if world % 2 == 0 else 1
        assignment = Assignment.group_local(placement, size)
    counts = rng.integers(0, 50, (1, world, experts))
    return placement, assignment, counts


@settings(max_examples=60, deadline=None)
@given(case=plans())
def test_routes_equal_assignment_split(case: tuple[Placement, Assignment, np.ndarray]):
    placement, assignment, counts = case
    want = assignment.split(placement, counts)[0]  # [D_src, E, D_dst]
    maps = slot_maps(placement, 0, placement.experts)
    for rank in range(placement.devices):
        routing = RankRouting.from_plan(placement, assignment, maps[rank], rank)
        np.testing.assert_array_equal(routing.routes(counts[0, rank]), want[rank])


def test_routing_refuses_a_slot_map_that_disagrees_with_the_placement():
    placement = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 2)
    bad = SlotMap(expert=np.array([0, 2]), home=np.array([True, False]))
    with pytest.raises(PlanError, match="slot map"):
        RankRouting.from_plan(placement, Assignment.even(placement), bad, 0)


def test_routing_digest_is_shared_by_the_ranks_of_a_grouped_plan():
    placement = Placement.from_homes(np.array([[0, 1, 2, 3]]), 4, 3)
    placement.copies[0, :, 0] = 1
    assignment = Assignment.group_local(placement, 2)
    maps = slot_maps(placement, 0, 3)
    digests = {RankRouting.from_plan(placement, assignment, maps[r], r).digest for r in range(4)}
    assert len(digests) == 1


# ----------------------------------------------------------------------------- 3 ranks
def ep_layer(cfg: MoEConfig) -> MoE:
    """A compute-only layer made expert parallel over the world (collective)."""
    import torch.distributed as dist

    moe = MoE(cfg)
    apply_expert_parallel(moe, dist.group.WORLD)
    return moe


def _errors(rank: int, world: int) -> dict[str, str]:
    """Each bad input on every rank; returns the error each rank saw, as
    `Type[field]: message`."""
    seen: dict[str, str] = {}

    def attempt(name: str, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
            seen[name] = "no error"
        except Exception as exc:  # reported back to the parent
            seen[name] = f"{type(exc).__name__}[{getattr(exc, 'field', None)}]: {exc}"

    torch.manual_seed(0)
    moe = ep_layer(MoEConfig(8, 16, 6, 2))
    x = torch.randn(5, 8)
    if rank == 1:
        x[3, 0] = float("nan")
    attempt("nan", lambda: (moe(x), raise_if_nonfinite(moe)))  # raised at the step boundary
    other = Placement.from_homes(np.array([[0, 0, 1, 1, 2, 2]]), world, 2)
    if rank == 2:
        other = Placement.from_homes(np.array([[0, 1, 0, 1, 2, 2]]), world, 2)
    moe.set_routing(other, Assignment.even(other), slot_maps(other, 0, 2)[rank])
    attempt("routing", lambda: moe(torch.randn(5, 8)))
    attempt("config", lambda: ep_layer(MoEConfig(8, 16 + 8 * (rank == 1), 6, 2)))
    torch.manual_seed(rank)  # router weights differ
    attempt("router", lambda: ep_layer(MoEConfig(8, 16, 6, 2)))
    attempt("world", lambda: ep_layer(MoEConfig(8, 16, 4, 2)))
    torch.manual_seed(0)
    attempt("after", lambda: ep_layer(MoEConfig(8, 16, 6, 2))(torch.randn(4, 8)))  # group works
    return seen


def _hook_fires(overlap: int) -> list[int]:
    """How often each expert weight's post-accumulate-grad hook fires in one backward."""

    torch.manual_seed(0)
    moe = ep_layer(MoEConfig(8, 16, 6, 2, overlap_degree=overlap))
    fires = [0] * len(moe.experts.weights())
    for i, w in enumerate(moe.experts.weights()):
        w.register_post_accumulate_grad_hook(lambda _p, i=i: fires.__setitem__(i, fires[i] + 1))
    moe(torch.randn(12, 8, requires_grad=True)).sum().backward()
    return fires


def _bias_update(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's counts, the expert bias after one update from the counts of all ranks)."""

    torch.manual_seed(0)
    moe = ep_layer(MoEConfig(8, 16, 6, 2, expert_bias=True))
    moe(torch.randn(10 + 7 * rank, 8))
    counts = moe.last_counts.clone()
    moe.update_bias(0.5)
    return counts, moe.router.expert_bias.clone()


def _cases(rank: int, world: int, cases: list[Case]) -> tuple:
    torch.manual_seed(0)
    results = {c.name: run_case(c, rank, world) for c in cases}
    return results, _errors(rank, world), _hook_fires(overlap=3), _bias_update(rank)


OVERLAP = [
    Case(f"overlap{n}", E=6, overlap=n, T=(23, 0, 17), activation="gelu") for n in (1, 2, 4)
] + [Case("overlap3-capacity", E=6, overlap=3, T=(30, 12, 25), capacity_factor=0.8)]


@pytest.mark.dist
def test_three_ranks_overlap_and_errors():
    per_rank = run_ranks(_cases, 3, OVERLAP)
    for case in OVERLAP:
        check_against_reference(case, [r[0][case.name] for r in per_rank])
    for rank in range(3):  # chunked results equal the unchunked ones to rounding
        base = per_rank[rank][0]["overlap1"]
        for n in (2, 4):
            got = per_rank[rank][0][f"overlap{n}"]
            torch.testing.assert_close(got["y"], base["y"], atol=1e-6, rtol=0)
            torch.testing.assert_close(
                got["grads"]["w_in"], base["grads"]["w_in"], atol=1e-6, rtol=0
            )
    errors = [r[1] for r in per_rank]
    for rank, seen in enumerate(errors):
        assert seen["nan"].startswith("NonFiniteInputError") and "rank(s) [1]" in seen["nan"]
        assert seen["routing"].startswith("RoutingMismatchError"), seen["routing"]
        assert seen["config"].startswith("ConfigError[moe]"), seen["config"]
        assert "configuration" in seen["config"] and "rank(s)" in seen["config"]
        assert seen["router"].startswith("ConfigError[moe]") and "router weights" in seen["router"]
        assert seen["world"].startswith("ConfigError[world_size]") and "do not fit" in seen["world"]
        assert seen["after"] == "no error", (rank, seen["after"])
        assert per_rank[rank][2] == [1, 1, 1]  # one gradient accumulation per weight
    total = sum(r[3][0] for r in per_rank).float()  # the bias follows the counts of all ranks
    for r in per_rank:
        torch.testing.assert_close(r[3][1], 0.5 * torch.sign(total.mean() - total))


def test_world_size_errors_name_the_field():
    from poise.nn import check_world

    with pytest.raises(ConfigError) as info:
        check_world(4, 3)
    assert info.value.field == "world_size"
