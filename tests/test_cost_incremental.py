"""The incremental layer pricers (`cost/incremental.py`, `cost/expert_columns.py`) equal
`CostModel.price` on the layer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.cluster import HostCosts
from poise.core.placement import Assignment, Placement
from poise.core.presets import get_cluster
from poise.core.spec import MODELS
from poise.cost.expert_columns import TERMS, ExpertColumns
from poise.cost.incremental import LayerState
from poise.cost.model import CostModel
from poise.cost.schedule import Schedule

from .helpers import toy_cluster, toy_spec

SCHEDULES = [Schedule("sync"), Schedule("pipelined", 4), Schedule("prophet")]


def _random_layer(
    rng: np.random.Generator, devices: int, experts: int, slots: int, replicas: int
) -> tuple[Placement, np.ndarray]:
    """One layer: homes round-robin, `replicas` random extra copies within slots; Zipf-ish
    counts `[D, E]` with some zeros."""
    home = (np.arange(experts) % devices)[None, :]
    placement = Placement.from_homes(home, devices, slots)
    copies = placement.copies[0]
    for _ in range(replicas):
        d, e = int(rng.integers(devices)), int(rng.integers(experts))
        if copies[d].sum() < slots and copies[d, e] == 0:
            copies[d, e] = 1
    p = 1.0 / np.arange(1, experts + 1) ** 0.9
    counts = rng.multinomial(200 * experts, rng.permutation(p / p.sum()), size=devices)
    counts[rng.random(counts.shape) < 0.1] = 0
    return placement, counts.astype(np.float64)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize(
    "cluster",
    [
        get_cluster("dgx-h100:4"),
        toy_cluster(2, 2, 2, bw=1e9, inter_bw=2e8, wan_bw=1e7),
        get_cluster("v100-ib50"),  # one NIC shared by 8 devices
        dataclasses.replace(  # bulk transfers at 3x their link time (a live self-calibration)
            get_cluster("v100-ib50"), host=HostCosts(transfer_scale=3.0)
        ),
    ],
    ids=["dgx-h100:4", "toy-3-levels", "v100-ib50", "v100-ib50-transfers-x3"],
)
def test_layer_state_is_the_price(cluster, schedule: Schedule) -> None:
    """`LayerState` prices a layer as the cost model does: links as capacities (the shared
    NICs of v100-ib50 from their devices' summed loads), Trans a broadcast, bulk transfers
    stretched by `HostCosts.transfer_scale`."""
    spec = MODELS["zipf-256"].with_(experts=64, moe_layers=1)
    cost = CostModel(cluster, spec, schedule)
    rng = np.random.default_rng(3)
    for replicas in (0, 5, 40):
        placement, counts = _random_layer(rng, cluster.num_devices, 64, 6, replicas)
        state = LayerState(cost, placement, counts)
        full = cost.price(placement, Assignment.to_home(placement), counts[None])
        assert state.current_s() == pytest.approx(float(full.layer_s[0]), rel=1e-12)
        np.testing.assert_allclose(state.R.sum(axis=1), full.device_load[0], rtol=1e-12)


def _floored(cost: CostModel, placement: Placement, assignment: Assignment, counts: np.ndarray):
    """`cost`'s cluster with a per-call floor (`Cluster.expert_call_floor_s`) whose forward
    third is 1.25x the slowest device's forward expert seconds without one on `counts[1, D,
    E]`, and that floor (a test cluster). The layer's FEC is the slowest device's, so a floor
    shows in a layer's price only where it exceeds every device's GEMM seconds."""
    none = dataclasses.replace(cost.cluster, expert_call_floor_s=0.0)
    plain = CostModel(none, cost.spec, cost.schedule)
    seconds = plain.pricer(placement, assignment).device_compute_s(counts)[0]
    floor = 3.0 * 1.25 * float(seconds.max())
    return dataclasses.replace(none, expert_call_floor_s=floor), floor


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize(
    "cluster",
    [get_cluster("dgx-h100:4"), toy_cluster(2, 2, 2, bw=1e9, inter_bw=2e8, wan_bw=1e7)],
    ids=["dgx-h100:4", "toy-3-levels"],
)
def test_layer_state_is_the_price_with_a_call_floor(cluster, schedule: Schedule) -> None:
    """With a per-call floor on the expert compute above every device's GEMM seconds,
    `LayerState` (its states and candidate batches alike) still prices a layer as the cost
    model does, at the floor."""
    spec = MODELS["zipf-256"].with_(experts=64, moe_layers=1)
    rng = np.random.default_rng(11)
    for replicas in (0, 5, 40):
        placement, counts = _random_layer(rng, cluster.num_devices, 64, 6, replicas)
        assignment = Assignment.to_home(placement)
        plain = CostModel(dataclasses.replace(cluster, expert_call_floor_s=0.0), spec, schedule)
        floored, floor = _floored(plain, placement, assignment, counts[None])
        cost = CostModel(floored, spec, schedule)
        full = cost.price(placement, assignment, counts[None])
        state = LayerState(cost, placement, counts)
        assert state.current_s() == pytest.approx(float(full.layer_s[0]), rel=1e-12)
        batch = state.layer_s(
            state.comp[None], state.tok_send[None], state.tok_recv[None],
            state.par_send[None], state.par_recv[None],
            state.tok_msg_out[None], state.tok_msg_in[None],
            state.par_msg_out[None], state.par_msg_in[None],
        )  # fmt: skip
        assert batch[0] == pytest.approx(float(full.layer_s[0]), rel=1e-12)
        assert full.phases.expert_fwd_s[0] == pytest.approx(floor / 3, rel=1e-12)
        assert full.phases.expert_bwd_s[0] == pytest.approx(2 * floor / 3, rel=1e-12)
        unfloored = plain.price(placement, assignment, counts[None])
        assert unfloored.layer_s[0] < full.layer_s[0]  # the floor shows in the price


def test_layer_state_toy_counts_by_hand() -> None:
    # 2 devices, expert 0 homed on device 0 gets 30 tokens from device 1: the all-to-all moves
    # 30 tokens of 16 bytes each way, device 0 computes 40 tokens.
    cluster = toy_cluster(2, 1, 1, bw=1e9, flops=1e12)
    spec = toy_spec(experts=2)
    cost = CostModel(cluster, spec)
    placement = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    counts = np.array([[10.0, 0.0], [30.0, 5.0]])
    state = LayerState(cost, placement, counts)
    assert state.R.tolist() == [[40.0, 0.0], [0.0, 5.0]]
    assert state.tok_send[0].tolist() == [0.0, 30.0]
    assert state.tok_recv[0].tolist() == [30.0, 0.0]
    full = cost.price(placement, Assignment.to_home(placement), counts[None])
    assert state.current_s() == pytest.approx(float(full.layer_s[0]), rel=1e-12)


@pytest.mark.parametrize("floor", [False, True], ids=["no-floor", "call-floor"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize(
    "cluster",
    [
        get_cluster("dgx-h100:4"),
        toy_cluster(2, 2, 2, bw=1e9, inter_bw=2e8, wan_bw=1e7, lat=1e-4),
    ],
    ids=["dgx-h100:4", "toy-3-levels-latency"],
)
def test_expert_columns_match_price_after_changes(cluster, schedule: Schedule, floor: bool) -> None:
    # Balanced routing, migrations from a previous home, then column changes applied one by
    # one: the pricer's layer time equals CostModel.price of the changed layer each time, the
    # latency of every message included (the messages are recounted on the changed layer);
    # with `floor`, on a cluster whose per-call floor exceeds every device's GEMM seconds at
    # first (`_floored`), so it sets the layer's FEC until changes load a device beyond it.
    from poise.plan.policies.vexpert import _route

    cluster = dataclasses.replace(cluster, expert_call_floor_s=0.0)
    spec = MODELS["zipf-256"].with_(experts=64, moe_layers=1)
    cost = CostModel(cluster, spec, schedule)
    rng = np.random.default_rng(5)
    placement, counts = _random_layer(rng, cluster.num_devices, 64, 6, 30)
    call_floor = 0.0
    if floor:
        balanced = Assignment.balanced(placement, counts[None])
        cluster, call_floor = _floored(cost, placement, balanced, counts[None])
        cost = CostModel(cluster, spec, schedule)
    home, copies = placement.home[0].copy(), placement.copies[0].copy()
    prev = home.copy()
    prev[:4] = (prev[:4] + 9) % cluster.num_devices
    counts_t = np.ascontiguousarray(counts.T)
    layer = ExpertColumns(
        cost, counts[None], home[None], copies[None], _route(counts_t, copies.T)[None], prev[None]
    )
    zero = np.zeros(1, dtype=np.int64)

    def full() -> float:
        p = Placement(home[None].copy(), copies[None].copy(), 6)
        moved = np.flatnonzero(prev != home)
        mig = np.stack([0 * moved, moved, prev[moved], home[moved]], axis=1)
        return float(
            cost.price(p, Assignment.balanced(p, counts[None]), counts[None], mig).layer_s[0]
        )

    assert layer.price(layer.totals)[0] == pytest.approx(full(), rel=1e-12)
    if floor:  # the floor sets the layer's FEC at first
        assert layer.phases()[0].expert_fwd_s[0] == pytest.approx(call_floor / 3, rel=1e-12)
    for _ in range(20):
        e = int(rng.integers(64))
        col = copies[:, e].copy()
        d = int(rng.integers(cluster.num_devices))
        col[d] = 1 - col[d] if d != home[e] else 1
        h = int(rng.choice(np.flatnonzero(col)))
        experts = np.array([e])
        shares = _route(counts_t[experts], col[None])
        terms = layer.column_terms(zero, experts, np.array([h]), col[None], shares)
        one = np.ones((1, 1), dtype=bool)
        totals = layer.candidates(
            zero, experts[None], np.array([[h]]), col[None, None], shares[None], terms[None], one
        )
        copies[:, e], home[e] = col, h
        assert layer.price(totals[0])[0] == pytest.approx(full(), rel=1e-12)
        layer.apply(zero, experts, np.array([h]), col[None], shares, zero, totals[:, 0])


def _columns_case(cluster, schedule: Schedule, prev_moves: int = 4):
    """An `ExpertColumns` of one random layer with replicas, balanced shares and `prev_moves`
    experts whose home moved (None: no previous homes); returns it with its inputs."""
    from poise.plan.policies.vexpert import _route

    spec = MODELS["zipf-256"].with_(experts=48, moe_layers=1)
    cost = CostModel(cluster, spec, schedule)
    rng = np.random.default_rng(9)
    slots = 48 // cluster.num_devices + 2
    placement, counts = _random_layer(rng, cluster.num_devices, 48, slots, 60)
    home, copies = placement.home[0], placement.copies[0]
    weights = _route(np.ascontiguousarray(counts.T), copies.T)
    prev = None
    if prev_moves:
        prev = home.copy()
        prev[:prev_moves] = (prev[:prev_moves] + 5) % cluster.num_devices
        prev = prev[None]
    cols = ExpertColumns(cost, counts[None], home[None], copies[None], weights[None], prev)
    return cols, counts, home, copies, weights


@pytest.mark.parametrize(
    "cluster", [get_cluster("dgx-h100:4"), toy_cluster(2, 2, 2, bw=1e9, inter_bw=2e8, wan_bw=1e7)]
)
def test_expert_columns_terms_sum_to_totals(cluster) -> None:
    # Every row of the per-expert terms (tokens, compute, dispatch, Trans, migration per level)
    # summed over the experts gives the layer totals the cost model's own functions compute
    # (the totals' message rows are no sum over experts: they are counted on the layer).
    cols, _, home, copies, weights = _columns_case(cluster, Schedule("sync"))
    E = home.size
    terms = cols.column_terms(np.zeros(E, dtype=np.int64), np.arange(E), home, copies.T, weights)
    assert np.any(terms[:, 14:17] > 0) and np.any(terms[:, 8:11] > 0)  # Trans and migrations
    np.testing.assert_allclose(terms.sum(axis=0), cols.totals[0, :TERMS], rtol=1e-12, atol=1e-6)


def test_totals_after_equals_candidates() -> None:
    # A caller that prices the columns in force in its own batch (`totals_after`) gets the totals
    # `candidates` gets by re-deriving them, bit for bit.
    from poise.plan.policies.vexpert import _route

    cols, counts, home, copies, _ = _columns_case(get_cluster("dgx-h100:4"), Schedule("sync"))
    experts = np.array([[3, 7]])
    new_copies = copies.T[experts[0]].copy()
    new_copies[0, (home[3] + 1) % 32] += 1  # expert 3 gains a copy
    new_copies[1, (home[7] + 9) % 32] += 1  # expert 7 too
    shares = _route(np.ascontiguousarray(counts.T)[experts[0]], new_copies)
    zero = np.zeros(2, dtype=np.int64)
    terms = cols.column_terms(zero, experts[0], home[experts[0]], new_copies, shares)
    select = np.array([[1, 0], [0, 1], [1, 1]], dtype=bool)
    layer = np.zeros(1, dtype=np.int64)
    columns = (experts, home[experts], new_copies[None], shares[None])
    expected = cols.candidates(layer, *columns, terms[None], select)
    current = cols.current_terms(zero, experts[0])
    delta = terms - current
    change = np.stack([delta[0], delta[1], delta[0] + delta[1]])[None]
    messages = cols.candidate_messages(layer, *columns, select)
    assert np.array_equal(cols.totals_after(layer, change, messages), expected)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_price_without_previous_homes_equals_unmoved_homes(schedule: Schedule) -> None:
    # With no previous homes the pricer leaves the migration rows out; the time equals, bit for
    # bit, the time with previous homes equal to the current ones (nothing migrates either way).
    cluster = get_cluster("dgx-h100:4")
    cols, counts, home, copies, weights = _columns_case(cluster, schedule, prev_moves=0)
    same = ExpertColumns(
        cols.cost, counts[None], home[None], copies[None], weights.copy()[None], home[None]
    )
    assert np.array_equal(cols.totals, same.totals)
    assert np.array_equal(cols.price(cols.totals), same.price(same.totals))
