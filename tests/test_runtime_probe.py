"""`poise.runtime.probe`: the start-up bulk-transfer probe priced by hand and measured on real
gloo ranks (every rank gets the same figures)."""

from __future__ import annotations

import dataclasses

import pytest

from poise.core.spec import ModelSpec
from poise.runtime.launch import run_ranks
from poise.runtime.probe import measure_probe_s, modelled_probe_s, probe_transfer_scale

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
