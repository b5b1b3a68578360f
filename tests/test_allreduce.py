"""The hierarchical all-reduce of `poise.cost.collectives`: ring, tree, the faster one, levels."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.cluster import Cluster, Link
from poise.cost.collectives import (
    allreduce_s,
    fan_outs,
    hierarchical_allreduce_s,
    ring_allreduce_s,
    tree_allreduce_s,
)


def cluster() -> Cluster:
    """2 domains x 2 nodes x 4 devices: intra 10 GB/s, 1 us; inter 4 GB/s shared by 4, 5 us;
    wide area 1 GB/s shared by 4, 1 ms."""
    return Cluster(
        "ar",
        4,
        2,
        2,
        1e12,
        1e9,
        Link(10e9, 1e-6),
        Link(4e9, 5e-6, shared_by=4),
        Link(1e9, 1e-3, shared_by=4),
    )


def test_ring_and_tree_by_hand() -> None:
    assert ring_allreduce_s(4, 4e6, 1e9, 1e-5) == pytest.approx(2 * 3 / 4 * 4e-3 + 6e-5)
    assert tree_allreduce_s(4, 4e6, 1e9, 1e-5) == pytest.approx(2 * 4e-3 + 4e-5)
    assert tree_allreduce_s(5, 1.0, 1e9, 1.0) == pytest.approx(2e-9 + 6.0)  # ceil(log2 5) = 3
    assert ring_allreduce_s(1, 4e6, 1e9, 1e-5) == tree_allreduce_s(1, 4e6, 1e9, 1e-5) == 0.0
    assert ring_allreduce_s(8, 0.0, 1e9, 1e-5) == 0.0
    # Large payload, few members: the ring; many members behind a slow latency: the tree.
    assert allreduce_s(4, 4e6, 1e9, 1e-5) == ring_allreduce_s(4, 4e6, 1e9, 1e-5)
    assert allreduce_s(1000, 1e6, 1e9, 20e-3) == tree_allreduce_s(1000, 1e6, 1e9, 20e-3)


def test_fan_outs() -> None:
    c = cluster()
    assert fan_outs(c, np.arange(16)) == (4, 2, 2)
    assert fan_outs(c, np.array([0, 4, 8, 12])) == (1, 2, 2)  # one per node
    assert fan_outs(c, np.array([0, 2])) == (2, 1, 1)  # inside node 0
    assert fan_outs(c, np.array([0, 8])) == (1, 1, 2)  # one per domain


def test_hierarchical_levels_by_hand() -> None:
    c = cluster()
    G = 8e6
    # Inside one node: one level at the device's own link.
    assert hierarchical_allreduce_s(c, np.arange(4), G) == pytest.approx(
        allreduce_s(4, G, 10e9, 1e-6)
    )
    # Two nodes of one domain: the node's level, then G / 4 across the nodes; the node's 4
    # members each carry a shard through the shared link (4e9 / 4).
    assert hierarchical_allreduce_s(c, np.arange(8), G) == pytest.approx(
        allreduce_s(4, G, 10e9, 1e-6) + allreduce_s(2, G / 4, 1e9, 5e-6)
    )
    # One member per node in 4 nodes of 2 domains, 4 such groups at once: the inter-node link is
    # shared by 4 flows, the wide area too.
    assert hierarchical_allreduce_s(c, np.array([0, 4, 8, 12]), G, 4) == pytest.approx(
        allreduce_s(2, G, 1e9, 5e-6) + allreduce_s(2, G / 2, 0.25e9, 1e-3)
    )
    # Alone on the link, a group gets all of it.
    assert hierarchical_allreduce_s(c, np.array([0, 4, 8, 12]), G, 1) == pytest.approx(
        allreduce_s(2, G, 4e9, 5e-6) + allreduce_s(2, G / 2, 1e9, 1e-3)
    )
    assert hierarchical_allreduce_s(c, np.array([3]), G) == 0.0
