"""Collectives by their algorithms (`poise.cost.collectives`): each formula on a hand-computed
case, the properties the algorithms promise (a broadcast costs one message, not one per
receiver; more bandwidth never costs time; one member costs nothing) and nccl-tests' bus
bandwidth."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.errors import ConfigError
from poise.cost.collectives import (
    AlphaBeta,
    all_gather_s,
    all_to_all_s,
    allreduce_s,
    broadcast_s,
    bus_bandwidth,
    chain_broadcast_s,
    chain_reduce_s,
    collective_time,
    hierarchical_all_to_all_s,
    p2p_s,
    reduce_s,
    reduce_scatter_s,
    ring_allreduce_s,
    tree_allreduce_s,
    tree_broadcast_s,
    tree_reduce_s,
    two_level_all_to_all_s,
)

# The hand-computed case: n = 4 members, m = 1 MiB, bw = 10 GB/s, lat = 5 us.
N, M, BW, LAT = 4, 2**20, 10e9, 5e-6
WIRE = 1048576 / 10e9  # m / bw = 1.048576e-4 s

# Every collective on one link level, (n, nbytes, bw_Bps, lat_s) -> seconds.
ONE_LEVEL = {
    "chain_broadcast": chain_broadcast_s,
    "tree_broadcast": tree_broadcast_s,
    "broadcast": broadcast_s,
    "chain_reduce": chain_reduce_s,
    "tree_reduce": tree_reduce_s,
    "reduce": reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
    "ring_allreduce": ring_allreduce_s,
    "tree_allreduce": tree_allreduce_s,
    "allreduce": allreduce_s,
}


@pytest.mark.parametrize(
    ("name", "seconds"),
    [
        # pipelined chain: m / bw + (n - 1) lat = 1.048576e-4 + 3 * 5e-6
        ("chain_broadcast", 1.048576e-4 + 1.5e-5),
        ("chain_reduce", 1.048576e-4 + 1.5e-5),
        # double binary tree: m / bw + ceil(log2 4) lat = 1.048576e-4 + 2 * 5e-6
        ("tree_broadcast", 1.048576e-4 + 1.0e-5),
        ("tree_reduce", 1.048576e-4 + 1.0e-5),
        ("broadcast", 1.148576e-4),  # the tree: 2 hops of latency, not 3
        ("reduce", 1.148576e-4),
        # ring: (n - 1) / n m / bw + (n - 1) lat = 0.75 * 1.048576e-4 + 3 * 5e-6
        ("all_gather", 7.86432e-5 + 1.5e-5),
        ("reduce_scatter", 7.86432e-5 + 1.5e-5),
        # pairwise: (n - 1) (lat + m / (n bw)) = 3 * (5e-6 + 2.62144e-5)
        ("all_to_all", 3 * 3.12144e-5),
        # ring all-reduce: 2 * 7.86432e-5 + 6 * 5e-6
        ("ring_allreduce", 1.572864e-4 + 3.0e-5),
        # tree all-reduce: 2 * 1.048576e-4 + 2 * 2 * 5e-6
        ("tree_allreduce", 2.097152e-4 + 2.0e-5),
        ("allreduce", 1.872864e-4),  # the ring is faster at 1 MiB on 4 members
    ],
)
def test_each_collective_by_hand(name: str, seconds: float) -> None:
    assert ONE_LEVEL[name](N, M, BW, LAT) == pytest.approx(seconds, rel=1e-12)


def test_point_to_point_by_hand() -> None:
    assert p2p_s(M, BW, LAT) == pytest.approx(1.048576e-4 + 5e-6, rel=1e-12)
    assert p2p_s(0, BW, LAT) == 0.0


def test_the_algorithms_compose() -> None:
    # A ring all-reduce is a reduce-scatter then an all-gather; a tree all-reduce a reduce
    # then a broadcast (both pipelined).
    for n in (2, 3, 4, 7, 16):
        ring = ring_allreduce_s(n, M, BW, LAT)
        assert ring == pytest.approx(reduce_scatter_s(n, M, BW, LAT) + all_gather_s(n, M, BW, LAT))
        tree = tree_allreduce_s(n, M, BW, LAT)
        assert tree == pytest.approx(tree_reduce_s(n, M, BW, LAT) + tree_broadcast_s(n, M, BW, LAT))
    # The chain and the tree tie up to 3 members (ceil(log2 3) = 2 = 3 - 1), the tree wins after.
    assert chain_broadcast_s(3, M, BW, LAT) == tree_broadcast_s(3, M, BW, LAT)
    assert broadcast_s(9, M, BW, LAT) == pytest.approx(WIRE + 4 * LAT)  # ceil(log2 9) = 4


def test_the_alpha_beta_forms_agree() -> None:
    # The per-step form of `collective_time` with alpha = lat and beta = 1 / bw is the same model.
    ab = AlphaBeta(LAT, 1.0 / BW)
    for n in (1, 2, 4, 9):
        for name, fn in (
            ("all_to_all", all_to_all_s),
            ("all_gather", all_gather_s),
            ("reduce_scatter", reduce_scatter_s),
            ("all_reduce", ring_allreduce_s),
        ):
            assert fn(n, M, BW, LAT) == pytest.approx(float(collective_time(name, n, M, ab)))


def test_bus_bandwidth_of_the_rings_is_the_link() -> None:
    """nccl-tests (doc/PERFORMANCE.md): busBw = algBw * f(n) with f = 2 (n - 1) / n for
    all-reduce, (n - 1) / n for all-gather, reduce-scatter and all-to-all, 1 for broadcast and
    reduce. Without latency each algorithm here moves its bytes at exactly the link's rate."""
    for n in (2, 4, 8, 13):
        for collective, fn in (
            ("all_reduce", ring_allreduce_s),
            ("all_gather", all_gather_s),
            ("reduce_scatter", reduce_scatter_s),
            ("all_to_all", all_to_all_s),
            ("broadcast", broadcast_s),
            ("reduce", reduce_s),
        ):
            t = fn(n, M, BW, 0.0)
            assert bus_bandwidth(collective, n, M, t) == pytest.approx(BW, rel=1e-12)
    # By hand: a 4-member all-reduce of 1 MiB in 1 ms: algBw = 1.048576 GB/s, busBw = 1.5x that.
    assert bus_bandwidth("all_reduce", 4, M, 1e-3) == pytest.approx(1.048576e9 * 1.5)
    with pytest.raises(ConfigError, match="unknown collective"):
        bus_bandwidth("gather", 4, M, 1e-3)


def test_broadcast_to_r_receivers_costs_about_one_message() -> None:
    # 1 GiB to 7 replicas: one message's wire time plus 3 hops of latency, not 7 sends.
    m = 2**30
    for receivers in (1, 3, 7, 31):
        t = broadcast_s(receivers + 1, m, BW, LAT)
        assert t == pytest.approx(m / BW + math.ceil(math.log2(receivers + 1)) * LAT)
        assert t < 1.001 * p2p_s(m, BW, LAT) + 5 * LAT
        if receivers > 1:
            assert t < 0.6 * receivers * p2p_s(m, BW, LAT)
        assert reduce_s(receivers + 1, m, BW, LAT) == t


@pytest.mark.parametrize("name", sorted(ONE_LEVEL))
def test_one_member_or_no_bytes_costs_nothing(name: str) -> None:
    assert ONE_LEVEL[name](1, M, BW, LAT) == 0.0
    assert ONE_LEVEL[name](8, 0.0, BW, LAT) == 0.0


def test_hierarchical_all_to_all_by_hand() -> None:
    """Two nodes of 4 (n = 8), NVLink-like 10 GB/s and 5 us inside, 1 GB/s and 20 us across,
    1 MiB per member."""
    intra, inter = (BW, LAT), (1e9, 20e-6)
    # 2DH: the 4-member all-to-all inside the node, 3 (5e-6 + 2.62144e-5) = 9.36432e-5, then the
    # 2-member one across, 1 (2e-5 + 524288 / 1e9) = 5.44288e-4.
    two_d = hierarchical_all_to_all_s(4, 2, M, intra, inter)
    assert two_d == pytest.approx(9.36432e-5 + 5.44288e-4, rel=1e-12)
    # Flat: chunks of m / 8 = 131072 bytes, 3 rounds inside (5e-6 + 1.31072e-5) and 4 across
    # (2e-5 + 1.31072e-4).
    flat = two_level_all_to_all_s(4, 2, M, intra, inter)
    assert flat == pytest.approx(3 * 1.81072e-5 + 4 * 1.51072e-4, rel=1e-12)
    # The same bytes cross the network either way (half the buffer); 2DH pays 1 network latency
    # instead of 4, and one more pass inside the node.
    assert two_d < flat
    # Small messages on many nodes: 2DH wins by the latencies it saves ...
    many = (8, 32, 64 * 1024)
    assert hierarchical_all_to_all_s(*many, intra, inter) < 0.2 * two_level_all_to_all_s(
        *many, intra, inter
    )
    # ... large ones behind a slow node link: the extra pass inside the node loses.
    slow_inside = ((2e9, LAT), (4e9, 20e-6))
    assert hierarchical_all_to_all_s(4, 2, 2**30, *slow_inside) > two_level_all_to_all_s(
        4, 2, 2**30, *slow_inside
    )
    # One node: both are the one-level all-to-all; one member: nothing.
    assert hierarchical_all_to_all_s(4, 1, M, intra, inter) == all_to_all_s(4, M, *intra)
    assert two_level_all_to_all_s(4, 1, M, intra, inter) == pytest.approx(
        all_to_all_s(4, M, *intra)
    )
    assert hierarchical_all_to_all_s(1, 1, M, intra, inter) == 0.0
    assert two_level_all_to_all_s(1, 1, M, intra, inter) == 0.0


positive = st.floats(1e6, 1e12)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 64),
    nbytes=st.floats(0.0, 1e10),
    bw=positive,
    faster=st.floats(1.0, 100.0),
    lat=st.floats(0.0, 1e-2),
)
def test_more_bandwidth_never_costs_time(
    n: int, nbytes: float, bw: float, faster: float, lat: float
) -> None:
    for fn in ONE_LEVEL.values():
        assert fn(n, nbytes, bw * faster, lat) <= fn(n, nbytes, bw, lat)
    assert p2p_s(nbytes, bw * faster, lat) <= p2p_s(nbytes, bw, lat)
    g, nodes = max(1, n // 4), 4
    for fn2 in (hierarchical_all_to_all_s, two_level_all_to_all_s):
        slow = fn2(g, nodes, nbytes, (bw, lat), (bw / 4, lat))
        assert fn2(g, nodes, nbytes, (bw * faster, lat), (bw / 4, lat)) <= slow
        assert fn2(g, nodes, nbytes, (bw, lat), (bw / 4 * faster, lat)) <= slow
