"""The static baseline with more devices than experts is DeepSpeed-MoE's expert-parallel groups
(issue 66; `poise.core.static_ep`; deepspeed/utils/groups.py, `_get_expert_parallel_ranks`):
device d holds expert d mod E and a token goes only to the copy inside its own group of E
consecutive devices. Checked against hand-computed tokens, bytes and messages, and a price
computed message by message."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment
from poise.core.static_ep import (
    ep_group_size,
    static_assignment,
    static_copies,
    static_homes,
    static_placement,
)
from poise.cost.model import CostModel, expert_seconds
from poise.cost.traffic import Routing, level_traffic, replica_messages
from poise.nn.dispatch import RankRouting
from poise.plan.policies import PlanContext, make_plan

from .helpers import toy_cluster, toy_spec

# E = 2 experts on D = 4 devices: EP groups {0, 1} and {2, 3}; expert 0 on devices 0 and 2,
# expert 1 on devices 1 and 3. One layer of loads c[d, e] (tokens device d routes to e).
LOADS = np.array([[[10.0, 1.0], [2.0, 20.0], [3.0, 30.0], [40.0, 4.0]]])
# By hand: each device keeps its own tokens of the expert it holds and sends the others to its
# group's partner: 0 -> 1: 1 token (e1), 1 -> 0: 2 (e0), 2 -> 3: 30 (e1), 3 -> 2: 40 (e0).
MESSAGES = {(0, 1): 1.0, (1, 0): 2.0, (2, 3): 30.0, (3, 2): 40.0}
RECEIVED = np.array([[[12.0, 0.0], [0.0, 21.0], [43.0, 0.0], [0.0, 34.0]]])  # [L, D, E]


def test_layout_is_deepspeeds_expert_parallel_groups() -> None:
    assert ep_group_size(2, 4) == 2 and ep_group_size(4, 4) == 0 and ep_group_size(3, 4) == 0
    np.testing.assert_array_equal(static_copies(2, 4), [0, 1, 0, 1])
    np.testing.assert_array_equal(static_homes(3, 2, 4), [[0, 1]] * 3)  # group 0's copies
    # 32 experts on 8,000 devices (`cross-dc-1000`): 250 EP groups, each copy at d mod 32.
    p = static_placement(1, 32, 8000, 1)
    np.testing.assert_array_equal(p.copies[0].argmax(axis=1), np.arange(8000) % 32)
    np.testing.assert_array_equal(p.home[0], np.arange(32))
    # No more devices than experts: contiguous blocks, as before.
    np.testing.assert_array_equal(static_homes(1, 8, 4), [[0, 0, 1, 1, 2, 2, 3, 3]])


def test_tokens_stay_in_their_group_by_hand() -> None:
    placement = static_placement(1, 2, 4, 1)
    assignment = static_assignment(placement)
    assignment.validate(placement)
    assert assignment.grouped and assignment.group_size == 2
    np.testing.assert_array_equal(assignment.received(placement, LOADS), RECEIVED)
    routes = assignment.split(placement, LOADS.astype(np.int64))[0]  # [Ds, E, Dd]
    flow = routes.sum(axis=1)  # [Ds, Dd]
    want = np.diag(np.array([10, 20, 3, 4]))  # what each device keeps
    for (s, d), tokens in MESSAGES.items():
        want[s, d] = tokens
    np.testing.assert_array_equal(flow, want)
    # The live runtime's static routing is the same, rank by rank.
    for rank in range(4):
        live = RankRouting.static(2, 4, rank, 1)
        np.testing.assert_array_equal(live.weights, assignment.source_weights()[0, rank])


@pytest.mark.parametrize(
    ("dpn", "nodes", "domains", "level", "edp_level"),
    [(1, 4, 1, 1, 1), (1, 1, 4, 2, 2), (2, 1, 2, 0, 2)],  # a device per node, per domain; a
)  # group per node (and domain)
def test_bytes_messages_and_price_by_hand(
    dpn: int, nodes: int, domains: int, level: int, edp_level: int
) -> None:
    # The EP groups of 2 are two nodes of one domain, two domains, or one node: every message
    # crosses `level`, and each expert's two copies are `edp_level` apart. The price is computed
    # message by message: a device's link carries the larger of what it sends and receives, one
    # latency per peer.
    bw, lat, flops = 1e9, 1e-6, 1e12
    cluster = toy_cluster(dpn, nodes, domains, bw=bw, lat=lat, flops=flops)
    spec = toy_spec(experts=2, d_model=4, d_expert=8)
    tb = spec.token_bytes
    placement = static_placement(1, 2, 4, 1)
    assignment = static_assignment(placement)
    send, recv = level_traffic(cluster, placement, assignment, LOADS)
    want_send, want_recv = np.zeros((3, 1, 4)), np.zeros((3, 1, 4))
    want_out, want_in = np.zeros((3, 1, 4)), np.zeros((3, 1, 4))
    for (s, d), tokens in MESSAGES.items():
        want_send[level, 0, s] += tokens
        want_recv[level, 0, d] += tokens
        want_out[level, 0, s] += 1
        want_in[level, 0, d] += 1
    np.testing.assert_allclose(send, want_send)
    np.testing.assert_allclose(recv, want_recv)
    out, into = Routing(cluster, placement, assignment).messages(LOADS, tb)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(into, want_in)
    # Naive price: bytes of the busiest device link, plus its latencies (one message each way).
    heaviest = max(
        max(sum(t for (s, _), t in MESSAGES.items() if s == d), sum(t for (_, r), t in
            MESSAGES.items() if r == d))
        for d in range(4)
    )  # fmt: skip
    assert heaviest == 40.0
    phases, device_load = CostModel(cluster, spec).phases(placement, assignment, LOADS)
    assert phases.dispatch_s[0] == pytest.approx(heaviest * tb / bw + lat, rel=1e-12)
    assert phases.combine_s[0] == pytest.approx(heaviest * tb / bw + lat, rel=1e-12)
    np.testing.assert_array_equal(device_load, RECEIVED.sum(axis=2))
    fec = float(expert_seconds(cluster, spec, np.float64(43.0)))  # the busiest device: 43 rows
    assert phases.expert_fwd_s[0] == pytest.approx(fec, rel=1e-12)
    # Trans: each home (devices 0, 1) sends its expert to its replica (2, 3), one message each.
    t_out, t_in = replica_messages(cluster, placement)
    np.testing.assert_array_equal(t_out[edp_level, 0], [1, 1, 0, 0])
    np.testing.assert_array_equal(t_in[edp_level, 0], [0, 0, 1, 1])
    assert t_out.sum() == t_in.sum() == 2
    assert phases.trans_s[0] == pytest.approx(spec.expert_bytes / bw + lat, rel=1e-12)


def test_the_global_split_is_not_the_baseline() -> None:
    # What static did before issue 66 with D > E: every expert's remote tokens split evenly over
    # all its copies, the other group's included. With the groups as two domains ({0, 1},
    # {2, 3}), DeepSpeed sends no token across domains; the global split sends half of each
    # source's: (1 + 2 + 30 + 40) / 2 = 36.5 tokens.
    cluster = toy_cluster(2, 1, 2)
    placement = static_placement(1, 2, 4, 1)
    glob = Assignment.even(placement)
    assert not np.array_equal(glob.received(placement, LOADS), RECEIVED)
    send_g, _ = level_traffic(cluster, placement, glob, LOADS)
    send_l, _ = level_traffic(cluster, placement, static_assignment(placement), LOADS)
    assert send_l[2].sum() == 0.0 and send_l[0].sum() == sum(MESSAGES.values())
    assert send_g[2].sum() == 36.5


def test_static_policy_plan_and_the_fallback() -> None:
    cluster = toy_cluster(1, 4, 1)
    spec = toy_spec(experts=2, d_model=4, d_expert=8)
    ctx = PlanContext.create(cluster, spec, slots_per_device=1)
    plan = make_plan("static", LOADS, None, ctx)
    assert plan.notes["ep_group_size"] == 2 and plan.assignment.group_size == 2
    np.testing.assert_array_equal(plan.cost.device_load, RECEIVED.sum(axis=2))
    # 3 experts on 4 devices: no DeepSpeed configuration (3 does not divide 4): a block of
    # devices per expert (0, 0, 1, 2), the first its home, tokens split over all copies.
    three = static_placement(1, 3, 4, 1)
    np.testing.assert_array_equal(three.copies[0].argmax(axis=1), [0, 0, 1, 2])
    np.testing.assert_array_equal(three.home[0], [0, 2, 3])
    assert not static_assignment(three).grouped
