"""The live runtime's prior cluster for CPU ranks of one host (`poise.runtime.plan_inputs`): the
ranks' bulk transfers share one link, so bytes crossing in opposite directions add up."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement
from poise.cost.model import CostModel
from poise.runtime.plan_inputs import default_cluster

from .helpers import toy_spec


def test_one_hosts_ranks_share_one_link_for_their_bulk_bytes() -> None:
    assert default_cluster(2, ranks_on_host=2).intra_node.shared_by == 2
    assert default_cluster(4, ranks_on_host=8).intra_node.shared_by == 4  # the group's ranks
    assert default_cluster(2).intra_node.shared_by == 1  # host unknown: independent devices


def _with_replicas(holders: list[tuple[int, int]]) -> Placement:
    """2 devices, experts 0-1 at home on device 0 and 2-3 on device 1, 3 slots each, plus a
    copy of `expert` on `device` for each `(device, expert)`."""
    placement = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 3)
    for device, expert in holders:
        placement.copies[0, device, expert] = 1
    return placement


def _trans_s(cluster, placement: Placement) -> float:
    spec = toy_spec(experts=4, d_model=64, d_expert=128)
    pricer = CostModel(cluster, spec).pricer(placement, Assignment.to_home(placement))
    return float(pricer.trans_s[0])


def test_a_replica_each_way_costs_two_replicas_one_way_on_a_shared_host() -> None:
    """Trans seconds by hand (`poise.cost.network`: the most loaded link's bytes over its
    bandwidth plus one latency), with B = 2 * 64 * 128 * 4 bytes a replica: one replica costs
    lat + B / bw; one each way (device 0 holds a copy of expert 2, device 1 of expert 0) costs
    lat + 2B / bw on the host's one link, as two one way do; on full-duplex links (host not
    known) it costs what one does."""
    shared, duplex = default_cluster(2, ranks_on_host=2), default_cluster(2)
    link = shared.intra_node
    B = 2 * 64 * 128 * 4
    single = _with_replicas([(0, 2)])
    each_way = _with_replicas([(0, 2), (1, 0)])
    one_way = _with_replicas([(0, 2), (0, 3)])
    scale = shared.host.transfer_scale
    assert _trans_s(shared, single) == pytest.approx((link.lat_s + B / link.bw_Bps) * scale)
    assert _trans_s(shared, each_way) == pytest.approx((link.lat_s + 2 * B / link.bw_Bps) * scale)
    assert _trans_s(shared, one_way) == pytest.approx(_trans_s(shared, each_way))
    assert _trans_s(duplex, each_way) == pytest.approx(_trans_s(duplex, single))
    assert _trans_s(duplex, one_way) > _trans_s(duplex, each_way)


def test_a_cold_replica_beside_a_hot_ones_costs_on_a_shared_host() -> None:
    """One hot expert (3 on device 1) and the step's split: its copy on device 0 levels the
    layer alone, and a second replica the other way (cold expert 0 on device 1) levels it no
    better. On the host's one link that replica's bytes add to the step; on full-duplex links
    they cross beside the hot one's and cost nothing, so a planner pricing on them keeps it."""
    spec = toy_spec(experts=4, d_model=64, d_expert=128, tokens=1000)
    loads = np.array([[[20.0, 10.0, 30.0, 940.0], [10.0, 20.0, 30.0, 940.0]]])  # [L, D, E]
    hot = _with_replicas([(0, 3)])
    both = _with_replicas([(0, 3), (1, 0)])

    def step_s(cluster, placement: Placement) -> float:
        split = Assignment.to_home(placement).with_split()
        return float(CostModel(cluster, spec).price(placement, split, loads).step_s)

    shared, duplex = default_cluster(2, ranks_on_host=2), default_cluster(2)
    assert step_s(shared, both) > step_s(shared, hot)
    assert step_s(duplex, both) == pytest.approx(step_s(duplex, hot), rel=1e-3)
