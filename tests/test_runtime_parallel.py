"""MP + EP + ESP (Parm's schedules) against the single-process block.

One spawn of 4 gloo ranks, MP = ESP = 2 (two nodes of two ranks, EP = 2 across them): each
schedule ("baseline", "s1", "s2", "s1" with a chunked all-to-all, "auto" through a chooser)
runs an attention + MoE block sharded from the reference `Block(cfg, MoE(...))` built here in
one process. Each node runs its own batch (of different sizes); outputs, input gradients and
every parameter's gradient (summed over the nodes, gathered back to full shape) must match the
reference's within 1e-5. Degrees that do not fit raise `ConfigError` naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from poise.core.errors import ConfigError
from poise.models.gpt import Block, GPTConfig, rotary_tables
from poise.nn import MoE, MoEConfig, NonFiniteInputError
from poise.runtime.launch import run_ranks
from poise.runtime.parm.choice import ParmChooser, ParmShape, local_cluster
from poise.runtime.parm.groups import ParallelGroups, check_degrees

TOL = 1e-5
CFG = GPTConfig(d_model=32, heads=4, d_expert=48, num_experts=4, top_k=2, context=16)
BATCH, S = (3, 2), 5  # 15 and 10 tokens on the two nodes: MP splits 8 + 7 and 5 + 5
RUNS: tuple[tuple[str, str, int], ...] = (
    ("baseline", "baseline", 1),
    ("s1", "s1", 1),
    ("s2", "s2", 1),
    ("s1-overlap2", "s1", 2),
    ("auto", "auto", 1),
)


def reference() -> dict[str, Any]:
    """The single-process block, its state, each node's input, upstream gradient and output,
    input gradients and parameter gradients summed over the two nodes."""
    torch.manual_seed(0)
    cfg = MoEConfig(CFG.d_model, CFG.d_expert, CFG.num_experts, CFG.top_k, init_seed=3)
    block = Block(CFG, MoE(cfg))
    cos, sin = rotary_tables(CFG.context, CFG.head_dim, CFG.rope_base)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(b, S, CFG.d_model, generator=gen) for b in BATCH]
    gs = [torch.randn(b, S, CFG.d_model, generator=gen) for b in BATCH]
    ys, gxs = [], []
    for x, g in zip(xs, gs, strict=True):
        x = x.clone().requires_grad_()
        y = block(x, cos[:S], sin[:S])
        (y * g).sum().backward()
        ys.append(y.detach())
        gxs.append(x.grad)
    state = {k: v.detach().clone() for k, v in block.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return {"state": state, "xs": xs, "gs": gs, "ys": ys, "gxs": gxs, "grads": grads}


SEEN: list[ParmShape] = []


def choose_s2(shape: ParmShape) -> str:
    SEEN.append(shape)
    return "s2"


def _rank(rank: int, world: int, ref: dict[str, Any]) -> dict[str, Any]:
    from poise.runtime.parm.layer import full_state, parallel_block, sync_parallel_grads
    from poise.runtime.parm.parallel_moe import ParallelMoE

    out: dict[str, Any] = {}
    try:
        ParallelGroups.build(mp=3)
    except ConfigError as exc:
        out["bad_mp_field"] = exc.field
    groups = ParallelGroups.build(mp=2)
    cos, sin = rotary_tables(CFG.context, CFG.head_dim, CFG.rope_base)
    node = groups.node
    for name, schedule, overlap in RUNS:
        block = parallel_block(
            CFG,
            groups,
            schedule=schedule,  # type: ignore[arg-type]
            chooser=choose_s2,
            full_state=ref["state"],
            overlap_degree=overlap,
        )
        x = ref["xs"][node].clone().requires_grad_()
        y = block(x, cos[:S], sin[:S])
        (y * ref["gs"][node]).sum().backward()
        sync_parallel_grads(block, groups)
        out[name] = {
            "y": y.detach(),
            "gx": x.grad,
            "grads": full_state(block, grads=True),
            "state": full_state(block),
            "schedule": block.ffn.last_schedule,
            "gated": int(block.ffn.last_counts.sum()),
        }
    out["seen"] = SEEN
    fresh = ParallelMoE(CFG.d_model, CFG.d_expert, CFG.num_experts, groups=groups, init_seed=3)
    out["fresh_experts"] = fresh.full_state_dict()
    # NaN on node 1 only: every rank raises (none is left waiting in a collective), under both
    # the EP dispatcher (s1) and the world one (s2)
    for schedule in ("s1", "s2"):
        block = parallel_block(CFG, groups, schedule=schedule, full_state=ref["state"])  # type: ignore[arg-type]
        x = ref["xs"][node].clone()
        if node == 1:
            x[0, 0, 0] = float("nan")
        try:
            block.ffn(x)
        except NonFiniteInputError as exc:
            out[f"nan_{schedule}"] = exc.field
    return out


@pytest.fixture(scope="module")
def results() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ref = reference()
    return ref, run_ranks(_rank, 4, ref, timeout_s=240)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


@pytest.mark.dist
@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_schedule_matches_single_process(results: Any, name: str) -> None:
    ref, ranks = results
    for rank, res in enumerate(ranks):
        got = res[name]
        node = rank // 2
        assert _diff(got["y"], ref["ys"][node]) < TOL, (rank, "output")
        assert _diff(got["gx"], ref["gxs"][node]) < TOL, (rank, "input grad")
        assert set(got["grads"]) == set(ref["grads"])
        for key, want in ref["grads"].items():
            assert want.abs().max() > 0, key  # every parameter really gets a gradient
            assert _diff(got["grads"][key], want) < TOL, (rank, key)
        for key, want in ref["state"].items():  # sharding then gathering is the identity
            assert torch.equal(got["state"][key], want), (rank, key)


@pytest.mark.dist
def test_schedules_really_differ(results: Any) -> None:
    """Each run used the schedule it asked for; auto asked the chooser once, with this shape;
    the baseline gates the node's tokens (15, 10) on both of its ranks, the Parm schedules (MP
    paused) their halves (8 + 7, 5 + 5)."""
    _, ranks = results
    for rank, res in enumerate(ranks):
        mine = ((8, 7), (5, 5))[rank // 2][rank % 2]
        gated = [res[name]["gated"] for name, _, _ in RUNS]
        assert gated == [BATCH[rank // 2] * S * 2] + [mine * 2] * 4, rank
        assert [res[name]["schedule"] for name, _, _ in RUNS] == [
            "baseline", "s1", "s2", "s1", "s2"
        ]  # fmt: skip
        (shape,) = res["seen"]
        assert (shape.tokens, shape.mp, shape.esp, shape.ep) == (15, 2, 2, 2)  # the larger node
        assert (shape.d_model, shape.d_expert, shape.num_experts, shape.top_k) == (32, 48, 4, 2)
        assert shape.dtype_bytes == 4


@pytest.mark.dist
def test_experts_drawn_as_the_single_process_layer_draws_them(results: Any) -> None:
    """A `ParallelMoE` with the reference's `init_seed` holds shards of the same experts."""
    ref, ranks = results
    for res in ranks:
        for name in ("w_in", "w_gate", "w_out"):
            got = res["fresh_experts"][f"experts.{name}"]
            assert torch.equal(got, ref["state"][f"ffn.experts.{name}"]), name


@pytest.mark.dist
def test_bad_input_raises_on_every_rank(results: Any) -> None:
    _, ranks = results
    assert [r.get("bad_mp_field") for r in ranks] == ["mp"] * 4
    for schedule in ("s1", "s2"):
        assert [r.get(f"nan_{schedule}") for r in ranks] == ["moe.input"] * 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world": 4, "mp": 3}, "mp"),
        ({"world": 4, "mp": 0}, "mp"),
        ({"world": 4, "mp": 2, "esp": 3}, "esp"),
        ({"world": 4, "mp": 2, "esp": 1}, "esp"),
        ({"world": 8, "mp": 4, "heads": 6}, "mp"),
        ({"world": 4, "mp": 2, "d_expert": 33}, "esp"),
        ({"world": 8, "mp": 2, "num_experts": 6}, "num_experts"),
    ],
)
def test_bad_degrees(kwargs: dict[str, int], field: str) -> None:
    world, mp = kwargs.pop("world"), kwargs.pop("mp")
    with pytest.raises(ConfigError) as info:
        check_degrees(world, mp, **kwargs)
    assert info.value.field == field


def test_good_degrees() -> None:
    d = check_degrees(8, 2, heads=4, d_expert=64, num_experts=8)
    assert (d.mp, d.esp, d.ep) == (2, 2, 4)
    assert d.mp_ranks(1) == [2, 3] and d.ep_ranks(1) == [1, 3, 5, 7]


def test_groups_need_a_process_group() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelGroups.build(mp=2)
    assert info.value.field == "world_size"


def test_default_chooser_is_parms_choice() -> None:
    """`ParmChooser` asks `poise.layouts.parm.choose_schedule` about the layer it describes: S1
    (fewest inter-node bytes) when links between nodes are slow, S2 (one unified all-to-all)
    when they are faster than those inside a node."""
    from poise.core.cluster import Link
    from poise.layouts.parm import choose_schedule

    shape = ParmShape(4096, 1024, 4096, 8, 2, 1.2, 2, 2, 2, 2)
    layer = ParmChooser().layer(shape)
    assert (layer.tokens, layer.mp, layer.esp, layer.ep, layer.experts) == (4096, 2, 2, 2, 8)
    base = local_cluster(shape)
    assert (base.devices_per_node, base.nodes_per_domain) == (2, 2)
    slow = dataclasses.replace(base, inter_node=Link(base.intra_node.bw_Bps / 50, 30e-6))
    fast = dataclasses.replace(base, inter_node=Link(base.intra_node.bw_Bps * 4, 1e-6))
    picks = {}
    for name, cluster in (("slow", slow), ("fast", fast), ("default", None)):
        got = ParmChooser(cluster)(shape)
        assert got == choose_schedule(layer, cluster or base)
        picks[name] = got
    assert (picks["slow"], picks["fast"]) == ("s1", "s2")
