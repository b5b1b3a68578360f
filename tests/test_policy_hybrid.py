"""HybridEP (`plan/policies/hybrid.py`) and the group-local routing it needs (`Assignment`)."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement
from poise.core.presets import get_cluster
from poise.core.spec import ModelSpec
from poise.cost.incremental import PREFIX_EXACT, PREFIX_POINTS
from poise.cost.model import CostModel
from poise.cost.schedule import parse_schedule
from poise.cost.traffic import level_traffic
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.hybrid import (
    _fill_domains,
    _first_sorted,
    choose_pairs,
    domain_grouping,
    p_closed_form,
)

from .helpers import assert_priced_as_the_cost_model, toy_cluster, toy_spec

# 16 bf16 experts 1024 -> 1024 -> 1024: W_e = 2*1024*1024*2 = 4 MiB, B_t = 2 KiB.
SPEC = ModelSpec(
    "h",
    d_model=1024,
    d_expert=1024,
    experts=16,
    top_k=1,
    moe_layers=1,
    dtype_bytes=2,
    tokens_per_device=4096,
)


def _cross_skew() -> np.ndarray:
    """`[1, 16, 16]` on 2 domains of 8: every device of domain 1 sends 1000 tokens to each of
    experts 0-3 (homed on devices 0-3, domain 0) and 10 to every other expert; domain 0 sends 10
    to every expert."""
    loads = np.full((1, 16, 16), 10.0)
    loads[0, 8:, :4] = 1000.0
    return loads


def _ctx(cluster, spec=SPEC, slots: int = 2) -> PlanContext:
    return PlanContext.create(cluster, spec, slots_per_device=slots, cost=CostModel(cluster, spec))


def _cross_domain_tokens(plan, cluster, loads) -> float:
    send, _ = level_traffic(cluster, plan.placement, plan.assignment, loads)
    return float(send[2].sum())


def test_heavy_cross_domain_skew_moves_experts_into_the_domain() -> None:
    cluster = get_cluster("a800-eth10")  # 2 domains x 8 A800, 10 Gb/s WAN shared by 8
    loads = _cross_skew()
    ctx = _ctx(cluster)
    plan = make_plan("hybrid", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert plan.notes["domain_level"] == "domain" and plan.notes["domain_size"] == 8
    # T[1, e] = 8 * 1000 = 8000 for e = 0..3 (the heaviest pairs, 16 MB of tokens per
    # all-to-all for 4 MiB of expert): all four are moved into domain 1, each on the lowest
    # free device of domain 1 (all tie at 1000 tokens): 8, 9, 10, 11.
    reps = plan.notes["replicated"][0][1]
    assert reps[:4] == [0, 1, 2, 3]
    assert plan.notes["replica_device"][0][1][:4] == [8, 9, 10, 11]
    # Cross-domain tokens: X = 4 * 8000 + 4 * 80 + 8 * 80 = 32960 under static; at most the
    # 960 light ones remain: p* <= 960 / 32960 = 0.0291.
    x_static = _cross_domain_tokens(static, cluster, loads)
    assert x_static == pytest.approx(32960)
    x_hybrid = _cross_domain_tokens(plan, cluster, loads)
    assert x_hybrid <= 960 + 1e-9
    assert 0.0 <= plan.notes["p_star"][0] <= 960 / 32960 + 1e-12
    assert plan.notes["p_star"][0] == pytest.approx(x_hybrid / x_static)
    assert plan.cost.step_s < 0.5 * static.cost.step_s
    # Domain 1's other devices send their expert-0..3 tokens inside the domain.
    received = plan.assignment.received(plan.placement, loads)
    assert received[0, 8, 0] == pytest.approx(8000.0)
    # The incremental pricing of the cut equals the cost model.
    np.testing.assert_allclose(plan.notes["hybrid_layer_s"][0][1], plan.cost.layer_s[0], rtol=1e-9)


def test_fast_network_changes_little() -> None:
    # The same skew on 2 domains joined at 400 GB/s: the WAN is not a bottleneck any more, and
    # whatever the policy moves gains under 15 % (on a800-eth10 it gains over 50 %).
    cluster = toy_cluster(8, 1, 2, bw=4e11, wan_bw=4e11, lat=1e-6, flops=2e14)
    loads = _cross_skew()
    ctx = _ctx(cluster)
    plan = make_plan("hybrid", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert plan.cost.step_s <= static.cost.step_s
    assert plan.cost.step_s > 0.85 * static.cost.step_s


@pytest.mark.parametrize("inter_bw", [4e11, 1e12])
def test_single_domain_without_slow_inter_node_link_keeps_static(inter_bw: float) -> None:
    cluster = toy_cluster(8, 2, 1, bw=4e11, inter_bw=inter_bw)
    assert domain_grouping(cluster) == (None, 0)
    plan = make_plan("hybrid", _cross_skew(), None, _ctx(cluster))
    assert plan.notes["p_star"] == [1.0]
    assert not plan.placement.replicas().any()


def test_single_domain_with_slow_inter_node_link_uses_nodes() -> None:
    cluster = toy_cluster(8, 2, 1, bw=4e11, inter_bw=1.25e9 / 8)
    assert domain_grouping(cluster) == ("node", 8)
    loads = _cross_skew()
    plan = make_plan("hybrid", loads, None, _ctx(cluster))
    assert plan.notes["replicated"][0][1][:4] == [0, 1, 2, 3]
    assert plan.notes["p_star"][0] < 0.05


@pytest.mark.parametrize("seed", range(8))
def test_p_star_in_unit_interval_and_never_slower(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cluster = toy_cluster(
        2, 1 + seed % 2, 2 + seed % 3, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=1e-5, flops=1e13
    )
    D = cluster.num_devices
    spec = toy_spec(experts=12, layers=3, d_model=128, d_expert=256, tokens=1024)
    scale = [0.0, 1.0, 50.0, 1e4][seed % 4]
    loads = np.floor(rng.zipf(1.3, size=(3, D, 12)) * scale)
    ctx = _ctx(cluster, spec, slots=-(-12 // D) + 1 + seed % 2)
    plan = make_plan("hybrid", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert all(0.0 <= p <= 1.0 for p in plan.notes["p_star"])
    assert np.all(plan.cost.layer_s <= static.cost.layer_s * (1 + 1e-12))
    assert_priced_as_the_cost_model(plan, ctx.cost, loads)


# ------------------------------------------------------------------ group-local routing


def _brute_force_levels(cluster, placement, assignment, counts):
    """`(send, recv)` `[3, L, D]` from the full source x destination matrix."""
    L, D, _ = counts.shape
    held = placement.holders()
    remote = np.where(held, 0.0, counts)
    routes = remote[..., None] * assignment.source_weights()  # [L, Ds, E, Dd]
    flow = routes.sum(axis=2)  # [L, Ds, Dd]
    level = cluster.level_between(np.arange(D)[:, None], np.arange(D)[None, :])
    send = np.zeros((3, L, D))
    recv = np.zeros((3, L, D))
    for v in range(3):
        send[v] = np.where(level == v, flow, 0.0).sum(axis=2)
        recv[v] = np.where(level == v, flow, 0.0).sum(axis=1)
    return send, recv


@pytest.mark.parametrize(
    ("dpn", "nodes", "domains", "group"),
    # ... and groups of whole domains (DeepSpeed's EP groups across domains, issue 66)
    [(2, 2, 2, 4), (2, 2, 2, 2), (4, 1, 2, 2), (2, 2, 1, 2), (1, 2, 2, 2), (1, 1, 4, 2),
     (2, 1, 4, 4), (2, 2, 2, 8)],
)  # fmt: skip
def test_group_local_traffic_matches_brute_force(dpn, nodes, domains, group) -> None:
    rng = np.random.default_rng(dpn * 100 + nodes * 10 + domains + group)
    cluster = toy_cluster(dpn, nodes, domains)
    D, E, L = cluster.num_devices, 5, 2
    home = rng.integers(0, D, size=(L, E))
    placement = Placement.from_homes(home, D, slots_per_device=E + 2)
    extra = rng.random((L, D, E)) < 0.25
    placement.copies = np.maximum(placement.copies, extra.astype(np.int32))
    counts = rng.integers(0, 50, size=(L, D, E)).astype(float)
    assignment = Assignment.group_local(placement, group, base=Assignment.even(placement))
    assignment.validate(placement)
    got = level_traffic(cluster, placement, assignment, counts)
    want = _brute_force_levels(cluster, placement, assignment, counts)
    np.testing.assert_allclose(got[0], want[0], atol=1e-9)
    np.testing.assert_allclose(got[1], want[1], atol=1e-9)
    received = assignment.received(placement, counts)
    routes = assignment.split(placement, counts.astype(np.int64))  # [L, Ds, E, Dd]
    np.testing.assert_allclose(received.sum(axis=1), counts.sum(axis=1))
    np.testing.assert_array_equal(routes.sum(axis=3), counts)  # every source's tokens conserved
    landed = routes.sum(axis=1).transpose(0, 2, 1)  # [L, Dd, E]
    assert not landed[~placement.holders()].any()  # only holders receive
    # A non-holding source whose group holds e never sends e's tokens out of its group.
    grp = np.arange(D) // group
    out = grp[:, None] != grp[None, :]  # [Ds, Dd]
    local = assignment.local_mask().transpose(0, 2, 1)  # [L, Ds, E]
    leaving = (routes * out[None, :, None, :]).sum(axis=3)
    assert not leaving[local & ~placement.holders()].any()


def test_group_routing_without_groups_is_the_plain_rule() -> None:
    cluster = toy_cluster(2, 2, 2)
    D = cluster.num_devices
    placement = Placement.from_homes(np.array([[0, 3, 5]]), D, 2)
    placement.copies[0, 6, 0] = 1
    counts = np.arange(1, 1 + D * 3, dtype=float).reshape(1, D, 3)
    plain = Assignment.to_home(placement)
    grouped = Assignment(plain.weights, np.zeros_like(plain.weights), 4)  # no group opts in
    for a, b in zip(
        level_traffic(cluster, placement, plain, counts),
        level_traffic(cluster, placement, grouped, counts),
        strict=True,
    ):
        np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(
        plain.received(placement, counts), grouped.received(placement, counts)
    )
    # Domain 1 (devices 4-7) holds expert 0 on device 6: with group_local its sources send
    # there instead of to the home on device 0.
    local = Assignment.group_local(placement, 4)
    r = local.received(placement, counts)
    assert r[0, 6, 0] == counts[0, 4:, 0].sum()
    assert r[0, 0, 0] == counts[0, :4, 0].sum()


def test_group_weights_validation_and_stacking() -> None:
    placement = Placement.from_homes(np.array([[0, 3], [1, 2]]), 4, 2)
    placement.copies[0, 2, 0] = 1
    a = Assignment.group_local(placement, 2)
    a.validate(placement)
    bad = Assignment(a.weights, a.group_weights * 0.5, 2)
    with pytest.raises(PlanError, match="group shares"):
        bad.validate(placement)
    with pytest.raises(PlanError, match="does not divide"):
        Assignment(a.weights, a.group_weights, 3).validate(placement)
    plain = Assignment.to_home(placement)
    mixed = Assignment.from_layers([(a, 0), (plain, 1)])
    assert mixed.group_size == 2
    np.testing.assert_array_equal(mixed.group_weights[1], 0.0)
    np.testing.assert_array_equal(mixed.group_weights[0], a.group_weights[0])
    assert Assignment.from_layers([(plain, 0), (plain, 1)]).group_weights is None
    assert a.take_layers([0]).group_weights.shape == (1, 2, 4)


def test_auto_keeps_hybrid_routing() -> None:
    cluster = get_cluster("a800-eth10")
    loads = _cross_skew()
    ctx = PlanContext.create(
        cluster,
        SPEC,
        slots_per_device=2,
        cost=CostModel(cluster, SPEC),
        options={"auto": {"candidates": ["static", "hybrid"]}},
    )
    auto = make_plan("auto", loads, None, ctx)
    hybrid = make_plan("hybrid", loads, None, ctx)
    assert auto.notes["chosen"] == ["hybrid"]
    np.testing.assert_allclose(auto.cost.layer_s, hybrid.cost.layer_s)


def test_more_devices_than_experts_with_ep_groups_inside_the_domains_is_static() -> None:
    """4 experts on 2 domains of 8 (a800-eth10): static is DeepSpeed's EP groups of 4 devices
    (device d holds expert d mod 4, each token goes to its group's copy), two groups per
    domain, so no token crosses the 10 Gb/s WAN already and `hybrid` keeps static's plan. (Until
    issue 66 static held expert e on a block of 4 devices and split every expert's tokens over
    all 4 copies, half of them across the WAN, and `hybrid` gathered the missing experts.)"""
    cluster = get_cluster("a800-eth10")
    spec = ModelSpec("h4", d_model=1024, d_expert=1024, experts=4, top_k=1, moe_layers=1,
                     dtype_bytes=2, tokens_per_device=4096)  # fmt: skip
    ctx = _ctx(cluster, spec, slots=2)
    loads = np.full((1, 16, 4), 1024.0)
    plan = make_plan("hybrid", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    np.testing.assert_array_equal(static.placement.copies[0].argmax(axis=1), np.arange(16) % 4)
    assert _cross_domain_tokens(static, cluster, loads) == 0.0
    np.testing.assert_array_equal(plan.placement.copies, static.placement.copies)
    assert plan.notes["replicated"][0] == [[], []]
    assert plan.notes["edp_copies"] and plan.notes["ep_group_size"] == 4
    assert plan.notes["p_star"] == [1.0]
    assert plan.cost.step_s == static.cost.step_s


def test_more_devices_than_experts_gathers_what_a_domain_lacks() -> None:
    """16 experts on 4 domains of 8 (a800-eth10:4): DeepSpeed's EP groups of 16 devices span
    two domains, so domain g holds experts 8 (g mod 2) .. 8 (g mod 2) + 7 and sends its tokens
    for the other 8 across the WAN to the copies in the other domain of its group. `hybrid`
    keeps the copies, gives each domain a copy of the 8 experts it lacks (one free slot on each
    device) and routes each domain's tokens to its own copies: no token crosses the WAN."""
    ctx, _ = _four_dc_ctx(16, None)
    loads = np.full((1, 32, 16), 1024.0)
    plan = make_plan("hybrid", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert static.assignment.group_size == 16
    assert np.all(plan.placement.copies >= static.placement.copies)
    low, high = list(range(8)), list(range(8, 16))
    assert plan.notes["replicated"][0] == [high, low, high, low]
    assert plan.notes["edp_copies"] and plan.notes["p_star"] == [0.0]
    # Under static each domain's 8 devices send 1024 tokens of each of 8 experts out of it.
    assert _cross_domain_tokens(static, ctx.cluster, loads) == 4 * 8 * 8 * 1024.0
    assert _cross_domain_tokens(plan, ctx.cluster, loads) == 0.0
    assert plan.cost.step_s < static.cost.step_s


def test_one_group_size_per_plan_with_ep_groups() -> None:
    """16 experts on 4 DCs of 8 (DeepSpeed's EP groups of 2 DCs), two layers: gathering pays in
    layer 0 (1024 tokens per pair) and not in layer 1 (1 token). An assignment has one group
    size, so `hybrid` cannot keep static's EP-group routing (16 devices) in layer 1 beside its
    domain routing (8) in layer 0: it takes the even split over the static copies there, the
    cheaper plan over both layers. `auto` between the two would pick hybrid's layer 0 and
    static's layer 1, which do not stack: it keeps the cheaper single size, hybrid's."""
    cluster = get_cluster("a800-eth10:4")
    spec = ModelSpec("h", d_model=1024, d_expert=1024, experts=16, top_k=1, moe_layers=2,
                     dtype_bytes=2, tokens_per_device=4096)  # fmt: skip
    ctx = PlanContext.create(
        cluster, spec, slots_per_device=2, cost=CostModel(cluster, spec),
        options={"auto": {"candidates": ["static", "hybrid"]}},
    )  # fmt: skip
    loads = np.full((2, 32, 16), 1024.0)
    loads[1] = 1.0
    hybrid = make_plan("hybrid", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert static.assignment.group_size == 16 and hybrid.assignment.group_size == 8
    assert hybrid.notes["p_star"] == [0.0, 1.0]
    assert hybrid.cost.layer_s[0] < static.cost.layer_s[0]
    assert hybrid.cost.layer_s[1] > static.cost.layer_s[1]  # the even split, not EP groups
    assert hybrid.cost.step_s < static.cost.step_s
    auto = make_plan("auto", loads, None, ctx)
    assert auto.notes["chosen"] == ["hybrid", "hybrid"]
    assert auto.cost.step_s == hybrid.cost.step_s


def test_closed_form_p_star_follows_the_paper() -> None:
    """HybridEP's optimum: p* = 0 when a domain's data (2 D) outweighs G experts (G P_E), else
    1 - B Lat_PE / (P_E (G - 1)) clipped to [0, 1]."""
    cluster = get_cluster("a800-eth10")
    ctx = _ctx(cluster)
    home = np.repeat(np.arange(16), 1)[None]  # expert e on device e
    heavy = _cross_skew() * 100  # 2 D >> G P_E: gather every expert
    assert p_closed_form(heavy, home, 8, ctx).tolist() == [0.0]
    light = np.full((1, 16, 16), 0.01)  # almost no data: little to gain, p* near 1
    (p,) = p_closed_form(light, home, 8, ctx)
    assert 0.9 < p <= 1.0


# ------------------------------------------------------------------ the search's shortcuts


def test_first_sorted_is_the_head_of_a_stable_argsort() -> None:
    rng = np.random.default_rng(11)
    for trial in range(300):
        rows, n = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        kind = trial % 4
        if kind == 0:
            key = -rng.integers(0, 4, (rows, n)).astype(float)  # ties everywhere
        elif kind == 1:
            key = np.where(rng.random((rows, n)) < 0.5, np.inf, -rng.random((rows, n)))
        elif kind == 2:
            key = np.full((rows, n), np.inf)
        else:
            key = -rng.zipf(1.5, (rows, n)).astype(float)
        k = int(rng.integers(1, n + 1))
        want = np.argsort(key, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(_first_sorted(key, k), want)


@pytest.mark.parametrize(
    ("dpn", "nodes", "domains", "slots_extra"),
    [(2, 2, 2, 1), (4, 1, 3, 2), (2, 3, 1, 1), (8, 4, 3, 2)],
)
def test_routing_is_group_local_and_cuts_price_as_the_cost_model(
    dpn: int, nodes: int, domains: int, slots_extra: int
) -> None:
    # The assignment the plan builds from its pairs is `Assignment.group_local` of its
    # placement; the chosen cut's predicted seconds are the cost model's, on few pairs per
    # layer and on more than 80 (96 devices: the prefix grid).
    cluster = toy_cluster(
        dpn, nodes, domains, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=1e-6, flops=1e13
    )
    D = cluster.num_devices
    E = 2 * D
    spec = toy_spec(experts=E, layers=2, d_model=256, d_expert=256, tokens=8192)
    rng = np.random.default_rng(D)
    loads = np.floor(rng.zipf(1.3, (2, D, E)) * rng.random((2, D, E)) * 200)
    ctx = _ctx(cluster, spec, slots=2 + slots_extra)
    plan = make_plan("hybrid", loads, None, ctx)
    _, size = domain_grouping(cluster)
    local = Assignment.group_local(plan.placement, size)
    np.testing.assert_array_equal(plan.assignment.weights, local.weights)
    np.testing.assert_array_equal(plan.assignment.group_weights, local.group_weights)
    assert plan.assignment.group_size == local.group_size
    assert_priced_as_the_cost_model(plan, ctx.cost, loads)
    # the search's own price of the chosen cut (Trans a broadcast: each expert's copy leaves
    # its home once however many domains receive it) is the cost model's
    searched = [after for _, after in plan.notes["hybrid_layer_s"]]
    np.testing.assert_allclose(searched, plan.cost.layer_s, rtol=1e-9)
    static = make_plan("static", loads, None, ctx)
    assert np.all(plan.cost.layer_s <= static.cost.layer_s * (1 + 1e-12))
    if D > 80:  # more pairs than prefixes priced one by one
        free = ctx.slots_per_device - static.placement.copies.sum(axis=2)
        pairs = choose_pairs(loads, static.placement.home, free, size)
        assert np.diff(pairs.start).max() + 1 > PREFIX_EXACT + PREFIX_POINTS


@pytest.mark.parametrize(
    ("cluster_name", "transfer_scale"),
    [("dgx-h100:2", 1.0), ("a800-eth10:2", 1.0), ("a800-eth10:4", 1.0), ("a800-eth10:2", 3.0)],
)
def test_the_chosen_states_price_as_the_cost_model(
    cluster_name: str, transfer_scale: float
) -> None:
    """`hybrid` hands `finish_plan` the per-device state of each layer's chosen cut; under every
    schedule it equals `CostModel.price` of the plan (group-local routing included), first from
    nothing and then re-planned from its own plan; with bulk transfers stretched
    (`HostCosts.transfer_scale`) too."""
    import dataclasses

    from poise.core.cluster import HostCosts

    cluster = get_cluster(cluster_name)
    if transfer_scale != 1.0:
        cluster = dataclasses.replace(cluster, host=HostCosts(transfer_scale=transfer_scale))
    D = cluster.num_devices
    spec = ModelSpec("h", 256, 512, experts=2 * D, top_k=2, moe_layers=3, tokens_per_device=512)
    replicated = 0
    for seed, schedule in enumerate(["sync", "pipelined(4)", "prophet", "hybrid"]):
        rng = np.random.default_rng(seed)
        cost = CostModel(cluster, spec, parse_schedule(schedule))
        ctx = PlanContext.create(cluster, spec, slots_per_device=3, cost=cost)
        loads = np.floor(50 * rng.zipf(1.3, size=(3, D, 2 * D)).astype(float))
        other = np.floor(50 * rng.zipf(1.3, size=loads.shape).astype(float))
        first = make_plan("hybrid", loads, None, ctx)
        again = make_plan("hybrid", other, first, ctx)
        replicated += int(first.placement.replicas().sum())
        for plan, on in ((first, loads), (again, other)):
            assert_priced_as_the_cost_model(plan, cost, on)
    assert replicated > 0


def _four_dc_ctx(experts: int, expert_domain: int | None) -> tuple[PlanContext, ModelSpec]:
    """4 DCs x 8 A800 (`a800-eth10:4`), `experts` of SPEC's size; `hybrid.expert_domain` set when
    given."""
    cluster = get_cluster("a800-eth10:4")
    spec = ModelSpec("h", d_model=1024, d_expert=1024, experts=experts, top_k=1, moe_layers=1,
                     dtype_bytes=2, tokens_per_device=4096)  # fmt: skip
    options = {} if expert_domain is None else {"hybrid": {"expert_domain": expert_domain}}
    ctx = PlanContext.create(
        cluster, spec, slots_per_device=2, cost=CostModel(cluster, spec), options=options
    )
    return ctx, spec


@pytest.mark.parametrize("expert_domain", [None, 2])
def test_a_fixed_expert_domain_gathers_only_inside_its_block(expert_domain: int | None) -> None:
    """HybridEP's S_ED (§V-G, "S_ED fixed"): 32 experts homed one per device (expert e on device
    e, DC e // 8); every device of DC 0 sends 1000 tokens to each expert of DC 1 and 2000 to each
    of DC 2 (16-32 MB of tokens over the 10 Gb/s WAN per expert and all-to-all against 4 MiB of
    weights), 10 to the rest; DC 0 has 8 free slots. Free (no S_ED), it gathers the heavier DC
    2's experts 16-23; with S_ED = 2 DCs (blocks {0, 1}, {2, 3}) only DC 1's experts 8-15."""
    ctx, _ = _four_dc_ctx(32, expert_domain)
    loads = np.full((1, 32, 32), 10.0)
    loads[0, :8, 8:16] = 1000.0
    loads[0, :8, 16:24] = 2000.0
    plan = make_plan("hybrid", loads, None, ctx)
    gathered = set(plan.notes["replicated"][0][0])
    assert gathered == (set(range(16, 24)) if expert_domain is None else set(range(8, 16)))
    if expert_domain is not None:
        for g, experts in enumerate(plan.notes["replicated"][0]):
            block = range(g // 2 * 16, g // 2 * 16 + 16)  # the experts homed in g's block
            assert set(experts) <= set(block), (g, experts)


@pytest.mark.parametrize(("expert_domain", "replicated"), [(None, [[1, 2, 3], [0, 2, 3],
                         [0, 1, 3], [0, 1, 2]]), (2, [[1], [0], [3], [2]])])  # fmt: skip
def test_a_fixed_expert_domain_limits_the_copies_gathered(
    expert_domain: int | None, replicated: list[list[int]]
) -> None:
    """More devices than experts without DeepSpeed's EP groups: 4 experts on 4 DCs of 8 and 3
    of the 4 static copies in place (the block fallback of `poise.core.static_ep` is for E not
    dividing D; here the previous plan holds expert g on all of DC g, as `shadow` from those
    homes would). Even loads: every DC lacks three experts and has 8 free slots. Free, each DC
    gathers all three (heaviest first, ties to the lower expert); with S_ED = 2 DCs, only the
    one held in its block (DC 0 <-> 1, DC 2 <-> 3), and the tokens for the other block's
    experts still cross."""
    ctx, _ = _four_dc_ctx(4, expert_domain)
    loads = np.full((1, 32, 4), 1024.0)
    placement = Placement.from_homes(np.array([[0, 8, 16, 24]]), 32, 2)
    placement.copies[0, np.arange(32), np.arange(32) // 8] = 1
    added = _fill_domains(placement, loads, 8, expert_domain)
    assert [[e for e, _ in got] for got in added[0]] == replicated
    local = Assignment.group_local(placement, 8, base=Assignment.even(placement))
    send, _ = level_traffic(ctx.cluster, placement, local, loads)
    crossing = float(send[2].sum())
    assert crossing == (0.0 if expert_domain is None else pytest.approx(32 * 2 * 1024.0))


@pytest.mark.parametrize(("expert_domain", "replicated"), [(None, [[8, 9, 10, 11, 12, 13, 14, 15],
                         [0, 1, 2, 3, 4, 5, 6, 7]] * 2), (1, [[]] * 4)])  # fmt: skip
def test_a_fixed_expert_domain_limits_what_ep_groups_gather(
    expert_domain: int | None, replicated: list[list[int]]
) -> None:
    """16 experts on 4 DCs of 8 in DeepSpeed's EP groups of two DCs: free, each DC gathers the 8
    experts it lacks; with S_ED = 1 DC a DC gathers only experts held in itself, i.e. none, and
    the plan is static's (its tokens for the other 8 experts still cross to its group's
    copies)."""
    ctx, _ = _four_dc_ctx(16, expert_domain)
    loads = np.full((1, 32, 16), 1024.0)
    plan = make_plan("hybrid", loads, None, ctx)
    static = make_plan("static", loads, None, ctx)
    assert plan.notes["replicated"][0] == replicated
    crossing = _cross_domain_tokens(plan, ctx.cluster, loads)
    assert crossing == (0.0 if expert_domain is None else 4 * 8 * 8 * 1024.0)
    if expert_domain is not None:
        assert plan.cost.step_s == static.cost.step_s


def test_expert_domain_option_is_checked() -> None:
    from poise.core.errors import ConfigError
    from poise.plan.policies.options import check_option

    assert check_option("hybrid", "expert_domain", 4) == 4
    with pytest.raises(ConfigError, match=r"hybrid\.expert_domain"):
        check_option("hybrid", "expert_domain", 0)


def _fill_domains_one_by_one(
    placement: Placement, loads: np.ndarray, size: int, expert_domain: int | None = None
) -> list[list[list[tuple[int, int]]]]:
    """`hybrid._fill_domains` as it was written, domain by domain and expert by expert: the
    reference of the vectorised one."""
    L, D, E = loads.shape
    G = D // size
    copies = placement.copies
    block = G if expert_domain is None else min(expert_domain, G)
    added: list[list[list[tuple[int, int]]]] = []
    for layer in range(L):
        free = placement.slots_per_device - copies[layer].sum(axis=1)  # [D]
        by_group = copies[layer].reshape(G, size, E).sum(axis=1) > 0  # [G, E] before adding
        per_layer = []
        for g in range(G):
            devs = np.arange(g * size, (g + 1) * size)
            held = copies[layer, devs].sum(axis=0) > 0  # [E]
            lo = g // block * block
            reachable = by_group[lo : lo + block].any(axis=0)  # [E] held in g's expert domain
            demand = loads[layer, devs].sum(axis=0)  # [E]
            missing = [
                e
                for e in np.argsort(-demand, kind="stable").tolist()
                if reachable[e] and not held[e]
            ]
            got = []
            for e in missing:
                d = int(devs[np.argmax(free[devs])])
                if free[d] <= 0:
                    break
                copies[layer, d, e] += 1
                free[d] -= 1
                got.append((e, d))
            per_layer.append(got)
        added.append(per_layer)
    return added


@pytest.mark.parametrize("expert_domain", [None, 1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_filling_every_domain_at_once_is_filling_them_one_by_one(
    seed: int, expert_domain: int | None
) -> None:
    """`_fill_domains` fills all domains of a layer in rounds: the same copies and the same
    (expert, device) lists as the domain-by-domain loop, ties (integer loads) included."""
    from poise.plan.policies.hybrid import _fill_domains

    rng = np.random.default_rng(seed)
    L, G, size, E, slots = 3, 7, 4, 5, 3
    D = G * size
    loads = rng.integers(0, 4, size=(L, D, E)).astype(float)
    home = rng.integers(0, D, size=(L, E))
    start = Placement.from_homes(home, D, slots)
    extra = rng.random((L, D, E)) < 0.1
    start.copies += (extra & (start.copies.sum(axis=2, keepdims=True) < slots - 1)).astype(
        start.copies.dtype
    )
    a, b = start.copy(), start.copy()
    added = _fill_domains(a, loads, size, expert_domain)
    expected = _fill_domains_one_by_one(b, loads, size, expert_domain)
    assert added == expected
    np.testing.assert_array_equal(a.copies, b.copies)
    # (a domain's own block holds only what it holds: with blocks of one, nothing is missing)
    assert any(any(per_group) for per_group in added) == (expert_domain != 1)


@pytest.mark.parametrize(
    ("dpn", "nodes", "domains"), [(2, 2, 2), (4, 1, 3), (2, 3, 1), (4, 2, 3), (8, 4, 3)]
)
def test_every_cut_prices_as_the_cost_model_with_messages(
    dpn: int, nodes: int, domains: int
) -> None:
    # Every priced prefix of the greedy (not only the chosen one) equals `CostModel.price` of
    # its plan (the first k pairs replicated, their groups routing to them), on links slow to
    # reach (a millisecond a message): the search's message counts, a pair's multiplicity
    # going to or from zero, are the cost model's (`Routing.messages`, `replica_messages`).
    from poise.cost.incremental import LayerState
    from poise.plan.policies.hybrid import cut_times

    cluster = toy_cluster(
        dpn, nodes, domains, bw=1e10, inter_bw=1e9, wan_bw=1e8, lat=1e-3, flops=1e13
    )
    D = cluster.num_devices
    E = 2 * D
    spec = toy_spec(experts=E, layers=2, d_model=256, d_expert=256, tokens=8192)
    cost = CostModel(cluster, spec)
    rng = np.random.default_rng(D + domains)
    loads = np.floor(np.minimum(rng.zipf(1.3, (2, D, E)), 100) * (rng.random((2, D, E)) < 0.5) * 50)
    home = np.tile(np.arange(E) % D, (2, 1))
    _, size = domain_grouping(cluster)
    placement = Placement.from_homes(home, D, 4)
    free = 4 - placement.copies.sum(axis=2)
    pairs = choose_pairs(loads, home, free, size)
    state = LayerState.for_homes(cost, home, loads)
    cuts, times, _ = cut_times(state, loads, home, size, pairs)
    checked = 0
    for layer in range(2):
        a = int(pairs.start[layer])
        for c, k in enumerate(cuts[layer]):
            if k < 0:
                continue
            p = Placement.from_homes(home[layer : layer + 1], D, 4)
            take = slice(a, a + int(k))
            p.copies[0, pairs.device[take], pairs.expert[take]] = 1
            to_home = Assignment.to_home(p)
            gw = to_home.weights.copy()
            gw[0, pairs.expert[take], pairs.device[take]] = 1.0
            assignment = Assignment(to_home.weights, gw, size)
            want = cost.price(p, assignment, loads[layer : layer + 1]).layer_s[0]
            assert times[layer, c] == pytest.approx(want, rel=1e-12)
            checked += 1
    assert checked > 4
