"""Links as capacities (`poise.cost.network`) and Trans as a broadcast (`traffic.replica_traffic`),
against hand-computed cases and properties."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.cluster import Link
from poise.core.placement import Assignment, Placement
from poise.core.presets import get_cluster
from poise.cost.model import CostModel
from poise.cost.network import (
    device_seconds,
    group_seconds,
    link_seconds,
    one_message_per_level,
)
from poise.cost.traffic import replica_messages, replica_traffic

from .helpers import toy_cluster, toy_spec


def _seconds(cluster, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
    """`link_seconds` of a phase in which each device has at most one peer per level and
    direction (one message wherever it moves a byte over a level)."""
    return link_seconds(cluster, send, recv, one_message_per_level(send, recv))


def _bytes(devices: int, **cells: float) -> tuple[np.ndarray, np.ndarray]:
    """`send[3, 1, D]`, `recv[3, 1, D]` with entries named like `s1_0` (send, level 1, device
    0) or `r2_3`."""
    send, recv = np.zeros((3, 1, devices)), np.zeros((3, 1, devices))
    for name, value in cells.items():
        kind, level, device = name[0], int(name[1]), int(name.split("_")[1])
        (send if kind == "s" else recv)[level, 0, device] = value
    return send, recv


def test_lone_hot_receiver_behind_a_shared_nic_gets_the_whole_nic() -> None:
    # 2 nodes of 8 devices, one 1e9 B/s NIC per node; device 8 receives 1e6 bytes from node 0.
    cluster = replace(toy_cluster(8, 2, bw=1e10, lat=0.0), inter_node=Link(1e9, 0.0, shared_by=8))
    send, recv = _bytes(16, s1_0=1e6, r1_8=1e6)
    assert _seconds(cluster, send, recv)[0] == pytest.approx(1e6 / 1e9)
    # Eight receivers behind that NIC at once share it: 8e6 bytes through one NIC.
    send, recv = np.zeros((3, 1, 16)), np.zeros((3, 1, 16))
    send[1, 0, :8] = 1e6
    recv[1, 0, 8:] = 1e6
    assert _seconds(cluster, send, recv)[0] == pytest.approx(8e6 / 1e9)


def test_levels_run_at_once_and_latencies_add_per_device() -> None:
    # 2 domains of 1 node of 2 devices: port 1e9, NIC 1e8, uplink 1e7 B/s; latencies 1, 10, 100 us.
    cluster = toy_cluster(2, 1, 2, bw=1e9, inter_bw=1e8, wan_bw=1e7)
    cluster = replace(
        cluster,
        intra_node=Link(1e9, 1e-6),
        inter_node=Link(1e8, 1e-5),
        inter_domain=Link(1e7, 1e-4),
    )
    # Device 0 sends 1e5 B inside its node and 1e4 B to the other domain (through its NIC and
    # the uplink): port 1e-4 s, NIC 1e4 / 1e8 = 1e-4 s, uplink 1e4 / 1e7 = 1e-3 s; the slowest
    # link sets the time; device 0 sends one message over level 0 (to device 1) and one over
    # level 2 (to device 2) and pays their latencies (none of level 1: the NIC only passes
    # the domain traffic on).
    send, recv = _bytes(4, s0_0=1e5, r0_1=1e5, s2_0=1e4, r2_2=1e4)
    assert _seconds(cluster, send, recv)[0] == pytest.approx(1e-3 + 1e-6 + 1e-4)


@pytest.mark.parametrize("preset", ["dgx-h100:2", "v100-ib50", "cross-dc-1000", "a800-eth10:4"])
def test_per_device_and_per_link_parts_make_link_seconds(preset: str) -> None:
    # The split the incremental searches keep (each device's own links and latencies, the
    # shared links' loads per link) recombines to `link_seconds` exactly, on clusters with a
    # NIC per GPU, one NIC per 8 GPUs and shared wide-area uplinks.
    cluster = get_cluster(preset)
    D = min(cluster.num_devices, 256)
    cluster = cluster if cluster.num_devices == D else _first_devices(cluster, D)
    rng = np.random.default_rng(0)
    send = rng.uniform(0, 1e8, size=(3, 5, cluster.num_devices))
    recv = rng.uniform(0, 1e8, size=(3, 5, cluster.num_devices))
    send[:, rng.random(5) < 0.4] = 0.0  # some phases idle at some levels
    if cluster.domains == 1:
        send[2] = recv[2] = 0.0
    # Peers per level and direction, as many as the level has devices at most.
    m_out = rng.integers(0, 9, size=send.shape).astype(float) * (send > 0)
    m_in = rng.integers(0, 9, size=recv.shape).astype(float) * (recv > 0)
    port, latency = device_seconds(
        cluster, *(x.transpose(1, 0, 2) for x in (send, recv, m_out, m_in))
    )
    shared = group_seconds(cluster, send.transpose(1, 0, 2), recv.transpose(1, 0, 2))
    recombined = np.maximum(port.max(axis=1), shared) + latency.max(axis=1)
    want = link_seconds(cluster, send, recv, (m_out, m_in))
    np.testing.assert_allclose(recombined, want, rtol=1e-15)


def _first_devices(cluster, devices: int):
    """`cluster` cut to its first `devices` devices, whole domains (a smaller test case)."""
    return replace(cluster, domains=devices // cluster.devices_per_domain)


def test_r_replicas_cost_about_one_broadcast_not_r_sends() -> None:
    # 4 nodes of 4 devices, NIC 1e9 B/s shared by 4; expert 0 homed on device 0 gets a replica
    # on every other device: the home sends W once, each remote node takes it in once.
    cluster = replace(toy_cluster(4, 4, bw=1e10), inter_node=Link(1e9, 0.0, shared_by=4))
    D, E, W = 16, 16, 1e6
    placement = Placement.from_homes(np.arange(E)[None, :], D, 2)
    placement.copies[0, :, 0] = 1
    send, recv = replica_traffic(cluster, placement, W)
    assert send.sum() == W  # one copy out of the home
    assert recv[1].sum() == 3 * W  # one per remote node, over its NIC
    assert recv[0].sum() == (3 + 3 * 3) * W  # the rest inside their nodes
    assert recv.sum() == 15 * W  # each of the 15 replicas receives it once
    # Its time is about one copy over the NIC, not 15 sends through the home's NIC share
    # (latency-free links: the bytes alone).
    messages = replica_messages(cluster, placement)
    t = link_seconds(cluster, send, recv, messages)[0]
    assert t == pytest.approx(W / 1e9)
    direct_send, direct_recv = replica_traffic(cluster, placement, W, broadcast=False)
    t_direct = link_seconds(cluster, direct_send, direct_recv, messages)[0]
    assert t_direct == pytest.approx(12 * W / 1e9)


def test_trans_in_the_cost_model_is_the_broadcast() -> None:
    cluster = replace(toy_cluster(4, 2, bw=1e10), inter_node=Link(1e9, 0.0, shared_by=4))
    spec = toy_spec(experts=8, d_model=64, d_expert=128)
    placement = Placement.from_homes(np.arange(8)[None, :], 8, 2)
    placement.copies[0, 1:, 0] = 1  # 7 replicas of expert 0
    counts = np.ones((1, 8, 8))
    phases, _ = CostModel(cluster, spec).phases(placement, Assignment.even(placement), counts)
    # One copy crosses node 1's NIC, the three others of node 0 take it over their ports.
    assert phases.trans_s[0] == pytest.approx(spec.expert_bytes / 1e9)
    assert phases.agg_s[0] == phases.trans_s[0]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    factor=st.floats(1.0, 100.0),
    level=st.integers(0, 2),
)
def test_adding_bandwidth_never_slows_any_plan(seed: int, factor: float, level: int) -> None:
    rng = np.random.default_rng(seed)
    cluster = toy_cluster(2, 2, 2, bw=1e9, inter_bw=1e8, wan_bw=1e7, lat=1e-6)
    cluster = replace(cluster, inter_node=Link(1e8, 1e-6, shared_by=2))
    spec = toy_spec(experts=8, layers=2, d_model=32, d_expert=64)
    D = cluster.num_devices
    home = rng.integers(0, D, size=(2, 8))
    placement = Placement.from_homes(home, D, 8)  # room for every expert on every device
    extra = rng.random((2, D, 8)) < 0.2
    placement.copies = np.where(extra, 1, placement.copies).astype(np.int32)
    counts = rng.integers(0, 200, size=(2, D, 8)).astype(np.float64)
    assignment = Assignment.even(placement)
    slow = CostModel(cluster, spec).price(placement, assignment, counts)
    name = ("intra_node", "inter_node", "inter_domain")[level]
    link = getattr(cluster, name)
    faster = replace(cluster, **{name: replace(link, bw_Bps=link.bw_Bps * factor)})
    fast = CostModel(faster, spec).price(placement, assignment, counts)
    assert np.all(fast.layer_s <= slow.layer_s * (1 + 1e-12))


def test_a_nic_carries_the_domain_traffic_of_single_node_domains() -> None:
    # 2 domains of one node of 2 devices: NIC 1e8 B/s, uplink 1e9 B/s (faster than the NIC).
    # Device 0 sends 1e6 bytes to device 2 in the other domain: it crosses its NIC and the
    # uplink; the NIC is the bottleneck, 1e6 / 1e8 = 1e-2 s, though no traffic stays between
    # nodes of one domain.
    cluster = toy_cluster(2, 1, 2, bw=1e10, inter_bw=1e8, wan_bw=1e9)
    send, recv = _bytes(4, s2_0=1e6, r2_2=1e6)
    assert _seconds(cluster, send, recv)[0] == pytest.approx(1e6 / 1e8)
