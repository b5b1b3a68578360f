"""The step's work outside the MoE layers (`poise.cost.step_overheads`) on hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest

from poise.core.cluster import HostCosts
from poise.core.errors import ConfigError
from poise.cost.step_overheads import NORM_BYTES, StepWork, allreduce_seconds, step_overheads

from .helpers import toy_cluster, toy_spec


def test_params_per_device_count_dense_and_slots() -> None:
    spec = toy_spec(experts=4, layers=3, d_model=4, d_expert=8)  # GELU: P_e = 2 * 4 * 8 = 64
    work = StepWork.of(spec, dense_params=1000, slots_per_device=2)
    assert work == StepWork(1000, 1000 + 2 * 3 * 64, 4.0, counts_bytes=8 * 3 * 4)
    with pytest.raises(ConfigError, match="dense_params"):
        StepWork(10, 5, 4.0)


def test_measured_allreduce_and_linear_host_terms() -> None:
    host = HostCosts(
        optimizer_s=1e-3, optimizer_s_per_param=2e-9, clip_s=5e-4, clip_s_per_param=1e-9,
        allreduce_lat_s=1e-4, allreduce_bw_Bps=1e9,
    )  # fmt: skip
    cluster = dataclasses.replace(toy_cluster(2), host=host)
    work = StepWork(dense_params=250_000, params=1_000_000, grad_bytes=4, counts_bytes=256)
    got = step_overheads(cluster, work)
    assert got["grad_allreduce_s"] == pytest.approx(1e-4 + 1e6 / 1e9)
    assert got["counts_s"] == pytest.approx(1e-4 + 256 / 1e9)
    assert got["clip_s"] == pytest.approx(5e-4 + 1e-3 + 1e-4 + NORM_BYTES / 1e9)
    assert got["optimizer_s"] == pytest.approx(1e-3 + 2e-3)


def test_allreduce_on_links_without_a_measured_one() -> None:
    # 2 devices on one node: ring 2 (n-1)/n G / bw + 2 (n-1) lat = G / bw + 2 lat beats the
    # tree 2 G / bw + 2 lat.
    cluster = toy_cluster(2, bw=1e9, lat=1e-5)
    assert allreduce_seconds(cluster, 1e6) == pytest.approx(1e-3 + 2e-5)
    assert allreduce_seconds(cluster, 0) == 0.0
    assert allreduce_seconds(toy_cluster(1), 1e6) == 0.0
    # default host costs: only the all-reduces remain
    got = step_overheads(cluster, StepWork(1000, 5000, 4.0))
    assert got["optimizer_s"] == 0.0 and got["counts_s"] == 0.0
    assert got["clip_s"] == pytest.approx(allreduce_seconds(cluster, NORM_BYTES))
    assert got["grad_allreduce_s"] == pytest.approx(4000 / 1e9 + 2e-5)


def test_dense_gradients_all_reduced_every_step_for_every_policy() -> None:
    """The dense gradients' hierarchical all-reduce is in every simulated step of every policy,
    static included. 2 nodes x 2 devices: 1 GB/s inside a node, 0.1 GB/s across (a link per
    device), 10 us everywhere; 100 000 fp32 dense parameters: G = 4e5 bytes.

    Inside each node (2 members, per-device link): ring 2 (1/2) 4e5 / 1e9 + 2 * 1e-5 = 4.2e-4
    (the tree, 2 * 4e5 / 1e9 + 2e-5, is slower). Across the 2 nodes, the G / 2 = 2e5 shard each
    member holds: ring 2 (1/2) 2e5 / 1e8 + 2e-5 = 2.02e-3. In all 2.44e-3 s.
    The routing counts (8 L E = 32 bytes) take 32 / 1e9 + 2e-5 + 16 / 1e8 + 2e-5 = 4.0192e-5 s
    and the clip's norm (8 bytes) 8 / 1e9 + 2e-5 + 4 / 1e8 + 2e-5 = 4.0048e-5 s."""
    import numpy as np

    from poise.sim.simulator import simulate

    cluster = toy_cluster(2, 2, bw=1e9, inter_bw=1e8, lat=1e-5)
    spec = toy_spec(experts=4, layers=1, tokens=100)
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(6, 1, 4, 4)).astype(np.float64)
    counts[:, 0, :, 0] += 200  # a hot expert, so that the policies differ from static
    grad, gather, norm = 2.44e-3, 4.0192e-5, 4.0048e-5
    assert allreduce_seconds(cluster, 4e5) == pytest.approx(grad, rel=1e-12)
    policies = ["static", "eplb", "vexpert"]
    kw = {"count_planning": False, "slots_per_device": 2}
    bare = simulate(counts, cluster, spec, policies, "sync", 1, "last", dense_params=None, **kw)
    bare = bare.runs
    runs = simulate(counts, cluster, spec, policies, "sync", 1, "last", dense_params=100_000, **kw)
    for name in policies:
        run = runs.runs[name]
        np.testing.assert_allclose(run.outside_s["grad_allreduce_s"], grad, rtol=1e-12)
        np.testing.assert_allclose(run.outside_s["counts_s"], gather, rtol=1e-12)
        np.testing.assert_allclose(run.outside_s["clip_s"], norm, rtol=1e-12)
        np.testing.assert_allclose(
            run.step_s - run.layer_s.sum(axis=1), grad + gather + norm, rtol=1e-9
        )
        # Same plans, same layers: the steps differ by the outside work alone.
        np.testing.assert_allclose(run.step_s - bare[name].step_s, grad + gather + norm, rtol=1e-9)
    assert runs.runs["eplb"].last_plan.placement.replicas().sum() > 0  # a plan unlike static's
