"""The Balancer on a compiled model: each `MoE` block compiled in place (`block.compile`, as
torchtitan compiles each block), trained on 2 gloo ranks under the Balancer with plan changes
(replicas, with Trans, Agg and migration through the experts' hooks), gives the eager run's
losses, and a plan change recompiles a bounded number of frames (none once the plan's first
steps have run).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from poise.runtime.launch import run_ranks

from .helpers import slow_gemm_cluster, train_residual_moe

E, D_MODEL, D_EXPERT, TOKENS, STEPS, EVERY = 4, 8, 16, 48, 10, 3


def _build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist

    from poise.nn import MoE, MoEConfig, apply_expert_parallel

    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        [MoE(MoEConfig(D_MODEL, D_EXPERT, E, 2, init_seed=i)) for i in range(2)]
    )
    apply_expert_parallel(model, dist.group.WORLD, num_slots=E // 2 + 1)
    with torch.no_grad():
        for block in model.blocks:
            block.router.weight[:1] += 0.5  # expert 0 hot: replicas pay
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


def _run(rank: int, compiled: bool) -> dict[str, Any]:
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from poise.runtime.balancer import Balancer, BalancerConfig

    model, opt = _build()
    dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    if compiled:
        for block in model.blocks:
            block.compile(backend=counter)
    # No guard: the plan is adopted (replicas of expert 0 from the first re-plan on).
    config = BalancerConfig(cluster=slow_gemm_cluster(2), guard=False, calibrate=False)
    balancer = Balancer(model, opt, "eplb", EVERY, config)
    frames: list[int] = []

    def each_step(_s: int) -> None:
        frames.append(counter.frame_count)

    losses = train_residual_moe(model, opt, rank, STEPS, TOKENS, D_MODEL, balancer, each_step)
    frames.append(counter.frame_count)
    balancer.close()
    layouts = [s.layout for s in balancer.stats]
    return {"losses": losses, "frames": frames, "layouts": layouts}


def _rank(rank: int, world: int) -> dict[str, Any]:
    return {"eager": _run(rank, False), "compiled": _run(rank, True)}


@pytest.mark.dist
def test_the_balancer_trains_a_compiled_model_as_the_eager_one() -> None:
    for rank, r in enumerate(run_ranks(_rank, 2, timeout_s=300)):
        eager, compiled = r["eager"], r["compiled"]
        assert compiled["layouts"] == eager["layouts"], rank  # the same plan changes
        assert len(set(eager["layouts"])) > 1, eager["layouts"]  # some plan took force
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
        # Frames compiled before each step and after the last (measured: 0, 8, 9, 11, 13, 16,
        # 17, then 17): the first steps' new split sizes until dynamo makes them symbolic, the
        # plan's first steps (replicas: regrouped rows, new slots) a few more, then none.
        frames = compiled["frames"]
        assert frames[-1] <= 20 and frames[-1] == frames[-5], (rank, frames)
