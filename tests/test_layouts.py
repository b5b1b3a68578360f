"""SmartMoE's layout pool: enumeration, validation, placement, pricing by hand, online choice."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Assignment
from poise.cost.model import CostModel
from poise.cost.schedule import Schedule
from poise.layouts.online import select_layout, switch_seconds
from poise.layouts.pool import (
    Layout,
    LayoutSettings,
    enumerate_layouts,
    layout_problem,
    memory_bytes,
    sub_cluster,
)
from poise.layouts.price import (
    allreduce_times,
    permute_in_layout,
    price_layout,
    rank_layouts,
    stage_phases,
)
from poise.plan.policies.base import static_placement

from .helpers import toy_cluster, toy_spec


def uniform(steps: int, layers: int, devices: int, experts: int, per: float) -> np.ndarray:
    return np.full((steps, layers, devices, experts), per)


def all_to_expert0(steps: int, layers: int, devices: int, experts: int, per: float) -> np.ndarray:
    loads = np.zeros((steps, layers, devices, experts))
    loads[..., 0] = per
    return loads


# --------------------------------------------------------------------------- the layout type
def test_degrees_groups_and_names() -> None:
    lay = Layout(devices=8, experts=8, layers=2, pp=2, ep=2)
    assert (lay.stage_devices, lay.edp, lay.dp, lay.experts_per_device) == (4, 2, 4, 4)
    assert lay.layers_per_stage == 1 and lay.name == "pp2-ep2-edp2"
    assert lay.ep_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.edp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert "4 per device" in lay.describe() and "2 replica(s)" in lay.describe()
    assert Layout.parse("pp2-ep2-edp2", 8, 8, 2) == lay
    assert Layout.parse("ep=2, pp=2", 8, 8, 2) == lay
    assert Layout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ep": 3}, "ep"),  # 3 divides neither the 8 devices nor the 8 experts
        ({"pp": 3}, "pp"),
        ({"pp": 2, "layers": 3}, "pp"),  # 3 layers do not split into 2 stages
        ({"ep": 16, "devices": 16}, "ep"),  # 16 > 8 experts: no whole experts per device
        ({"ep": 0}, "ep"),
    ],
)
def test_bad_layouts_are_config_errors(kwargs: dict, field: str) -> None:
    args = {"devices": 8, "experts": 8, "layers": 2, **kwargs}
    with pytest.raises(ConfigError) as exc:
        Layout(**args)
    assert exc.value.field == field


def test_parse_and_settings_refuse_nonsense() -> None:
    with pytest.raises(ConfigError, match="edp"):
        Layout.parse("ep=4,edp=3", 8, 8, 2)  # edp is 8 / 4 = 2
    with pytest.raises(ConfigError, match="expected"):
        Layout.parse("pure expert parallel", 8, 8, 2)
    with pytest.raises(ConfigError):
        LayoutSettings(pool=0)
    with pytest.raises(ConfigError):
        LayoutSettings(micro_batches=0)


def test_enumeration_covers_the_divisors() -> None:
    got = {(lay.pp, lay.ep) for lay in enumerate_layouts(8, 4, 4)}
    # pp | gcd(8, 4); ep | 8 / pp and ep | 4.
    assert got == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)}
    assert {lay.pp for lay in enumerate_layouts(8, 4, 4, max_pp=2)} == {1, 2}


def test_placement_holds_a_full_expert_set_per_group_and_routes_inside_it() -> None:
    lay = Layout(devices=4, experts=4, layers=1, ep=2)
    placement, assignment = lay.placement()
    placement.validate()
    assignment.validate(placement)
    assert placement.copies[0].tolist() == [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]]
    assert placement.home[0].tolist() == [0, 0, 1, 1]
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 50, size=(1, 4, 4)).astype(float)
    received = assignment.received(placement, loads)
    # Every group computes exactly its own sources' tokens, expert by expert.
    for g in range(2):
        mine = slice(2 * g, 2 * g + 2)
        np.testing.assert_allclose(received[0, mine].sum(axis=0), loads[0, mine].sum(axis=0))
    with pytest.raises(PlanError, match="2 experts"):
        lay.placement(np.array([[0, 0, 0, 1]]))  # three experts on one device


def test_sub_cluster_nesting() -> None:
    c = toy_cluster(devices_per_node=4, nodes=2, domains=2)  # 16 devices
    assert sub_cluster(c, 2).num_devices == 2 and sub_cluster(c, 2).num_nodes == 1
    assert sub_cluster(c, 8).nodes_per_domain == 2 and sub_cluster(c, 8).domains == 1
    assert sub_cluster(c, 16) is c
    assert sub_cluster(c, 3) is None
    c6 = toy_cluster(devices_per_node=4, nodes=3)  # 12 devices, one domain
    assert sub_cluster(c6, 6) is None  # 1.5 nodes


# ------------------------------------------------------------------------------- pricing
def test_pure_ep_price_is_the_cost_models_static_plan() -> None:
    """With one EP group and no pipeline, a layout costs exactly the cost model's static plan
    plus the dense all-reduce and the simulator's other work outside the layers (T_out)."""
    cluster = toy_cluster(devices_per_node=4, bw=2e9, lat=1e-6)
    spec = toy_spec(experts=8, layers=2, d_model=16, d_expert=32, tokens=64, non_moe=100.0)
    rng = np.random.default_rng(1)
    loads = rng.integers(0, 16, size=(3, 2, 4, 8)).astype(float)
    lay = Layout(devices=4, experts=8, layers=2, ep=4)
    got = price_layout(lay, cluster, spec, loads)
    placement = static_placement(2, 8, 4, 2)
    model = CostModel(cluster, spec)
    want = [model.price(placement, Assignment.to_home(placement), s).step_s for s in loads]
    _, t_dp = allreduce_times(lay, cluster, spec)
    # P_d = 100 / 2 = 50 parameters per block, 2 blocks, fp32 (400 bytes) over 4 devices: the
    # tree (2 G / bw + 2 log2(4) lat) beats the ring (2 * 3/4 * G / bw + 2 * 3 lat).
    ring = 2 * 3 / 4 * 400 / 2e9 + 2 * 3 * 1e-6
    tree = 2 * 400 / 2e9 + 2 * 2 * 1e-6
    assert tree < ring and t_dp == pytest.approx(tree)
    # T_out: the counts' gather (2 x 8 int64) and the clip's scalar, tree all-reduces on the
    # toy cluster (no measured host costs: no per-parameter clip or optimizer time).
    assert got.outside_s == pytest.approx(2 * 128 / 2e9 + 2 * 2 * 1e-6 + 2 * 8 / 2e9 + 2 * 2e-6)
    np.testing.assert_allclose(got.steps_s, np.array(want) + t_dp + got.outside_s, rtol=1e-12)
    assert got.step_s == pytest.approx(np.mean(want) + t_dp + got.outside_s)
    assert got.edp_allreduce_s == 0 and got.bubble_s == 0 and got.p2p_s == 0


def test_groups_priced_apart_equal_the_whole_stage_group_local_plan() -> None:
    """`stage_phases` prices each EP group on its own devices; the cost model on the stage's
    group-local placement (`Layout.placement`) gives the same phases (Trans/Agg aside)."""
    cluster = toy_cluster(devices_per_node=4, nodes=2, bw=4e9, inter_bw=1e9, lat=1e-6)
    spec = toy_spec(experts=8, layers=3, d_model=16, d_expert=32, tokens=64, non_moe=10.0)
    rng = np.random.default_rng(2)
    random = rng.integers(0, 30, size=(3, 8, 8)).astype(float)
    repeated = np.tile(random[:, :2], (1, 4, 1))  # four identical pairs of sources
    cases = [(random, 2), (random, 4), (random, 8), (repeated, 2), (repeated, 4)]
    for counts, ep in cases:  # groups inside a node, a whole node, both nodes
        lay = Layout(devices=8, experts=8, layers=3, ep=ep)
        homes = np.stack([rng.permutation(np.arange(8) % ep) for _ in range(3)])
        got = stage_phases(lay, cluster, spec, counts, homes, Schedule())
        placement, assignment = lay.placement(homes)
        want, _ = CostModel(cluster, spec).phases(placement, assignment, counts)
        for name in ("dispatch_s", "combine_s", "expert_fwd_s", "expert_bwd_s", "non_moe_fwd_s"):
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-12)
        assert not got.trans_s.any() and not got.agg_s.any()


def test_edp_allreduce_and_pipeline_by_hand() -> None:
    cluster = toy_cluster(devices_per_node=4, bw=1e9, lat=2e-6)
    spec = toy_spec(experts=4, layers=2, d_model=8, d_expert=16, tokens=40)
    W_e = 2 * 8 * 16 * 4  # expert bytes
    lay = Layout(devices=4, experts=4, layers=2, pp=1, ep=2)
    t_edp, t_dp = allreduce_times(lay, cluster, spec)
    # 2 layers x 2 experts per device, ring of 2 devices: 2 * 1/2 * G / bw + 2 * lat.
    assert t_edp == pytest.approx(2 * 2 * W_e / 1e9 + 2 * 2e-6)
    assert t_dp == 0  # non_moe = 0: no dense parameters
    piped = Layout(devices=4, experts=4, layers=2, pp=2, ep=1)  # stages of 2 replicas
    loads = uniform(1, 2, 4, 4, per=10.0)
    settings = LayoutSettings(micro_batches=4)
    cost = price_layout(piped, cluster, spec, loads, settings)
    # m = 4, pp = 2: the slowest stage's time times (4 + 1) / 4; the bubble is a quarter of it.
    stage = (cost.steps_s[0] - cost.p2p_s - cost.edp_allreduce_s - cost.outside_s) / 1.25
    assert cost.bubble_s == pytest.approx(stage / 4)
    # Activations of 40 * 2 / 4 = 20 tokens of 32 bytes per hop, 2 * (pp - 1) hops.
    assert cost.p2p_s == pytest.approx(2 * (20 * 32 / 1e9 + 2e-6))
    # One layer per stage, one EDP pair holding all 4 experts.
    assert cost.edp_allreduce_s == pytest.approx(4 * W_e / 1e9 + 2 * 2e-6)


def test_uniform_load_prefers_pure_ep() -> None:
    """Uniform routing and experts large against the tokens: every EDP layout pays an
    all-reduce of megabytes to save a few kilobytes of all-to-all."""
    cluster = toy_cluster(devices_per_node=8, bw=1e9, flops=1e12)
    spec = toy_spec(experts=8, layers=1, d_model=64, d_expert=4096, tokens=64)
    search = rank_layouts(uniform(2, 1, 8, 8, per=8.0), cluster, spec)
    assert [c.layout.ep for c in search.ranked] == [8, 4, 2, 1]
    assert search.ranked[0].edp_allreduce_s == 0
    assert [c.layout.ep for c in search.pool] == [8, 4, 2, 1]  # pool of 4
    small = rank_layouts(uniform(2, 1, 8, 8, per=8.0), cluster, spec, LayoutSettings(pool=2))
    assert [c.layout.ep for c in small.pool] == [8, 4]


def test_heavy_skew_with_cheap_allreduce_prefers_expert_data_replicas() -> None:
    """Every token on expert 0: pure EP makes one device compute all of them; with small
    experts on a fast link, eight replicas of the expert set (ep=1) cost almost nothing."""
    cluster = toy_cluster(devices_per_node=8, bw=1e10, flops=1e9)
    spec = toy_spec(experts=8, layers=1, d_model=64, d_expert=8, tokens=4096)
    search = rank_layouts(all_to_expert0(2, 1, 8, 8, per=4096.0), cluster, spec)
    assert search.ranked[0].layout.ep == 1 and search.ranked[0].layout.edp == 8
    assert search.ranked[-1].layout.ep == 8
    best, pure = search.ranked[0], search.ranked[-1]
    assert best.a2a_s == 0 and pure.a2a_s > 0
    assert pure.expert_s == pytest.approx(8 * best.expert_s)  # one device computes 8x


def test_memory_and_nesting_reject_layouts() -> None:
    spec = toy_spec(experts=8, layers=1, d_model=64, d_expert=64, tokens=16)
    per_expert = 2 * 64 * 64 * (4 + 8)  # weights + optimizer state
    cluster = dataclasses.replace(toy_cluster(devices_per_node=8), memory_bytes=3 * per_expert)
    assert memory_bytes(Layout(8, 8, 1, ep=4), spec) == 2 * per_expert
    assert layout_problem(Layout(8, 8, 1, ep=4), cluster, spec) is None
    assert "GiB" in layout_problem(Layout(8, 8, 1, ep=2), cluster, spec)
    search = rank_layouts(uniform(1, 1, 8, 8, 2.0), cluster, spec)
    assert {c.layout.ep for c in search.ranked} == {4, 8}
    assert {lay.ep for lay, _ in search.rejected} == {1, 2}
    # Domains of 2 devices: EP groups of 4 span two domains while having EDP partners.
    wan = toy_cluster(devices_per_node=2, nodes=1, domains=4)
    why = layout_problem(Layout(8, 8, 1, ep=4), wan, spec)
    assert why is not None and "one domain" in why
    assert layout_problem(Layout(8, 8, 1, ep=8), wan, spec) is None  # edp = 1: no groups
    with pytest.raises(ConfigError):
        price_layout(Layout(8, 8, 1, ep=2), cluster, spec, uniform(1, 1, 8, 8, 2.0))
    tight = dataclasses.replace(cluster, memory_bytes=1.0)
    with pytest.raises(ConfigError, match="no layout"):
        rank_layouts(uniform(1, 1, 8, 8, 2.0), tight, spec)


def test_loads_must_fit_the_cluster() -> None:
    cluster = toy_cluster(devices_per_node=8)
    spec = toy_spec(experts=8)
    with pytest.raises(ConfigError, match="one must divide the other"):
        rank_layouts(uniform(1, 1, 3, 8, 1.0), cluster, spec)
    with pytest.raises(ConfigError, match="experts"):
        rank_layouts(uniform(1, 1, 8, 4, 1.0), cluster, spec)


# -------------------------------------------------------------------------------- online
def test_permute_inside_the_layout_splits_hot_experts_in_every_group() -> None:
    cluster = toy_cluster(devices_per_node=4, bw=1e9, flops=1e9)
    spec = toy_spec(experts=4, layers=1, d_model=16, d_expert=64, tokens=400)
    lay = Layout(devices=4, experts=4, layers=1, ep=2)
    loads = np.zeros((1, 4, 4))
    loads[0, :, :2] = 100.0  # experts 0 and 1, both at position 0 of the static blocks
    homes, notes = permute_in_layout(lay, cluster, spec, loads)
    assert notes["accepted"] == [True]
    assert sorted(homes[0, :2].tolist()) == [0, 1]  # the hot pair now on different positions
    assert np.bincount(homes[0], minlength=2).tolist() == [2, 2]  # the layout's slots kept
    placement, _ = lay.placement(homes)
    for g in range(2):  # the same positions in both EP groups
        np.testing.assert_array_equal(
            placement.copies[0, 2 * g : 2 * g + 2], placement.copies[0, :2]
        )
    static = price_layout(lay, cluster, spec, loads)
    online = price_layout(lay, cluster, spec, loads, homes=homes)
    assert online.expert_s < static.expert_s and online.step_s < static.step_s
    # Balanced loads: permute keeps the layout (nothing to gain).
    _, notes = permute_in_layout(lay, cluster, spec, np.full((1, 4, 4), 10.0))
    assert notes["accepted"] == [False]


def test_switch_seconds_by_hand() -> None:
    cluster = toy_cluster(devices_per_node=2, bw=1e9, lat=1e-6)
    spec = toy_spec(experts=2, layers=1, d_model=8, d_expert=16)
    M_e = 2 * 8 * 16 * (4 + 8)
    pure, replicas = Layout(2, 2, 1, ep=2), Layout(2, 2, 1, ep=1)
    # Pure EP -> replicas: each device receives the other expert (weights and optimizer state)
    # inside the node; the dense blocks are already everywhere.
    assert switch_seconds(pure, replicas, cluster, spec) == pytest.approx(M_e / 1e9 + 1e-6)
    assert switch_seconds(replicas, pure, cluster, spec) == 0.0  # dropping copies moves nothing
    assert switch_seconds(pure, pure, cluster, spec) == 0.0
    swapped = np.array([[1, 0]])
    assert switch_seconds(pure, pure, cluster, spec, new_homes=swapped) == pytest.approx(
        M_e / 1e9 + 1e-6
    )


def test_select_layout_switches_only_when_the_saving_pays_for_the_move() -> None:
    """Every token on expert 0: eight replicas save ~1.8 ms per step over pure EP, but moving
    there sends 7 experts with their optimizer state (16 bytes per parameter) to every device."""
    cluster = toy_cluster(devices_per_node=8, bw=1e9, flops=1e12)
    spec = toy_spec(experts=8, layers=1, d_model=64, d_expert=512, tokens=550)
    spec = spec.with_(optimizer_bytes_per_param=12.0)
    pure, replicas = Layout(8, 8, 1, ep=8), Layout(8, 8, 1, ep=1)
    skewed = all_to_expert0(2, 1, 8, 8, per=550.0)
    first = select_layout([pure, replicas], skewed, cluster, spec)
    assert first.layout == replicas and first.switched and first.switch_s == 0
    assert first.step_s["pp1-ep1-edp8"] < first.step_s["pp1-ep8-edp1"]
    short = select_layout([pure, replicas], skewed, cluster, spec, current=pure, horizon_steps=1)
    gain = short.step_s["pp1-ep8-edp1"] - short.step_s["pp1-ep1-edp8"]
    M_e = 2 * 64 * 512 * (4 + 12)
    assert short.switch_s == pytest.approx(7 * M_e / 1e9)
    assert 0 < gain < short.switch_s  # one step does not pay for the move
    assert short.layout == pure and not short.switched
    horizon = int(np.ceil(short.switch_s / gain)) + 1
    long = select_layout(
        [pure, replicas], skewed, cluster, spec, current=pure, horizon_steps=horizon
    )
    assert long.layout == replicas and long.switched and long.saving_s > long.switch_s
    with pytest.raises(ConfigError):
        select_layout([], skewed, cluster, spec)


# ---------------------------------------------------------------------------- real data
def test_smartmoe_sample_on_its_cluster(smartmoe_dir) -> None:
    from poise.core.presets import get_cluster
    from poise.core.spec import get_model
    from poise.trace.importers import load_any
    from poise.trace.loads import spec_for_trace

    trace = load_any(smartmoe_dir)
    cluster = get_cluster("v100-ib50")
    spec = spec_for_trace(get_model("smartmoe-gpt"), trace, explicit=False, source="sample")
    search = rank_layouts(trace.counts, cluster, spec)
    names = [c.layout.name for c in search.ranked]
    assert len(search.pool) == 4 and search.steps_priced == 3
    # Whole expert sets on every device need 45.9 GiB of state; a V100 has 32 GiB.
    assert [lay.name for lay, _ in search.rejected] == ["pp1-ep1-edp16"]
    # The trace is heavily skewed: pure EP over the 50 Gb/s link is the slowest layout, and
    # the best keeps expert-data-parallel replicas.
    assert names[-1] == "pp1-ep16-edp1"
    assert search.ranked[0].layout.edp > 1
    pure = search.ranked[-1]
    assert pure.step_s < pure.static_s  # the online permute helps inside pure EP
    steps = [c.step_s for c in search.ranked]
    assert steps == sorted(steps)


def test_pure_ep_price_is_the_simulators_static_step() -> None:
    """The pool's pricer and the simulator charge the same work: a layout with no pipeline and
    one EP group costs, step by step, what `simulate` charges the `static` policy with the
    model's dense parameters' all-reduce and the other work outside the layers."""
    from poise.sim.simulator import simulate

    cluster = toy_cluster(devices_per_node=4, nodes=2, bw=4e9, inter_bw=1e9, lat=1e-6)
    spec = toy_spec(experts=8, layers=2, d_model=16, d_expert=32, tokens=64, non_moe=100.0)
    loads = np.random.default_rng(3).integers(0, 16, size=(4, 2, 8, 8))
    got = price_layout(Layout(devices=8, experts=8, layers=2, ep=8), cluster, spec, loads)
    run = simulate(loads, cluster, spec, ["static"], "sync", 100, dense_params=spec.dense_params)
    priced = run.runs["static"].step_s - run.runs["static"].plan_s
    np.testing.assert_allclose(got.steps_s, priced, rtol=1e-12)


def test_micro_batches_follow_a_fixed_global_batch() -> None:
    """Megatron-LM's m = gbs / (mbs dp): with 4,096 tokens per device and micro-batches of
    1,024 tokens, pp = 1 runs 4 micro-batches (gradient accumulation) and pp = 4 runs 16 (each
    stage device sees 4 x 4,096 tokens)."""
    spec = toy_spec(experts=8, layers=4, tokens=4096)
    s = LayoutSettings(micro_batch_tokens=1024)
    assert s.micro_batches_for(Layout(16, 8, 4, pp=1, ep=8), spec) == 4
    assert s.micro_batches_for(Layout(16, 8, 4, pp=4, ep=2), spec) == 16
    assert LayoutSettings().micro_batches_for(Layout(16, 8, 4, pp=4, ep=2), spec) == 4
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        LayoutSettings(micro_batch_tokens=0)
