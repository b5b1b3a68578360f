"""`poise.runtime.selfcal.probe`: the start-up bulk-transfer probe and the switch probe priced by
hand
and measured on real gloo ranks (every rank gets the same figures); the switch probe's scale is
what the first switch is priced at, by `auto` and by the guard, until a switch is measured."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.spec import ModelSpec
from poise.runtime.launch import run_ranks
from poise.runtime.selfcal.probe import (
    measure_probe_s,
    modelled_probe_s,
    probe_switch_scale,
    probe_transfer_scale,
    switch_probe_homes,
)

from .helpers import toy_cluster

# one expert: 3 x 64 x 256 = 49,152 parameters x (4 + 8) bytes = 589,824 bytes to move
SPEC = ModelSpec(
    name="probe", d_model=64, d_expert=256, experts=8, top_k=2, moe_layers=2, dtype_bytes=4,
    optimizer_bytes_per_param=8.0, activation="swiglu",
)  # fmt: skip


def test_modelled_probe_by_hand() -> None:
    # one node of 2: each rank sends and receives 589,824 bytes on its own 1 GB/s link
    one_node = toy_cluster(2, bw=1e9, lat=1e-5)
    assert SPEC.migration_bytes == 589_824
    assert modelled_probe_s(one_node, SPEC) == pytest.approx(589_824 / 1e9 + 1e-5)
    # 2 nodes of 2: ranks 1 -> 2 and 3 -> 0 cross the 0.1 GB/s inter-node links, which set it
    two_nodes = toy_cluster(2, nodes=2, bw=1e9, inter_bw=1e8, lat=1e-5)
    assert modelled_probe_s(two_nodes, SPEC) == pytest.approx(589_824 / 1e8 + 2e-5)
    # bulk transfers already stretched in the prior (a calibrated file) are priced so
    host = dataclasses.replace(one_node.host, transfer_scale=3.0)
    stretched = dataclasses.replace(one_node, host=host)
    assert modelled_probe_s(stretched, SPEC) == pytest.approx(3 * (589_824 / 1e9 + 1e-5))


def _probe(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    cluster = toy_cluster(world, bw=1e9, lat=1e-5)
    k, measured, modelled = probe_transfer_scale(cluster, SPEC, dist.group.WORLD, rounds=3)
    again = measure_probe_s(SPEC.migration_bytes, None, rounds=1)
    return k, measured, modelled, again


@pytest.mark.dist
def test_probe_on_gloo_ranks() -> None:
    results = run_ranks(_probe, 2)
    assert results[0] == results[1]  # one figure for every rank: the leader plans with it
    k, measured, modelled, again = results[0]
    assert modelled == pytest.approx(589_824 / 1e9 + 1e-5)
    assert measured > 0 and again > 0
    assert k == pytest.approx(measured / modelled)


def test_the_switch_probe_moves_half_a_ranks_experts_within_its_byte_bound() -> None:
    """8 experts on 2 ranks: 2 homes a rank (half of 4); on 8 ranks, 1 (never none); a bound of
    3 experts' bytes caps 32 experts on 2 ranks (half: 8) at 3. The moves by hand: 2 homes of
    589,824 bytes a rank on its 1 GB/s link, one latency."""
    import poise.runtime.selfcal.probe as probe

    assert switch_probe_homes(SPEC, 2) == 2 and switch_probe_homes(SPEC, 8) == 1
    wide = dataclasses.replace(SPEC, experts=32)
    assert switch_probe_homes(wide, 2) == 8
    bound = probe.SWITCH_PROBE_BYTES
    try:
        probe.SWITCH_PROBE_BYTES = 3 * SPEC.migration_bytes
        assert switch_probe_homes(wide, 2) == 3
    finally:
        probe.SWITCH_PROBE_BYTES = bound
    one_node = toy_cluster(2, bw=1e9, lat=1e-5)
    assert modelled_probe_s(one_node, SPEC, homes=2) == pytest.approx(2 * 589_824 / 1e9 + 1e-5)


def test_the_switch_probes_layer_holds_each_homes_migration_bytes() -> None:
    """The synthetic layer's weights and moments are `migration_bytes` a home, as the model
    prices them: 3 SwiGLU matrices and AdamW's 2 moments of each (8 bytes of state a
    parameter at 4 bytes one); a bf16 spec with 12 bytes of state holds 6 moments."""
    import torch

    from poise.runtime.selfcal.probe import _synthetic_layer

    for spec in (SPEC, dataclasses.replace(SPEC, dtype_bytes=2, optimizer_bytes_per_param=12.0)):
        params, opt = _synthetic_layer(spec, 3, torch.device("cpu"))
        held = sum(p.numel() * p.element_size() for p in params)
        held += sum(m.numel() * m.element_size() for p in params for m in opt.state[p].values())
        assert held == 3 * spec.migration_bytes
        assert [tuple(p.shape) for p in params] == [(3, 64, 256), (3, 64, 256), (3, 256, 64)]


def _switch_probe(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    from poise.runtime.moves.host_link import HostLink
    from poise.runtime.moves.transfers import Scratch

    cluster = toy_cluster(world, bw=1e9, lat=1e-5)
    scratch = Scratch()
    figures = probe_switch_scale(cluster, SPEC, dist.group.WORLD, rounds=3, scratch=scratch)
    link = HostLink.connect()
    assert link is not None
    channel = link.channel("migrate")
    through_link = probe_switch_scale(cluster, SPEC, dist.group.WORLD, rounds=3, link=channel)
    return figures, scratch.nbytes, through_link, channel.turns


@pytest.mark.dist
def test_switch_probe_on_gloo_ranks() -> None:
    """`transfers.migrate` of 2 synthetic homes a rank, timed: one figure on every rank, the
    scale its measured over its modelled seconds (2 homes of 589,824 bytes a rank). It leaves
    the buffers it was given sized for such a switch (2 homes sent and 2 received), and goes
    through the shared-memory channel it is given (a turn a migration: warm-up and 3 rounds)."""
    results = run_ranks(_switch_probe, 2)
    assert [r[0] for r in results] == [results[0][0]] * 2
    (k, measured, modelled, homes), kept, (k_link, *_), turns = results[0]
    assert homes == 2 and modelled == pytest.approx(2 * 589_824 / 1e9 + 1e-5)
    assert measured > 0 and k == pytest.approx(measured / modelled)
    assert kept == 2 * 2 * 589_824
    assert k_link > 0 and turns == 4


def _balancer_probes(rank: int, world: int, host_link: bool) -> tuple:
    from poise.runtime.balancer import Balancer
    from poise.runtime.plan_inputs import spec_from_layers
    from tests.test_runtime_balancer import _build

    model, opt = _build(world)
    balancer = Balancer(model, opt, "auto", replan_every=5, cluster=toy_cluster(world),
                        host_link=host_link)  # fmt: skip
    spec = spec_from_layers(list(model.blocks))
    turns = balancer.link.channels["migrate"].turns if balancer.link is not None else 0
    out = (balancer.switch_probe, balancer.moves.scratch.nbytes, spec.migration_bytes, turns)
    balancer.close()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("host_link", [False, True], ids=["gloo", "shared-memory"])
def test_the_balancer_probes_its_switches_own_path(host_link: bool) -> None:
    """A self-calibrating Balancer on 2 gloo ranks probes the first switch through its own
    `LayerMoves`: through gloo it leaves the buffers its switches keep sized for the probe's
    homes (sent and received); with `host_link` it migrates through its link's channel (a turn
    a migration: the warm-up and 5 rounds) and those buffers stay empty."""
    from poise.runtime.selfcal.fit import SCALE_LIMITS
    from poise.runtime.selfcal.probe import ROUNDS

    results = run_ranks(_balancer_probes, 2, host_link)
    (k, measured, modelled, homes), kept, migration_bytes, turns = results[0]
    # (the toy link has no latency: gloo's milliseconds over its microseconds can reach the
    # scale's upper limit on a loaded machine)
    assert k == pytest.approx(np.clip(measured / modelled, *SCALE_LIMITS)) and homes >= 1
    if host_link:
        assert kept == 0 and turns == ROUNDS + 1
    else:
        assert kept == 2 * homes * migration_bytes and turns == 0


def test_the_first_switch_is_priced_at_the_switch_probes_scale_until_one_is_measured() -> None:
    """A Balancer whose switch probe read 7: its jobs carry 7 as the switches' measured scale
    (`PlanningJob.measured_switch`) until the guard measured a switch (then the guard's
    `k_switch`, the scale the next job takes); without a probe, none."""
    from tests.test_runtime_balancer import _one_rank_balancer, _one_rank_steps, _spy_jobs

    model, opt, balancer = _one_rank_balancer(replan_every=2, plan_lag=0)
    jobs = _spy_jobs(balancer, lambda job, _: job.measured_switch)
    _one_rank_steps(model, opt, balancer, 2)
    balancer.switch_probe = (7.0, 0.07, 0.01, 2)
    _one_rank_steps(model, opt, balancer, 2)
    assert jobs == [None, 7.0]
    balancer.guard.record_switch(0.03, 0.01, migrate_s=0.03)  # measured: 3 times its model
    assert balancer._switch_scale() == pytest.approx(3.0)


def test_the_job_and_the_guard_price_the_first_switch_alike() -> None:
    """`run_job` prices migrations at the job's measured scale where calibrating
    (`JobResult.k_switch`), at the fit's `k_transfer` where not; the leader's guard takes the
    result's scale as its prior: a 10 ms modelled switch costs 70 ms at a probe's 7, 10 ms
    without one (`Fit()`'s k_transfer 1)."""
    from poise.runtime.guard import SwitchGuard
    from poise.runtime.planning_job import run_job
    from tests.test_forecast_backtest import _gain
    from tests.test_runtime_balancer import _static_auto_job

    job = _static_auto_job()
    assert run_job(dataclasses.replace(job, measured_switch=7.0)).k_switch == 7.0
    assert run_job(dataclasses.replace(job, measured_switch=None)).switch_prior == 1.0
    uncalibrated = dataclasses.replace(job, measured_switch=7.0, calibrate=False)
    assert run_job(uncalibrated).switch_prior == 1.0
    guard = SwitchGuard(horizon=10, margin=0.0)
    for k, switch_s in ((7.0, 70e-3), (None, 10e-3)):
        assert _leader_switch_s(guard, _gain(1e-3, 10e-3), k) == pytest.approx(switch_s)


def _leader_switch_s(guard, candidate, k_switch) -> float:
    from poise.core.placement import Plan
    from poise.runtime.leader import leader_outcome
    from poise.runtime.planning_job import JobResult
    from poise.runtime.selfcal.fit import Fit
    from tests.test_runtime_balancer import _replica_case

    cost, _, replica, _ = _replica_case()
    plan = Plan("fresh", replica.placement, replica.assignment, replica.transfers)
    result = JobResult(plan, candidate, cost.cluster, Fit(), None, horizon=10, k_switch=k_switch)
    return leader_outcome(
        guard, result, wait_s=0.0, plan_s=0.0, planning_s=0.0, on_static=False, period_s=0.2,
        plan_lag=1,
    ).switch_s  # fmt: skip


def _timed(rank: int, world: int) -> float:
    import time

    import torch
    import torch.distributed as dist

    from poise.runtime.selfcal.probe import timed_rounds

    def round_(r: int) -> None:  # a slow warm-up round; rank 1 slower than rank 0 throughout
        time.sleep((0.3, 0.02, 0.08)[r] + 0.05 * rank)

    return timed_rounds(round_, dist.group.WORLD, torch.device("cpu"), rounds=2)


@pytest.mark.dist
def test_timed_rounds_leave_out_the_warm_up_and_take_the_fastest_rank() -> None:
    """Rounds 1 and 2 of rank 0 sleep 20 and 80 ms, rank 1's 50 ms more, the warm-up 300 ms:
    the median of the fastest rank's timed rounds (the lower of two, as `torch.median` takes
    it) is rank 0's 20 ms (the sleep's overshoot aside), the same on both ranks; with the
    warm-up it would be 80, with the slower rank 70."""
    results = run_ranks(_timed, 2)
    assert results[0] == results[1]
    assert 0.020 <= results[0] < 0.050
