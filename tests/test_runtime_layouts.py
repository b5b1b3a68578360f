"""Training in a SmartMoE layout on 4 gloo ranks: EP=2 groups, EDP=2 replicas, 2 experts per rank.

Each rank feeds its shard of the global batch through `poise.nn.MoE` built on its EP group;
after backward, the router gradients are summed over the world and the expert gradients over the
EDP group (`all_reduce_expert_grads`). Outputs, input gradients, router and expert gradients
must equal one process running the whole global batch through an MoE holding every expert
(1e-5), and after an SGD step the EDP replicas must hold identical weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from poise.core.errors import ConfigError, PlanError
from poise.layouts.pool import Layout
from poise.nn import MoE, MoEConfig, apply_expert_parallel, sync_router_grads
from poise.runtime.launch import run_ranks
from poise.runtime.smartmoe import (
    all_reduce_expert_grads,
    create_groups,
    expert_weights,
    replicas_agree,
)

pytestmark = pytest.mark.dist

E, D, H, K = 4, 8, 16, 2
TOKENS = (11, 7, 0, 17)  # per rank: uneven, one rank without tokens
TOL = 1e-5


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "router": torch.randn(E, D, generator=g) * 0.5,
        "w_in": torch.randn(E, D, H, generator=g) / D**0.5,
        "w_gate": torch.randn(E, D, H, generator=g) / D**0.5,
        "w_out": torch.randn(E, H, D, generator=g) / H**0.5,
    }


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens `[T, D]` and the fixed upstream gradient of its output."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS[rank], D, generator=g), torch.randn(TOKENS[rank], D, generator=g)


def build(**ep: object) -> MoE:
    """The layer on one process with the test's weights, then expert parallel with `ep`
    (`apply_expert_parallel`'s arguments) when given: the slots take the full layer's rows."""
    moe = MoE(MoEConfig(D, H, E, K, activation="swiglu"))
    w = weights()
    moe.load_expert_weights(w)
    with torch.no_grad():
        moe.router.weight.copy_(w["router"])
    if ep:
        apply_expert_parallel(moe, **ep)  # type: ignore[arg-type]
    return moe


def refusal(layout: Layout) -> str:
    try:
        create_groups(layout)
    except ConfigError as exc:
        return exc.one_line()
    return "accepted"


def rank_fn(rank: int, world: int) -> dict:
    refused = [
        refusal(Layout(devices=world, experts=E, layers=2, pp=2, ep=2)),
        refusal(Layout(devices=2 * world, experts=E, layers=1, ep=2)),
    ]
    layout = Layout(devices=world, experts=E, layers=1, ep=2)
    groups = create_groups(layout)
    moe = build(**groups.expert_parallel_kwargs())
    x, up = batch(rank)
    x.requires_grad_()
    y = moe(x)
    (y * up).sum().backward()
    sync_router_grads(moe)
    before = {n: getattr(moe.experts, n).grad.clone() for n in ("w_in", "w_gate", "w_out")}
    all_reduce_expert_grads(moe, groups.edp)
    out = {
        "refused": refused,
        "before": before,
        "y": y.detach(),
        "x_grad": x.grad,
        "router_grad": moe.router.weight.grad.clone(),
        "slots": moe.routing.slots.expert.tolist(),
        "grads": {n: getattr(moe.experts, n).grad.clone() for n in ("w_in", "w_gate", "w_out")},
        "ep_ranks": groups.ep_ranks,
        "edp_ranks": groups.edp_ranks,
        # the Balancer's transfers get a group of their own over the EP group's ranks
        "transfer_ranks": tuple(dist.get_process_group_ranks(groups.ep_transfer)),
        "transfer_is_ep": groups.ep_transfer is groups.ep,
    }
    # ep = the world: the EP group is the default group, the transfers' a new one
    whole = create_groups(Layout(devices=world, experts=E, layers=1, ep=world))
    out["whole"] = (
        whole.ep is dist.group.WORLD,
        whole.ep_transfer is dist.group.WORLD,
        tuple(dist.get_process_group_ranks(whole.ep_transfer)),
    )
    out["static_transfer"] = create_groups(layout, transfers=False).ep_transfer
    summed = torch.tensor([float(rank)])
    dist.all_reduce(summed, group=groups.ep_transfer)  # it works, over those ranks only
    out["transfer_sum"] = float(summed)
    opt = torch.optim.SGD(expert_weights(moe), lr=0.5)
    opt.step()
    out["replicas_agree"] = replicas_agree(moe, groups.edp)
    # A replica whose slots hold other experts must be refused, on every rank of its group.
    if rank == 2:
        moe.routing.slots.expert[:] = moe.routing.slots.expert[::-1].copy()
    try:
        all_reduce_expert_grads(moe, groups.edp)
        out["mismatch"] = "accepted"
    except PlanError as exc:
        out["mismatch"] = str(exc)
    dist.barrier()
    return out


def reference() -> dict:
    """One process, every expert, the global batch (the ranks' shards concatenated)."""
    moe = build()
    xs, ups = zip(*(batch(r) for r in range(len(TOKENS))), strict=True)
    x = torch.cat(xs).requires_grad_()
    y = moe(x)
    (y * torch.cat(ups)).sum().backward()
    return {
        "y": y.detach().split(TOKENS),
        "x_grad": x.grad.split(TOKENS),
        "router_grad": moe.router.weight.grad,
        "grads": {n: getattr(moe.experts, n).grad for n in ("w_in", "w_gate", "w_out")},
    }


def test_ep2_edp2_matches_single_process() -> None:
    results = run_ranks(rank_fn, 4, timeout_s=180)
    ref = reference()
    assert [r["ep_ranks"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["edp_ranks"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r["transfer_ranks"] for r in results] == [r["ep_ranks"] for r in results]
    assert [r["transfer_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert not any(r["transfer_is_ep"] for r in results)
    assert [r["whole"] for r in results] == [(True, False, (0, 1, 2, 3))] * 4
    assert [r["static_transfer"] for r in results] == [None] * 4  # none asked for, none made
    assert [r["slots"] for r in results] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["y"], ref["y"][rank], atol=TOL, rtol=0)
        torch.testing.assert_close(res["x_grad"], ref["x_grad"][rank], atol=TOL, rtol=0)
        torch.testing.assert_close(res["router_grad"], ref["router_grad"], atol=TOL, rtol=0)
        for name, grad in res["grads"].items():
            # Slot s of this rank holds expert slots[s]: its summed gradient is the reference's.
            torch.testing.assert_close(grad, ref["grads"][name][res["slots"]], atol=TOL, rtol=0)
        assert res["replicas_agree"]
    # Before the EDP sum each replica holds only its own EP group's part: the sum matters here.
    gaps = [
        float((r["before"]["w_in"] - ref["grads"]["w_in"][r["slots"]]).abs().max()) for r in results
    ]
    assert min(gaps) > 1e-3
    assert "expert-data-parallel group" in results[0]["mismatch"]
    assert "expert-data-parallel group" in results[2]["mismatch"]
    assert results[1]["mismatch"] == results[3]["mismatch"] == "accepted"
    pp_refusal, world_refusal = results[0]["refused"]
    assert "pp" in pp_refusal and "pipeline" in pp_refusal
    assert "8 ranks, the world has 4" in world_refusal


def test_create_groups_needs_a_process_group() -> None:
    with pytest.raises(ConfigError, match="process group"):
        create_groups(Layout(devices=4, experts=4, layers=2, ep=2))
