"""Latency per message (`poise.cost.messages`, `poise.cost.network`): a device pays a level's
latency once per peer it exchanges with there, through the cost model's own traffic path."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.cluster import Link
from poise.core.placement import Assignment, Placement
from poise.cost import messages
from poise.cost.model import CostModel
from poise.cost.traffic import Routing, replica_messages, sends

from .helpers import toy_cluster, toy_spec


def test_a_phase_by_hand_two_nodes_of_two() -> None:
    # 4 devices, 2 nodes of 2 (device d in node d // 2), one domain; ports 1e9 B/s with 1 us
    # latency, NICs 1e8 B/s with 10 us; expert e homed on device e, tokens to the homes; 16
    # bytes a token (toy_spec: 4 * d_model).
    cluster = replace(toy_cluster(2, 2, 1), intra_node=Link(1e9, 1e-6), inter_node=Link(1e8, 1e-5))
    spec = toy_spec(experts=4)
    placement = Placement.from_homes(np.arange(4)[None, :], 4, 2)
    counts = np.zeros((1, 4, 4))
    counts[0, 0] = [10, 10, 20, 30]  # device 0 keeps 10, sends 10 to 1, 20 to 2, 30 to 3
    counts[0, 1, 0] = 5  # device 1 sends 5 to 0
    counts[0, 3, 2] = 40  # device 3 sends 40 to 2
    phases, _ = CostModel(cluster, spec).phases(placement, Assignment.to_home(placement), counts)
    # Bytes: the busiest port carries 40 * 16 = 640 B (6.4e-7 s); device 0's NIC sends
    # (20 + 30) * 16 = 800 B (8e-6 s), the slowest link.
    # Messages: device 0 sends to 1 over level 0 and to 2 and 3 over level 1, and receives from
    # 1: m_0 = 1, m_1 = 2, so 1e-6 + 2 * 1e-5; device 2 receives from 3 (level 0) and 0 (level
    # 1): 1.1e-5; the others less. (The per-level charge gave device 0 1.1e-5.)
    want = 800 / 1e8 + (1e-6 + 2 * 1e-5)
    assert phases.dispatch_s[0] == pytest.approx(want, rel=1e-12)
    assert phases.combine_s[0] == pytest.approx(want, rel=1e-12)
    # Trans: expert 0 replicated on devices 2 and 3 (node 1): the broadcast's bytes cross one
    # NIC once (W = 2 * 4 * 8 * 4 = 256 B: 2.56e-6 s); the home sends one message to each
    # replica device over level 1: 2 * 1e-5 (the per-level charge: 1e-5).
    placement.copies[0, [2, 3], 0] = 1
    phases, _ = CostModel(cluster, spec).phases(placement, Assignment.to_home(placement), counts)
    assert spec.expert_bytes == 256
    assert phases.trans_s[0] == pytest.approx(256 / 1e8 + 2 * 1e-5, rel=1e-12)
    assert phases.agg_s[0] == phases.trans_s[0]


def _domains_cluster(G: int, S: int, lat: tuple[float, float]) -> object:
    """G devices in G / S domains of one node of S devices; links so fast that a phase is its
    latency (level-0 latency `lat[0]`, wide-area `lat[1]`)."""
    cluster = toy_cluster(S, 1, G // S)
    return replace(
        cluster,
        intra_node=Link(1e30, lat[0]),
        inter_node=Link(1e30, 0.0),
        inter_domain=Link(1e30, lat[1]),
    )


@pytest.mark.parametrize(("G", "S"), [(16, 4), (32, 8), (12, 2)])
def test_hybridep_table_vii_message_counts(G: int, S: int) -> None:
    # HybridEP (arXiv 2510.19470) Table VII: a vanilla EP all-to-all among G GPUs is G (G - 1)
    # messages; HybridEP's all-to-all G (G / S - 1) and its in-domain all-gather G (S - 1).
    # Expert e homed on device e, tokens to the homes (one token is 16 bytes).
    a, b = 1e-6, 1e-3
    cluster = _domains_cluster(G, S, (a, b))
    spec = toy_spec(experts=G)
    cost = CostModel(cluster, spec)
    home = np.arange(G)[None, :]
    placement = Placement.from_homes(home, G, G)
    assignment = Assignment.to_home(placement)
    # (a) Vanilla: every device sends a token to every expert.
    counts = np.ones((1, G, G))
    out, into = Routing(cluster, placement, assignment).messages(counts, spec.token_bytes)
    assert out.sum() == into.sum() == G * (G - 1)
    assert np.maximum(out, into).sum() == G * (G - 1)  # m summed over devices and levels
    # Each device: S - 1 peers in its domain (level 0), G - S outside (level 2).
    dispatch = cost.phases(placement, assignment, counts)[0].dispatch_s[0]
    assert dispatch == pytest.approx((S - 1) * a + (G - S) * b, rel=1e-9)
    # (b) HybridEP: device (g, i) sends only to device i of every other domain, and every
    # device holds replicas of its domain's experts (the in-domain all-gather, Trans).
    domain, index = np.arange(G) // S, np.arange(G) % S
    pattern = (index[:, None] == index[None, :]) & (domain[:, None] != domain[None, :])
    counts = pattern[None].astype(np.float64)
    placement.copies[0] = (domain[:, None] == domain[None, :]).astype(np.int32)
    out, into = Routing(cluster, placement, assignment).messages(counts, spec.token_bytes)
    assert out.sum() == into.sum() == np.maximum(out, into).sum() == G * (G // S - 1)
    assert out[2].sum() == out.sum()  # all across domains
    t_out, t_in = replica_messages(cluster, placement)
    assert t_out.sum() == t_in.sum() == np.maximum(t_out, t_in).sum() == G * (S - 1)
    phases = cost.phases(placement, assignment, counts)[0]
    assert phases.dispatch_s[0] == pytest.approx((G // S - 1) * b, rel=1e-9)
    assert phases.trans_s[0] == pytest.approx((S - 1) * a, rel=1e-9)


def _brute_messages(cluster, routing: Routing, counts: np.ndarray, token_bytes: float):
    """`(out, into)` `[3, L, D]` from the `[L, D, D]` pairs: s sends to d iff some expert has a
    message's worth of s's remote tokens and d gets a share of them under the rule s applies
    (`Assignment.source_weights`)."""
    D = cluster.num_devices
    go = sends(routing.remote(counts), token_bytes).astype(np.float64)  # [L, D, E]
    share = routing.assignment.source_weights()  # [L, Ds, E, Dd]
    pairs = np.einsum("lse,lsed->lsd", go, (share > 0).astype(np.float64)) > 0
    pairs &= ~np.eye(D, dtype=bool)
    level = cluster.level_between(np.arange(D)[:, None], np.arange(D)[None, :])
    out = np.stack([(pairs & (level == v)).sum(axis=2) for v in range(3)])
    into = np.stack([(pairs & (level == v)).sum(axis=1) for v in range(3)])
    return out, into


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(2, 2, 2), (4, 2, 1), (2, 3, 2), (1, 4, 2), (4, 1, 3)]),
    grouped=st.booleans(),
    direct=st.booleans(),
)
def test_routing_messages_equal_the_pairs_counted_one_by_one(
    seed: int, shape: tuple[int, int, int], grouped: bool, direct: bool
) -> None:
    # Replicas, even splits, some sources without tokens, group-local routing by domain (or by
    # node on one domain, or by two domains); counted inside short runs at once or through
    # classes of masks.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(messages, "DIRECT_RUN", 128 if direct else 0)
        _check_messages(seed, shape, grouped)


def _check_messages(seed: int, shape: tuple[int, int, int], grouped: bool) -> None:
    rng = np.random.default_rng(seed)
    cluster = toy_cluster(*shape)
    D, E, L = cluster.num_devices, 6, 2
    placement = Placement.from_homes(rng.integers(0, D, (L, E)), D, E)
    placement.copies[rng.random((L, D, E)) < 0.25] = 1
    counts = np.floor(rng.zipf(1.5, (L, D, E)) * (rng.random((L, D, E)) < 0.6))
    assignment = Assignment.even(placement)
    if grouped:
        size = cluster.devices_per_domain if cluster.domains > 1 else cluster.devices_per_node
        if cluster.domains % 2 == 0 and seed % 2:  # groups of two domains (DeepSpeed's EP
            size *= 2  # groups across domains, issue 66)
        assignment = Assignment.group_local(placement, size, base=assignment)
    routing = Routing(cluster, placement, assignment)
    got = routing.messages(counts, 16.0)
    want = _brute_messages(cluster, routing, counts, 16.0)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_a_residue_of_tokens_is_no_message() -> None:
    # 1e-13 tokens left by a difference of sums carry less than a byte: no message, no latency.
    cluster = toy_cluster(2, 1, 1, lat=1e-3)
    spec = toy_spec(experts=2)
    placement = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    counts = np.array([[[0.0, 1e-13], [0.0, 0.0]]])
    phases, _ = CostModel(cluster, spec).phases(placement, Assignment.to_home(placement), counts)
    assert phases.dispatch_s[0] == 0.0
    counts[0, 0, 1] = 1.0
    phases, _ = CostModel(cluster, spec).phases(placement, Assignment.to_home(placement), counts)
    assert phases.dispatch_s[0] == pytest.approx(16 / 1e9 + 1e-3, rel=1e-12)
