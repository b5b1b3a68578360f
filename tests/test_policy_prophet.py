"""Pro-Prophet's lightweight placement (`plan/policies/prophet.py`) on hand-computed cases, and the
packed incremental pricing it searches with (`cost.incremental.LayerState`)."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement
from poise.core.presets import get_cluster
from poise.core.spec import ModelSpec
from poise.cost.incremental import LayerState
from poise.cost.model import CostModel
from poise.cost.schedule import Schedule, parse_schedule
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.prophet import _Prefixes, prophet_cost

from .helpers import assert_priced_as_the_cost_model, toy_cluster, toy_spec


def _hot_from_two(devices: int = 8, experts: int = 8) -> np.ndarray:
    """Expert 0 (home device 0) gets 2000 tokens from each of devices 2 and 5 and 10 from every
    other device; every other expert gets 10 tokens from every device."""
    loads = np.full((1, devices, experts), 10.0)
    loads[0, [2, 5], 0] = 2000.0
    return loads


def _ctx(cluster, spec, schedule: str = "prophet", slots: int = 2) -> PlanContext:
    return PlanContext.create(
        cluster, spec, slots_per_device=slots, cost=CostModel(cluster, spec, Schedule(schedule))
    )


def test_hot_expert_replicated_on_its_two_senders_only() -> None:
    # One node of 8 devices, 1e9 B/s, no latency, 1e12 FLOP/s. fp32 experts 64 -> 128 -> 64:
    # W_e = 2*64*128*4 = 65536 B, B_t = 256 B, F_t = 32768 FLOP. No non-expert compute.
    cluster = toy_cluster(8, 1, 1, bw=1e9, flops=1e12)
    spec = toy_spec(experts=8, d_model=64, d_expert=128, non_moe=0.0)
    loads = _hot_from_two()
    plan = make_plan("prophet", loads, None, _ctx(cluster, spec))
    assert plan.notes["replicated"] == [[0]]
    assert plan.notes["replica_devices"] == [[[2, 5]]]
    assert set(np.flatnonzero(plan.placement.replicas()[0, :, 0])) == {2, 5}
    # After: devices 2, 5 compute 2000 + 80 tokens: FEC = 2080*32768/1e12 = 6.815744e-5.
    # Every device sends or receives at most 70 tokens: A = 70*256/1e9 = 1.792e-5.
    # Trans, a broadcast: the home sends W_e once and each replica receives it once,
    # 65536/1e9 = 6.5536e-5 s, below FEC, so Trans and Agg hide entirely: T = 4A + 3 FEC.
    # (Priced as direct sends, 2 W_e from the home, Trans would show 1.31072e-4 - FEC.)
    fec, a2a, trans = 2080 * 32768 / 1e12, 70 * 256 / 1e9, 65536 / 1e9
    after = 4 * a2a + 3 * fec + max(0.0, trans - fec) + max(0.0, trans - 2 * fec)
    assert after == pytest.approx(4 * a2a + 3 * fec, rel=1e-15)
    # Before (static): device 0 computes 4060 tokens and receives 4050.
    before = 4 * 4050 * 256 / 1e9 + 3 * 4060 * 32768 / 1e12
    # The search's own prices and the cost model's price of the plan: the same numbers.
    np.testing.assert_allclose(plan.notes["prophet_layer_s"][0], [before, after], rtol=1e-12)
    np.testing.assert_allclose(plan.cost.layer_s[0], after, rtol=1e-12)
    assert plan.cost.phases.trans_s[0] == pytest.approx(trans)
    # The lightest senders (10 tokens) got nothing: their Trans would only add exposed time.
    assert not plan.placement.replicas()[0, [1, 3, 4, 6, 7], 0].any()
    assert len(plan.transfers.migrations) == 0


def test_exposed_trans_blocks_replication_without_overlap_budget() -> None:
    # W_e = 2*64*8192*4 = 4.19 MB: Trans for the two senders is 8.4e-3 s, while the expert
    # compute it could hide under is only ~4e-5 s (1e14 FLOP/s) and there is no non-expert
    # compute: exposed Trans + Agg ~ 1.7e-2 s > the ~4.1e-3 s of all-to-all saved.
    cluster = toy_cluster(8, 1, 1, bw=1e9, flops=1e14)
    loads = _hot_from_two()
    tight = toy_spec(experts=8, d_model=64, d_expert=8192, non_moe=0.0)
    plan = make_plan("prophet", loads, None, _ctx(cluster, tight))
    assert plan.notes["replicated"] == [[]]
    # With 1e10 FLOP of non-expert compute per token (FNEC = 100 * 1e10 / 1e14 = 1e-2 s, more
    # than Trans), the same Trans hides completely and the two senders get replicas.
    roomy = tight.with_(non_moe_flops_per_token=1e10)
    plan = make_plan("prophet", loads, None, _ctx(cluster, roomy))
    assert plan.notes["replica_devices"] == [[[2, 5]]]
    ph = plan.cost.phases
    assert ph.trans_s[0] <= ph.expert_fwd_s[0] + ph.non_moe_fwd_s[0]  # fully hidden


def test_exposed_trans_is_priced_under_sync_too() -> None:
    # ctx.cost is sync: the search still uses the prophet schedule, the plan is priced by ctx.
    cluster = toy_cluster(8, 1, 1, bw=1e9, flops=1e12)
    spec = toy_spec(experts=8, d_model=64, d_expert=128, non_moe=0.0)
    ctx = _ctx(cluster, spec, schedule="sync")
    assert prophet_cost(ctx).schedule.kind == "prophet"
    plan = make_plan("prophet", _hot_from_two(), None, ctx)
    assert plan.cost.schedule == "sync"
    ph = plan.cost.phases
    expected = 4 * ph.dispatch_s[0] + 3 * ph.expert_fwd_s[0] + 2 * ph.trans_s[0]
    np.testing.assert_allclose(plan.cost.layer_s[0], expected, rtol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_never_slower_than_static_and_matches_cost_model(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cluster = toy_cluster(
        4, 2, 1 + seed % 2, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=2e-6, flops=1e13
    )
    D = cluster.num_devices
    spec = toy_spec(
        experts=16, layers=3, d_model=256, d_expert=512, tokens=2048, non_moe=1e6 * (seed % 3)
    )
    loads = np.floor(rng.zipf(1.4, size=(3, D, 16)) * 40.0)
    ctx = _ctx(cluster, spec, slots=-(-16 // D) + 1 + seed % 2)
    plan = make_plan("prophet", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert np.all(plan.cost.layer_s <= static.cost.layer_s * (1 + 1e-12))
    # The incremental pricing of the search equals the cost model on the final plan.
    np.testing.assert_allclose(
        np.array(plan.notes["prophet_layer_s"])[:, 1], plan.cost.layer_s, rtol=1e-9
    )
    assert plan.placement.slots_used().max() <= ctx.slots_per_device


def test_speed_256_experts_32_devices() -> None:
    import time

    from poise.core.presets import get_cluster
    from poise.core.spec import MODELS

    cluster = get_cluster("v100-ib50:4")
    spec = MODELS["zipf-256"].with_(moe_layers=4)
    rng = np.random.default_rng(0)
    w = rng.zipf(1.3, (4, 1, 256)).astype(float)
    loads = rng.poisson(w / w.sum(axis=2, keepdims=True) * 8192 * 8, (4, 32, 256)).astype(float)
    ctx = PlanContext.create(cluster, spec, slots_per_device=9)
    make_plan("prophet", loads, None, ctx)
    t = time.perf_counter()
    make_plan("prophet", loads, None, ctx)
    per_layer = (time.perf_counter() - t) / 4
    assert per_layer < 0.02  # target 2 ms; generous bound for loaded CI machines


# ------------------------------------------------------------------ packed incremental pricing


@pytest.mark.parametrize(
    ("dpn", "nodes", "domains", "shared"),
    [(4, 2, 2, 1), (8, 1, 1, 1), (1, 4, 1, 1), (4, 1, 2, 4), (1, 1, 3, 1), (2, 3, 1, 2),
     (8, 3, 3, 8), (8, 3, 3, 2), (1, 1, 1, 1)],
)  # fmt: skip
def test_packed_pricing_equals_the_cost_model(
    dpn: int, nodes: int, domains: int, shared: int
) -> None:
    # `packed_layer_s` (what prophet and hybrid price with) of whole layers is the cost model's
    # price of the placement the states describe: links as capacities (NICs shared by `shared`
    # devices, uplinks by a whole domain), Trans a broadcast, with and without replicas; and
    # `layer_s` on the unpacked arrays is the same number.
    cluster = toy_cluster(
        dpn,
        nodes,
        domains,
        bw=1e9,
        inter_bw=2e8,
        wan_bw=1e7,
        lat=1e-6,
        flops=1e12,
        nics_per_node=max(1, dpn // shared) if shared > 1 else None,
    )
    D = cluster.num_devices
    E = 2 * D + 1
    spec = toy_spec(experts=E, layers=3, d_model=64, d_expert=128, tokens=4000, non_moe=1e6)
    rng = np.random.default_rng(D)
    home = rng.integers(0, D, (3, E))
    placement = Placement.from_homes(home, D, 99)
    placement.copies[rng.random((3, D, E)) < 0.2] = 1
    counts = np.floor(rng.zipf(1.4, (3, D, E)) * rng.random((3, D, E)) * 50)
    counts[1] = 0.0
    for schedule in (Schedule("sync"), Schedule("pipelined", 4), Schedule("prophet")):
        cost = CostModel(cluster, spec, schedule)
        state = LayerState.stacked(cost, placement, counts)
        parts = (
            state.comp, state.tok_send, state.tok_recv, state.par_send, state.par_recv,
            state.tok_msg_out, state.tok_msg_in, state.par_msg_out, state.par_msg_in,
        )  # fmt: skip
        packed = np.ascontiguousarray(state.cells.swapaxes(1, 2))  # [L, CELLS, D]
        want = cost.price(placement, Assignment.to_home(placement), counts).layer_s
        np.testing.assert_allclose(state.packed_layer_s(packed), want, rtol=1e-12)
        assert np.array_equal(state.packed_layer_s(packed), state.layer_s(*parts))
        # Many states at once (the max over devices taken down columns): the same numbers.
        many = packed[rng.integers(0, 3, 400)] * rng.choice([0.0, 0.5, 1.0, 3.0], (400, 1, D))
        one_by_one = np.array([state.packed_layer_s(x[None])[0] for x in many])
        assert np.array_equal(state.packed_layer_s(many), one_by_one)
        # The levels left out carry nothing; `level_between` is the cluster's.
        lo, hi = state.levels
        for v in [v for v in range(3) if not lo <= v < hi]:
            for x in parts[1:]:  # bytes and messages
                assert not x[:, v].any()
        src, dst = rng.integers(0, D, (2, 200))
        assert np.array_equal(state.level_between(src, dst), cluster.level_between(src, dst))


def _price_prefix(
    cost: CostModel, home: np.ndarray, counts: np.ndarray, layer: int, expert: int, cands: list
) -> float:
    """The cost model's price of layer `layer` with `expert` replicated on `cands` (homes
    `home[L, E]`, tokens to the homes otherwise): the reference a prefix's time must equal."""
    D = counts.shape[1]
    placement = Placement.from_homes(home[layer : layer + 1], D, 99)
    placement.copies[0, cands, expert] = 1
    priced = cost.price(placement, Assignment.to_home(placement), counts[layer : layer + 1])
    return float(priced.layer_s[0])


@pytest.mark.parametrize(
    ("dpn", "nodes", "domains", "nics"), [(4, 2, 2, 1), (8, 4, 3, 1), (8, 4, 3, 8), (4, 3, 1, 2)]
)
@pytest.mark.parametrize("schedule", ["prophet", "sync"])
def test_prefix_times_equal_pricing_each_prefix(
    dpn: int, nodes: int, domains: int, nics: int, schedule: str
) -> None:
    # Every priced prefix (all of them below 80 candidates, a grid above: 96 devices) equals
    # the cost model's price of its placement. Tokens fall with the device index, so the
    # search's heaviest-first order is the device order the broadcast enters a node by.
    cluster = toy_cluster(
        dpn, nodes, domains, bw=1e10, inter_bw=1e9, wan_bw=5e8, lat=1e-6, flops=1e13,
        nics_per_node=nics,
    )  # fmt: skip
    D = cluster.num_devices
    spec = toy_spec(experts=8, layers=3, d_model=256, d_expert=256, tokens=8000, non_moe=1e7)
    cost = CostModel(cluster, spec, parse_schedule(schedule))  # sync: Trans in full
    rng = np.random.default_rng(D)
    counts = np.floor(rng.zipf(1.3, (3, D, 8)) * 30.0)
    home = rng.integers(0, D, (3, 8))
    layer, expert = np.arange(3), np.array([0, 3, 5])
    counts[layer, :, expert] = 1000.0 * (D - np.arange(D)) + 1.0
    state = LayerState.for_homes(cost, home, counts)
    h = home[layer, expert]
    col = counts[layer, :, expert]  # [3, D]
    ok = (col > 0) & (np.arange(D) != h[:, None]) & (rng.random((3, D)) < 0.9)
    pre = _Prefixes(state, layer, h, ok, col, state.R[layer, h, expert])
    assert (pre.cuts.max(axis=1) == ok.sum(axis=1)).all()  # the longest prefix is priced
    if D > 80:
        assert pre.cuts.shape[1] < ok.sum(axis=1).max()  # a grid
    for b in range(3):
        for c, n in enumerate(pre.cuts[b]):
            if n == 0:
                assert pre.times[b, c] == np.inf
                continue
            want = _price_prefix(cost, home, counts, b, int(expert[b]), pre.cands[b, :n].tolist())
            assert pre.times[b, c] == pytest.approx(want, rel=1e-12)


def test_prefix_times_in_any_order_differ_only_by_the_entry_device() -> None:
    # With the heaviest sender not the lowest device of its node, the search lets the copy
    # enter a node at the first replica it adds, the cost model at the lowest: the shared
    # links carry the same bytes, so the two differ by at most one level-0 hop's seconds and
    # latency per phase on an unshared-NIC cluster, and not at all where every NIC is shared.
    for nics in (1, 4):
        cluster = toy_cluster(
            4, 4, 2, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=1e-6, flops=1e13, nics_per_node=nics
        )
        D = cluster.num_devices
        spec = toy_spec(experts=8, layers=1, d_model=256, d_expert=256, tokens=8000, non_moe=1e7)
        cost = CostModel(cluster, spec, Schedule("prophet"))
        counts = np.full((1, D, 8), 10.0)
        counts[0, :, 0] = 1000.0 * (1 + np.arange(D))  # heaviest = highest device
        home = np.zeros((1, 8), dtype=np.int64)
        home[0] = np.arange(8) % D
        state = LayerState.for_homes(cost, home, counts)
        ok = np.arange(D)[None, :] != 0
        pre = _Prefixes(state, np.array([0]), np.array([0]), ok, counts[:, :, 0], state.R[0, :1, 0])
        W_e, links = spec.expert_bytes, cluster.links()
        slack = 4 * (W_e / links[0].bw_Bps + links[0].lat_s + links[1].lat_s)
        gaps = []
        for c, n in enumerate(pre.cuts[0]):
            want = _price_prefix(cost, home, counts, 0, 0, pre.cands[0, :n].tolist())
            gaps.append(abs(pre.times[0, c] - want))
        assert max(gaps) <= slack
        if nics == 1:
            assert max(gaps) <= 1e-12 * max(pre.times[0])


def test_the_searched_price_equals_the_cost_model() -> None:
    """`prophet`'s plan carries `CostModel.price` of the plan under every schedule, first from
    nothing and then re-planned from its own plan (same homes, its replicas replaced)."""

    cluster = get_cluster("dgx-h100:2")
    spec = ModelSpec("p", 64, 128, experts=24, top_k=2, moe_layers=3, tokens_per_device=512)
    for seed, schedule in enumerate(["sync", "pipelined(4)", "prophet", "hybrid"]):
        rng = np.random.default_rng(seed)
        cost = CostModel(cluster, spec, parse_schedule(schedule))
        ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=cost)
        loads = np.floor(100 * rng.zipf(1.4, size=(3, cluster.num_devices, 24)).astype(float))
        other = np.floor(100 * rng.zipf(1.4, size=loads.shape).astype(float))
        first = make_plan("prophet", loads, None, ctx)
        again = make_plan("prophet", other, first, ctx)
        assert first.placement.replicas().sum() > 0
        for plan, on in ((first, loads), (again, other)):
            assert_priced_as_the_cost_model(plan, cost, on)


@pytest.mark.parametrize("schedule", ["prophet", "sync"])
def test_prefix_times_count_the_messages_the_home_loses_and_sends(schedule: str) -> None:
    # One hot expert homed on device 0 takes tokens from every device (the others none), on
    # links of a millisecond a message: its home receives one message per sender, so each
    # replica it adds saves one (the replica keeps its tokens) and costs one Trans message;
    # every prefix's time is the cost model's. A second expert homed on device 0 has tokens
    # from the even devices: their messages to the home carry two experts and stay.
    cluster = toy_cluster(4, 2, 2, bw=1e10, inter_bw=1e9, wan_bw=5e8, lat=1e-3, flops=1e13)
    D = cluster.num_devices
    spec = toy_spec(experts=8, layers=1, d_model=256, d_expert=256, tokens=8000, non_moe=1e7)
    cost = CostModel(cluster, spec, parse_schedule(schedule))
    home = np.array([[0, 0, 1, 2, 3, 4, 5, 6]])
    counts = np.zeros((1, D, 8))
    counts[0, :, 0] = 1000.0 * (D - np.arange(D))  # heaviest first is the device order
    counts[0, ::2, 1] = 5.0
    state = LayerState.for_homes(cost, home, counts)
    ok = np.arange(D)[None, :] != 0
    pre = _Prefixes(state, np.array([0]), np.array([0]), ok, counts[:, :, 0], state.R[0, :1, 0])
    for c, n in enumerate(pre.cuts[0]):
        want = _price_prefix(cost, home, counts, 0, 0, pre.cands[0, :n].tolist())
        assert pre.times[0, c] == pytest.approx(want, rel=1e-12)


def test_the_search_counts_a_homes_messages_across_its_experts() -> None:
    # Two hot experts share home 0 on one node (every replica enters over level 0, so the
    # search's broadcast is the model's): the second expert's replicas go where the first's
    # went, and the home's one Trans message to such a device carries both. The search's own
    # price of its plan (`prophet_layer_s`, after) is the cost model's, on links of a
    # millisecond a message.
    cluster = toy_cluster(8, 1, 1, bw=1e9, lat=1e-3, flops=1e12)
    spec = toy_spec(experts=8, layers=1, d_model=256, d_expert=256, tokens=8000, non_moe=1e6)
    cost = CostModel(cluster, spec, Schedule("prophet"))
    ctx = PlanContext.create(cluster, spec, slots_per_device=4, cost=cost)
    home = np.array([[0, 0, 1, 2, 3, 4, 5, 6]])
    loads = np.zeros((1, 8, 8))
    loads[0, :, :2] = 4000.0  # the home's own messages set the dispatch's latency
    previous = make_plan("static", loads, None, ctx)
    previous.placement.home[:] = home
    previous.placement.copies[:] = Placement.from_homes(home, 8, 4).copies
    plan = make_plan("prophet", loads, previous, ctx)
    replicated = plan.notes["replicated"][0]
    assert replicated[:2] == [0, 1]
    shared = set(plan.notes["replica_devices"][0][0]) & set(plan.notes["replica_devices"][0][1])
    assert shared  # one Trans message from home 0 carries both experts to these devices
    want = cost.price(plan.placement, plan.assignment, loads).layer_s[0]
    assert plan.notes["prophet_layer_s"][0][1] == pytest.approx(want, rel=1e-12)
