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

    from poise.runtime.moves.exchange import Scratch
    from poise.runtime.moves.host_link import HostLink

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
    from poise.runtime.balancer import Balancer, BalancerConfig
    from poise.runtime.plan_inputs import spec_from_layers
    from tests.test_runtime_balancer import _build

    model, opt = _build(world)
    config = BalancerConfig(cluster=toy_cluster(world), host_link=host_link)
    balancer = Balancer(model, opt, "auto", 5, config)
    spec = spec_from_layers(list(model.blocks))
    link = balancer.moves.link
    turns = link.channels["migrate"].turns if link is not None else 0
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
    """A Balancer whose switch probe read 7 prices switches at 7 (`SwitchPrice.prior`) and hands
    it to its jobs as `auto`'s migration scale, until a switch is measured; then that one's."""
    from poise.runtime.control.pricing import SwitchPrice
    from tests.helpers import one_rank_balancer, one_rank_steps, spy_jobs

    model, opt, balancer = one_rank_balancer(replan_every=2, plan_lag=0)
    jobs = spy_jobs(balancer, lambda job, _: job.switch_scale)
    one_rank_steps(model, opt, balancer, 2)
    balancer.planning.switch_price = SwitchPrice(prior=7.0)  # as the probe would set it
    one_rank_steps(model, opt, balancer, 2)
    assert jobs == [1.0, 7.0]  # one rank: no probe, the prior 1
    assert balancer.planning.switch_price.cost(0.010) == pytest.approx(0.070)
    balancer.planning.switch_price.record(0.03, 0.01, 0.03)  # measured: 3 times its model
    one_rank_steps(model, opt, balancer, 2)
    assert jobs[-1] == pytest.approx(3.0)
    balancer.close()


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
