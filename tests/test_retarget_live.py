"""Replica retargeting in a live run (`BalancerConfig(retarget=)`, `poise.plan.retarget`): on 2 gloo
ranks whose router's hot expert wanders every 3 steps, the replicas follow it, the ranks' loads
come out more even than with the plan's own replicas, and training ends where static EP does."""

from __future__ import annotations

import numpy as np
import pytest

from poise.runtime.launch import run_ranks

E, D_MODEL, D_EXPERT, TOKENS, STEPS, EVERY = 8, 8, 16, 64, 18, 6
TOL = 1e-5


def _trace(W: int):
    """Every source sends 40 tokens to the hot expert of the step and 2 to each other one; the
    hot expert is `(s // 3) % 4`, one of rank 0's homes, for 3 steps at a time."""
    from poise.trace.trace import Trace

    counts = np.full((STEPS, 2, W, E), 2)
    for s in range(STEPS):
        counts[s, :, :, (s // 3) % 4] = 40
    return Trace(counts, np.arange(STEPS), top_k=1, tokens_per_device=TOKENS)


def _run(rank: int, W: int, policy: str, retarget: bool) -> dict:
    import torch
    import torch.distributed as dist

    from poise.nn import MoE, MoEConfig, ReplayRouter, apply_expert_parallel
    from poise.runtime.balancer import Balancer, BalancerConfig
    from tests.helpers import toy_cluster, train_residual_moe

    torch.manual_seed(0)
    trace = _trace(W)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        [
            MoE(
                MoEConfig(D_MODEL, D_EXPERT, E, 1, init_seed=i),
                router=ReplayRouter(D_MODEL, E, 1, trace, layer=i, rank=rank),
            )
            for i in range(2)
        ]
    )
    apply_expert_parallel(model, dist.group.WORLD, num_slots=E // W + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    # fast links, slow GEMMs: replicas pay; every plan adopted (guard off)
    config = BalancerConfig(
        cluster=toy_cluster(W, bw=1e12, flops=1e6), guard=False, calibrate=False,
        retarget=retarget,
    )  # fmt: skip
    balancer = Balancer(model, opt, policy, EVERY, config)
    from tests.helpers import spy_jobs

    # what each planning job is told its fit steps ran: `(replicas a step, the plan's own)`
    jobs = spy_jobs(
        balancer,
        lambda job, at: (
            at,
            [r.tolist() for r in job.fit_ran or ()],
            np.argwhere(job.current.placement.replicas()).tolist(),
        ),
    )

    def replay_step(s: int) -> None:
        for block in model.blocks:
            block.router.set_step(s)

    losses = train_residual_moe(model, opt, rank, STEPS, TOKENS, D_MODEL, balancer, replay_step)
    balancer.close()
    stats = list(balancer.stats)
    return {
        "losses": losses,
        "max_over_mean": [float(np.max(s.max_over_mean)) for s in stats],
        "retargeted": [s.retargeted for s in stats],
        "switched": [s.step for s in stats if s.switched],
        "ran": [r.tolist() for r in balancer.records.ran],
        "jobs": jobs,
    }


def _wandering(rank: int, W: int) -> dict:
    return {
        "static": _run(rank, W, "static", False),
        "retarget": _run(rank, W, "eplb", True),
        "fixed": _run(rank, W, "eplb", False),
    }


@pytest.fixture(scope="module")
def wandering() -> list[dict]:
    return run_ranks(_wandering, 2)


@pytest.mark.dist
def test_retargeted_replicas_follow_a_wandering_hot_expert(wandering: list[dict]) -> None:
    on, off = wandering[0]["retarget"], wandering[0]["fixed"]
    assert on["switched"] and on["switched"] == off["switched"]  # the same plans took effect
    assert sum(on["retargeted"]) > 0 and sum(off["retargeted"]) == 0
    # `StepStats.step` counts from 0: step t's boundary switched for t in `switched`, so step
    # t + 1 runs the new plan's own replicas and step t + 2 the first retargeted ones
    first = on["switched"][0]
    later = range(first + 2, STEPS)
    # where step t's hot expert is step t - 1's (two steps in three), the replica that follows
    # it levels the layer; the plan's own replicas, made from a forecast, leave steps uneven
    follow = [t for t in later if t // 3 == (t - 1) // 3 and t - 1 not in on["switched"]]
    assert len(follow) >= 4
    assert all(on["max_over_mean"][t] < 1.03 for t in follow), on["max_over_mean"]
    assert max(off["max_over_mean"][t] for t in follow) > 1.3, off["max_over_mean"]
    assert sum(on["max_over_mean"][t] for t in later) < sum(off["max_over_mean"][t] for t in later)
    # the records keep what each step ran: on a followed step, a replica of the hot expert of the
    # step before (`(t - 1) // 3 % 4`) in every layer
    for t in follow:
        assert sorted(layer for layer, _, e in on["ran"][t] if e == (t - 1) // 3 % 4) == [0, 1]
    # and the planning job under the first plan is told so: its fit steps ran retargeted
    # replicas, not only the plan's own (`PlanningJob.fit_ran`, priced by `ran_plans`)
    under = [(ran, own) for at, ran, own in on["jobs"] if at > first + 2 and own]
    assert under and any(r != own for ran, own in under for r in ran)
    assert all(r == own for at, ran, own in off["jobs"] for r in ran)


@pytest.mark.dist
def test_retargeted_training_ends_where_static_ep_does(wandering: list[dict]) -> None:
    for r in wandering:  # every rank's loss at every step, with and without retargeting
        for name in ("retarget", "fixed"):
            np.testing.assert_allclose(r[name]["losses"], r["static"]["losses"], rtol=TOL)
