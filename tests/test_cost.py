"""The cost model on cases small enough to compute by hand."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement, transfers_between
from poise.cost.model import CostModel, PlanPricer
from poise.cost.schedule import Schedule, parse_schedule
from poise.cost.traffic import level_traffic

from .helpers import toy_cluster, toy_spec

# toy_spec: d_model 4, d_expert 8, fp32 GELU -> token 16 B, expert 256 B, 128 FLOP per token fwd.
COUNTS = np.array([[[10, 30], [20, 40]]], dtype=float)  # [L=1, D=2, E=2]


def model() -> CostModel:
    return CostModel(toy_cluster(bw=1e9, flops=1e9), toy_spec(experts=2))


def test_static_two_devices_by_hand() -> None:
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    phases, load = model().phases(p, Assignment.to_home(p), COUNTS)
    # d0 sends 30 tokens (to e1), receives 20 (for e0): max 30 * 16 B / 1e9 B/s.
    assert phases.dispatch_s[0] == pytest.approx(30 * 16 / 1e9)
    assert phases.combine_s[0] == pytest.approx(30 * 16 / 1e9)
    # d1 computes 70 tokens of e1: 70 * 128 FLOP / 1e9 FLOP/s.
    assert phases.expert_fwd_s[0] == pytest.approx(70 * 128 / 1e9)
    assert phases.expert_bwd_s[0] == pytest.approx(2 * 70 * 128 / 1e9)
    assert phases.trans_s[0] == 0 and phases.agg_s[0] == 0
    np.testing.assert_allclose(load[0], [30, 70])


def test_ranks_that_share_cores_pay_for_the_total_or_the_slowest() -> None:
    """4 CPU ranks on 2 cores' worth of compute (`shared_cores` 2): the layer takes the slowest
    rank's expert seconds or the total over 2, whichever is longer (hand-worked)."""
    import dataclasses

    cluster = toy_cluster(devices_per_node=4, bw=1e9, flops=1e9)
    shared = dataclasses.replace(cluster, host=dataclasses.replace(cluster.host, shared_cores=2.0))
    spec = toy_spec(experts=4)
    p = Placement.from_homes(np.array([[0, 1, 2, 3]]), 4, 1)
    per_token = 128 / 1e9
    for rows, independent, sharing in (
        ([20, 20, 10, 10], 20, 30),  # total 60 over 2 cores: 30 > the slowest rank's 20
        ([40, 10, 5, 5], 40, 40),  # the slowest rank (40) > total 60 over 2
    ):
        counts = np.diag(np.asarray(rows, dtype=float))[None]  # each rank routes to its own expert
        free, _ = CostModel(cluster, spec).phases(p, Assignment.to_home(p), counts)
        both, _ = CostModel(shared, spec).phases(p, Assignment.to_home(p), counts)
        assert free.expert_fwd_s[0] == pytest.approx(independent * per_token)
        assert both.expert_fwd_s[0] == pytest.approx(sharing * per_token)
        assert both.expert_bwd_s[0] == pytest.approx(2 * sharing * per_token)


def test_expert_call_floor_by_hand() -> None:
    """`Cluster.expert_call_floor_s` phi: a device that computes a row takes at least phi for
    its layer's expert forward + backward, phi / 3 forward and 2 phi / 3 backward; with many
    rows the GEMM model; 0 rows 0 s; below one row the floor in proportion (hand-worked)."""
    import dataclasses

    phi = 3e-5  # forward floor phi / 3 = 1e-5 s
    cluster = dataclasses.replace(
        toy_cluster(bw=1e9, flops=1e9), gemm_half_rows=16.0, expert_call_floor_s=phi
    )
    cost = CostModel(cluster, toy_spec(experts=2))
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)  # e0 on d0, e1 on d1
    a = Assignment.to_home(p)

    def gemm(rows: float) -> float:  # one expert's forward GEMM: 128 FLOP a row at 1e9 FLOP/s
        return 128 * (rows + 16 * min(rows, 1.0)) / 1e9

    assert gemm(2) < phi / 3 < gemm(100)
    for routed, device_0 in (
        (2.0, phi / 3),  # 2 rows: 2.304e-6 s by the GEMMs, floored to 1e-5
        (0.0, 0.0),  # no rows: no call
        (0.5, 0.5 * phi / 3),  # half a row: half the floor (gemm(0.5) = 1.088e-6 below it)
    ):
        counts = np.array([[[routed, 50.0], [0.0, 50.0]]])  # d1 computes 100 rows of e1
        per_device = cost.pricer(p, a).device_compute_s(counts)[0]  # forward seconds [D]
        assert per_device[0] == pytest.approx(device_0, rel=1e-12, abs=1e-18)
        assert per_device[1] == pytest.approx(gemm(100), rel=1e-12)  # above the floor
        phases, _ = cost.phases(p, a, counts)  # the slowest device: d1, by the GEMM model
        assert phases.expert_fwd_s[0] == pytest.approx(gemm(100), rel=1e-12)
        assert phases.expert_bwd_s[0] == pytest.approx(2 * gemm(100), rel=1e-12)
    # every device with few rows: the layer's expert forward + backward is the floor
    phases, _ = cost.phases(p, a, np.array([[[2.0, 0.0], [0.0, 3.0]]]))
    assert phases.expert_fwd_s[0] == pytest.approx(phi / 3, rel=1e-12)
    assert phases.expert_bwd_s[0] == pytest.approx(2 * phi / 3, rel=1e-12)
    assert phases.expert_fwd_s[0] + phases.expert_bwd_s[0] == pytest.approx(phi, rel=1e-12)
    phases, _ = cost.phases(p, a, np.zeros((1, 2, 2)))
    assert phases.expert_fwd_s[0] == 0.0 and phases.expert_bwd_s[0] == 0.0


def test_replica_trades_tokens_for_trans() -> None:
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    p.copies[0, 0, 1] = 1  # replica of e1 on d0: d0's 30 e1-tokens stay home
    phases, load = model().phases(p, Assignment.to_home(p), COUNTS)
    assert phases.dispatch_s[0] == pytest.approx(20 * 16 / 1e9)
    assert phases.trans_s[0] == pytest.approx(256 / 1e9)  # one expert, d1 -> d0
    np.testing.assert_allclose(load[0], [60, 40])


def test_hierarchical_levels_and_latency() -> None:
    # 2 nodes of 2 devices; intra 1e9, inter 1e8 B/s, latency 1 us on both.
    cluster = toy_cluster(devices_per_node=2, nodes=2, bw=1e9, inter_bw=1e8, lat=1e-6)
    spec = toy_spec(experts=4)
    p = Placement.from_homes(np.array([[0, 1, 2, 3]]), 4, 1)
    counts = np.zeros((1, 4, 4))
    counts[0, 0, 1] = 100  # d0 -> e1 on d1: intra-node
    counts[0, 0, 2] = 50  # d0 -> e2 on d2: inter-node
    send, recv = level_traffic(cluster, p, Assignment.to_home(p), counts)
    assert send[0, 0, 0] == 100 and send[1, 0, 0] == 50 and send[2, 0, 0] == 0
    assert recv[0, 0, 1] == 100 and recv[1, 0, 2] == 50
    phases, _ = CostModel(cluster, spec).phases(p, Assignment.to_home(p), counts)
    # Links as capacities, all at once: the busiest link is d0's NIC side (50 tokens of 16 bytes
    # at 1e8 B/s = 8e-6 s; its 100 intra-node tokens take 1.6e-6 s on the port, in parallel);
    # d0 uses both levels, so it pays both latencies: 8e-6 + 2e-6.
    expected = max(100 * 16 / 1e9, 50 * 16 / 1e8) + 2e-6
    assert phases.dispatch_s[0] == pytest.approx(expected)


def test_a_shared_link_is_a_capacity() -> None:
    """One NIC per node of 2 devices (1e8 B/s): a lone sender gets the whole NIC; two senders
    behind it share it; a receiver's NIC carries what enters its node."""
    from dataclasses import replace

    from poise.core.cluster import Link

    shared = toy_cluster(devices_per_node=2, nodes=2, bw=1e9, inter_bw=1e8)
    shared = replace(shared, inter_node=Link(1e8, 0.0, shared_by=2))
    p = Placement.from_homes(np.array([[0, 1, 2, 3]]), 4, 1)
    cost = CostModel(shared, toy_spec(experts=4))
    counts = np.zeros((1, 4, 4))
    counts[0, 0, 2] = 50  # d0 -> e2 on d2 (node 1): 800 bytes through each node's NIC
    phases, _ = cost.phases(p, Assignment.to_home(p), counts)
    assert phases.dispatch_s[0] == pytest.approx(50 * 16 / 1e8)  # the whole NIC, not half
    counts[0, 1, 3] = 50  # d1 -> e3 on d3: node 0's NIC now sends 1,600 bytes
    phases, _ = cost.phases(p, Assignment.to_home(p), counts)
    assert phases.dispatch_s[0] == pytest.approx(100 * 16 / 1e8)
    counts[0, 1, 3] = 0
    counts[0, 3, 2] = 30  # d3 -> e2: same node, over the port, not the NIC
    phases, _ = cost.phases(p, Assignment.to_home(p), counts)
    assert phases.dispatch_s[0] == pytest.approx(50 * 16 / 1e8)


def test_migration_is_priced() -> None:
    spec = toy_spec(experts=2)
    before = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    after = Placement.from_homes(np.array([[1, 1]]), 2, 2)
    moves = transfers_between(before, after, spec).migrations
    phases, _ = CostModel(toy_cluster(), spec).phases(
        after, Assignment.to_home(after), COUNTS, moves
    )
    assert phases.migrate_s[0] == pytest.approx(spec.migration_bytes / 1e9)


def test_schedules_by_hand() -> None:
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    p.copies[0, 0, 1] = 1
    cm = model()
    phases, _ = cm.phases(p, Assignment.to_home(p), COUNTS)
    a, c, t = phases.dispatch_s[0], phases.expert_fwd_s[0], phases.trans_s[0]
    sync = Schedule("sync").layer_time(phases)[0]
    assert sync == pytest.approx(4 * a + 3 * c + 2 * t)
    # Pro-Prophet: Trans hides under FEC (+ FNEC = 0 here); exposed part max(0, Trans - FEC).
    prophet = Schedule("prophet").layer_time(phases)[0]
    assert prophet == pytest.approx(4 * a + 3 * c + max(0, t - c) + max(0, t - 2 * c))
    n = 4
    piped = parse_schedule(f"pipelined({n})").layer_time(phases)[0]
    # dispatch and combine share the links: the pipeline's slower resource is max(2a, c)
    fwd = (a + c + a) / n + (n - 1) / n * max(2 * a, c)
    bwd = (a + 2 * c + a) / n + (n - 1) / n * max(2 * a, 2 * c)
    assert piped == pytest.approx(fwd + bwd + 2 * t)
    assert piped <= sync


def test_bad_loads_rejected() -> None:
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    with pytest.raises(PlanError, match="loads must be"):
        model().price(p, Assignment.to_home(p), np.ones((1, 3, 2)))
    with pytest.raises(PlanError, match="non-negative"):
        model().price(p, Assignment.to_home(p), -np.ones((1, 2, 2)))


def test_float_residue_pays_no_latency() -> None:
    from poise.cost.model import link_time
    from poise.cost.network import one_message_per_level
    from poise.cost.traffic import sends

    cluster = toy_cluster(devices_per_node=2, nodes=2, lat=1e-5)
    send = np.zeros((3, 1, 4))
    recv = np.zeros((3, 1, 4))
    send[2, 0, 0] = 3e-10  # residue of 1 - (in-domain share) on a one-domain cluster
    assert link_time(cluster, send, recv, one_message_per_level(send, recv))[0] == 0.0
    send[1, 0, 0] = 16.0  # one real token of 16 bytes pays bandwidth and latency
    assert link_time(cluster, send, recv, one_message_per_level(send, recv))[0] == pytest.approx(
        16 / 1e9 + 1e-5
    )
    # A residue of tokens is no message (`sends`); a token is.
    assert sends(np.array([3e-10 / 16, 1.0]), 16.0).tolist() == [False, True]


def test_pricing_layers_in_chunks_gives_the_same_cost(monkeypatch) -> None:
    """Large problems are priced a few layers at a time; the result does not change, with
    group-local routing (hybrid) and with replicas and migrations (eplb from a previous plan)."""
    from poise.cost import model as cost_module
    from poise.plan.policies import PlanContext, make_plan

    cluster = toy_cluster(2, 2, 2, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=1e-6, flops=1e13)
    spec = toy_spec(experts=8, layers=5, d_model=64, d_expert=128, tokens=256)
    rng = np.random.default_rng(4)
    loads = rng.zipf(1.4, size=(5, 8, 8)).astype(float)
    model = CostModel(cluster, spec)
    ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=model)
    first = make_plan("eplb", loads, None, ctx)
    plans = [make_plan("hybrid", loads, None, ctx), make_plan("eplb", loads[::-1], first, ctx)]
    assert plans[0].assignment.grouped and len(plans[1].transfers.migrations) > 0
    whole = [model.price(p.placement, p.assignment, loads, p.transfers.migrations) for p in plans]
    monkeypatch.setattr(cost_module, "PRICE_CHUNK_CELLS", 2 * 8 * 8)  # two layers at a time
    for p, ref in zip(plans, whole, strict=True):
        got = model.price(p.placement, p.assignment, loads, p.transfers.migrations)
        np.testing.assert_array_equal(got.layer_s, ref.layer_s)
        np.testing.assert_array_equal(got.device_load, ref.device_load)
        assert got.phases.migrate_s.sum() == ref.phases.migrate_s.sum()


def test_a_cost_model_reuses_the_pricer_of_a_plan_of_the_same_content() -> None:
    """`CostModel.pricer` keeps its pricers by plan content (`PricerCache`): an equal plan in
    other arrays gets the same pricer, built on copies (what the caller then does with its own
    arrays does not reach it); a pickled cost model starts with an empty cache."""
    import pickle

    cluster = toy_cluster(2, 2, 1, 1e9, 2e8, 1e7)
    spec = toy_spec(experts=8, layers=3, d_model=64, d_expert=128, tokens=1000, non_moe=1e5)
    cost = CostModel(cluster, spec)
    placement = Placement.from_homes(np.tile(np.arange(8) % 4, (3, 1)), 4, 3)
    assignment = Assignment.to_home(placement)
    loads = np.random.default_rng(0).integers(0, 50, size=(3, 4, 8)).astype(float)
    pricer = cost.pricer(placement, assignment)
    same = cost.pricer(placement.copy(), Assignment(assignment.weights.copy()))
    assert same is pricer
    before = pricer.price(loads).layer_s
    placement.copies[0, 1, 0] = 1  # the caller's own arrays change: a new plan, a new pricer
    assert cost.pricer(placement, Assignment.even(placement)) is not pricer
    np.testing.assert_array_equal(pricer.price(loads).layer_s, before)
    fresh = PlanPricer(CostModel(cluster, spec), placement, Assignment.even(placement))
    np.testing.assert_array_equal(
        cost.price(placement, Assignment.even(placement), loads).layer_s, fresh.price(loads).layer_s
    )
    assert not pickle.loads(pickle.dumps(cost)).pricers._pricers
    kept = cost.pricer(placement, Assignment.even(placement))
    cost.pricers.clear()  # (`benchmarks/planner.py`, before each timed plan)
    assert cost.pricer(placement, Assignment.even(placement)) is not kept


def test_a_pricer_whose_key_matches_but_not_its_content_is_not_reused() -> None:
    """`PricerCache` finds pricers by a cheap key of the plan (`plan_fingerprint`) and confirms
    a match bit for bit (`prices_same`): a kept pricer of another plan filed under this plan's
    key (as two plans sharing a key would be) is replaced, not returned."""
    from poise.cost.model import plan_fingerprint

    cluster = toy_cluster(2, 2, 1, 1e9, 2e8, 1e7)
    spec = toy_spec(experts=8, layers=3, d_model=64, d_expert=128, tokens=1000, non_moe=1e5)
    cost = CostModel(cluster, spec)
    placement = Placement.from_homes(np.tile(np.arange(8) % 4, (3, 1)), 4, 3)
    other = Placement.from_homes(np.tile((np.arange(8) + 1) % 4, (3, 1)), 4, 3)
    other_pricer = cost.pricer(other, Assignment.to_home(other))
    key = plan_fingerprint(placement, Assignment.to_home(placement))
    cost.pricers._pricers[key] = other_pricer  # a shared key, another plan's content
    got = cost.pricer(placement, Assignment.to_home(placement))
    assert got is not other_pricer
    np.testing.assert_array_equal(got.placement.home, placement.home)
    assert cost.pricer(placement, Assignment.to_home(placement)) is got  # and kept in its place


def test_fingerprints_follow_content_and_layout() -> None:
    """Equal content, equal key; one bit or the memory order changed, another key; -0.0 is not
    0.0 for `same_content`."""
    from poise.cost.fingerprint import fingerprint, same_content

    a = np.random.default_rng(1).random((3, 5, 7))
    assert fingerprint(a) == fingerprint(a.copy())
    b = a.copy()
    b[2, 4, 6] = np.nextafter(b[2, 4, 6], 2.0)
    assert fingerprint(a) != fingerprint(b) and not same_content(a, b)
    swapped = a.copy()
    swapped[0, 0, 0], swapped[0, 0, 1] = a[0, 0, 1], a[0, 0, 0]  # same words, other places
    assert fingerprint(a) != fingerprint(swapped)
    assert fingerprint(a) != fingerprint(np.asfortranarray(a))  # same values, other layout
    assert same_content(a, np.asfortranarray(a))
    assert not same_content(np.zeros(4), np.array([0.0, -0.0, 0.0, 0.0]))
    assert fingerprint(None) is None and same_content(None, None)


def test_the_fingerprint_sum_equals_its_formula_across_blocks() -> None:
    """`_weighted_sum` against its formula summed word by word in Python, for lengths below,
    at and past the block length (the whole blocks and the rest go separate ways)."""
    from poise.cost.fingerprint import _BLOCK, _ODD, _weighted_sum

    for n in (0, 1, 7, _BLOCK, _BLOCK + 3, 3 * _BLOCK + 5):
        words = np.random.default_rng(n).integers(0, 2**63, n, dtype=np.uint64)
        want = 0
        for i, x in enumerate(words.tolist()):
            want += x * ((i % _BLOCK) + 1) * int(_ODD) * (2 * (i // _BLOCK) + 1)
        assert _weighted_sum(words) == want % 2**64, n
