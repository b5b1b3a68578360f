"""DeepSeek EPLB: the README's example exactly, global-mode quality, the EPLB export format."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.errors import PlanError
from poise.core.placement import Placement
from poise.core.presets import get_cluster
from poise.core.spec import MODELS
from poise.plan.eplb_format import placement_from_eplb, placement_to_eplb
from poise.plan.policies import PlanContext, make_plan
from poise.plan.policies.eplb import (
    balanced_packing,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
)

README_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def _check_consistent(phy2log: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray) -> None:
    L, E = logcnt.shape
    for layer in range(L):
        for e in range(E):
            slots = log2phy[layer, e]
            used = slots[slots >= 0]
            assert len(used) == logcnt[layer, e]
            assert np.all(slots[logcnt[layer, e] :] == -1)
            assert np.all(phy2log[layer, used] == e)
        assert np.array_equal(
            np.bincount(phy2log[layer][phy2log[layer] >= 0], minlength=E), logcnt[layer]
        )


def test_readme_example_exactly() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.sum(axis=1).tolist() == [16, 16]
    _check_consistent(phy2log, log2phy, logcnt)
    # Redundant experts named in the README: 4, 5, 10, 1 (layer 0) and 1, 5, 6, 8 (layer 1).
    assert sorted(np.nonzero(logcnt[0] == 2)[0].tolist()) == [1, 4, 5, 10]
    assert sorted(np.nonzero(logcnt[1] == 2)[0].tolist()) == [1, 5, 6, 8]


def test_global_mode_example() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 1, 2, 8)
    assert phy2log.tolist() == [
        [10, 6, 10, 7, 0, 2, 11, 4, 5, 9, 5, 4, 8, 3, 1, 1],
        [1, 10, 2, 4, 5, 11, 5, 0, 6, 7, 6, 3, 8, 8, 9, 7],
    ]
    _check_consistent(phy2log, log2phy, logcnt)
    forced, _, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8, mode="global")
    assert forced.tolist() == phy2log.tolist()


def test_primitives_ties_and_identity() -> None:
    pack, rank = balanced_packing(np.array([[1.0, 1.0, 1.0, 1.0]]), 2)
    assert pack.tolist() == [[0, 1, 0, 1]] and rank.tolist() == [[0, 0, 1, 1]]
    pack, rank = balanced_packing(np.array([[3.0, 9.0, 1.0]]), 3)  # one item per pack: identity
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]
    phy2log, rank, cnt = replicate_experts(np.array([[4.0, 4.0]]), 4)
    assert phy2log.tolist() == [[0, 1, 0, 1]] and rank.tolist() == [[0, 0, 1, 1]]
    assert cnt.tolist() == [[2, 2]]


def test_preconditions_raise() -> None:
    with pytest.raises(PlanError, match="physical slots"):
        rebalance_experts(README_WEIGHT, 15, 4, 2, 8, mode="hierarchical")
    with pytest.raises(PlanError, match="need at least"):
        rebalance_experts(README_WEIGHT, 8, 1, 1, 8)
    with pytest.raises(PlanError, match="groups"):
        rebalance_experts(README_WEIGHT, 16, 5, 1, 8, mode="hierarchical")
    # auto: 5 groups do not divide 12 experts, so global mode instead of a failure
    auto, _, _ = rebalance_experts(README_WEIGHT, 16, 5, 1, 8)
    assert auto.tolist() == rebalance_experts(README_WEIGHT, 16, 1, 1, 8)[0].tolist()


def _zipf_weight(layers: int, experts: int, s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** s
    return np.stack([rng.permutation(p) * 1e6 for _ in range(layers)])


def test_global_mode_near_lower_bound() -> None:
    weight = _zipf_weight(4, 256, 0.8, seed=1)
    phy2log, _, logcnt = rebalance_experts(weight, 288, 1, 1, 32)
    for layer in range(4):
        per_replica = weight[layer] / logcnt[layer]
        gpu_load = per_replica[phy2log[layer]].reshape(32, 9).sum(axis=1)
        bound = max(weight[layer].sum() / 32, per_replica.max())
        assert gpu_load.max() <= 1.01 * bound


def _ctx(**options: object) -> PlanContext:
    return PlanContext.create(
        get_cluster("dgx-h100:4"), MODELS["zipf-256"], slots_per_device=9, options={"eplb": options}
    )


def _zipf_loads(layers: int = 2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, 257) ** 0.8
    return np.stack(
        [rng.multinomial(8192 * 8, rng.permutation(p / p.sum()), size=32) for _ in range(layers)]
    ).astype(np.float64)


def test_policy_fills_every_slot_and_beats_static() -> None:
    loads = _zipf_loads()
    ctx = _ctx()
    plan = make_plan("eplb", loads, None, ctx)
    assert plan.notes["mode"] == "hierarchical" and plan.notes["groups"] == 4
    assert np.all(plan.placement.slots_used() == 9)
    # Hierarchical: every copy of an expert stays in its node (contiguous blocks of 64 experts).
    node_of_dev = np.arange(32) // 8
    for layer in range(2):
        d, e = np.nonzero(plan.placement.copies[layer])
        assert np.all(node_of_dev[d] == e // 64)
    static = make_plan("static", loads, None, ctx)
    assert plan.cost.max_over_mean < static.cost.max_over_mean
    again = make_plan("eplb", loads, None, ctx)
    assert np.array_equal(again.placement.copies, plan.placement.copies)
    glob = make_plan("eplb", loads, None, _ctx(mode="global"))
    assert glob.notes["mode"] == "global"
    # The policy's placement is EPLB's phy2log read back.
    weight = loads.sum(axis=1)
    phy2log, _, _ = rebalance_experts(weight, 288, 1, 1, 32)
    back = placement_from_eplb(phy2log, 32)
    assert np.array_equal(back.copies, glob.placement.copies)


def test_policy_refuses_too_few_slots() -> None:
    ctx = PlanContext.create(get_cluster("dgx-h100:4"), MODELS["zipf-256"], slots_per_device=9)
    ctx.slots_per_device = 7  # 224 slots for 256 experts
    with pytest.raises(PlanError, match="slot per expert"):
        make_plan("eplb", _zipf_loads(1), None, ctx)


def test_export_import_roundtrip() -> None:
    plan = make_plan("eplb", _zipf_loads(), None, _ctx())
    for placement in (
        plan.placement,
        Placement(  # a hand-made one with an empty slot
            np.array([[1, 0, 1]]), np.array([[[1, 1, 0], [1, 0, 1]]]), 3
        ),
    ):
        phy2log, log2phy, logcnt = placement_to_eplb(placement)
        L, D, _ = placement.copies.shape
        assert phy2log.shape == (L, D * placement.slots_per_device)
        _check_consistent(phy2log, log2phy, logcnt)
        assert np.array_equal(placement.home, log2phy[:, :, 0] // placement.slots_per_device)
        back = placement_from_eplb(phy2log, D, log2phy=log2phy)
        assert np.array_equal(back.copies, placement.copies)
        assert np.array_equal(back.home, placement.home)
        assert back.slots_per_device == placement.slots_per_device


def test_export_order_and_empty_slots() -> None:
    # Device 0: home of expert 1, replica of 0; device 1: home of 0 and 2, one free slot.
    placement = Placement(np.array([[1, 0, 1]]), np.array([[[1, 1, 0], [1, 0, 1]]]), 3)
    phy2log, log2phy, logcnt = placement_to_eplb(placement)
    assert phy2log.tolist() == [[1, 0, -1, 0, 2, -1]]
    assert log2phy.tolist() == [[[3, 1], [0, -1], [4, -1]]]
    assert logcnt.tolist() == [[2, 1, 1]]
    # Without log2phy the lowest slot decides the home: expert 0 now homes on device 0.
    assert placement_from_eplb(phy2log, 2).home.tolist() == [[0, 0, 1]]
    with pytest.raises(PlanError, match="no physical slot"):
        placement_from_eplb(np.array([[0, -1, 2, -1]]), 2)


def _plain_packing(w: list[float], packs: int) -> tuple[list[int], list[int]]:
    """`balanced_packing` for one row, item by item: heaviest first (lower index on ties) into
    the lightest non-full pack (lower index on ties); item i into pack i if one fits a pack."""
    per_pack = len(w) // packs
    if per_pack == 1:
        return list(range(packs)), [0] * packs
    load, count = [0.0] * packs, [0] * packs
    pack, rank = [0] * len(w), [0] * len(w)
    for i in sorted(range(len(w)), key=lambda i: -w[i]):
        p = min((load[q], q) for q in range(packs) if count[q] < per_pack)[1]
        pack[i], rank[i] = p, count[p]
        load[p] += w[i]
        count[p] += 1
    return pack, rank


def _plain_rebalance(w: np.ndarray, R: int, G: int, N: int, P: int) -> tuple[list, list, list]:
    """EPLB's hierarchical algorithm for one layer, written out with plain loops."""
    E = len(w)
    group_size, per_node_log, per_node_phy, per_gpu = E // G, E // N, R // N, R // P
    groups = [float(w[g * group_size : (g + 1) * group_size].sum()) for g in range(G)]
    g_pack, g_rank = _plain_packing(groups, N)
    mlog2log = [0] * E
    for g in range(G):
        for i in range(group_size):
            mlog2log[(g_pack[g] * (G // N) + g_rank[g]) * group_size + i] = g * group_size + i
    phy2log, phyrank = [0] * R, [0] * R
    for node in range(N):
        mw = [float(w[mlog2log[node * per_node_log + j]]) for j in range(per_node_log)]
        cnt = [1] * per_node_log
        phy, rank = list(range(per_node_log)), [0] * per_node_log
        for _ in range(per_node_phy - per_node_log):  # largest load per copy, lowest index
            e = max(range(per_node_log), key=lambda e: (mw[e] / cnt[e], -e))
            phy.append(e)
            rank.append(cnt[e])
            cnt[e] += 1
        pack, slot_rank = _plain_packing([mw[e] / cnt[e] for e in phy], P // N)
        for k in range(per_node_phy):
            slot = node * per_node_phy + pack[k] * per_gpu + slot_rank[k]
            phy2log[slot] = mlog2log[node * per_node_log + phy[k]]
            phyrank[slot] = rank[k]
    logcnt = np.bincount(phy2log, minlength=E).tolist()
    return phy2log, phyrank, logcnt


@pytest.mark.parametrize(
    ("E", "R", "G", "N", "P"),
    [
        (12, 16, 4, 2, 8),  # the README's shape: two groups per node
        (16, 24, 4, 4, 8),  # one group per node
        (16, 16, 2, 2, 16),  # one replica per GPU
        (20, 40, 1, 1, 4),  # global mode
        (32, 64, 8, 2, 32),  # 16 GPUs per node: the rounds of `lpt`
        (64, 96, 1, 1, 32),
    ],
)
def test_rebalance_equals_plain_loops(E: int, R: int, G: int, N: int, P: int) -> None:
    rng = np.random.default_rng(E + R + G)
    for trial in range(6):
        if trial % 3 == 0:
            weight = rng.integers(0, 4, (3, E)).astype(float)  # many ties, some zeros
        elif trial % 3 == 1:
            weight = rng.zipf(1.3, (3, E)).astype(float)
        else:
            weight = np.round(rng.random((3, E)) * 4096) / 8  # exact sums in any order
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, R, G, N, P)
        for layer in range(3):
            want = _plain_rebalance(weight[layer], R, G, N, P)
            assert phy2log[layer].tolist() == want[0]
            assert phyrank[layer].tolist() == want[1]
            assert logcnt[layer].tolist() == want[2]


@pytest.mark.parametrize("mode", ["global", "hierarchical"])
def test_policy_placement_is_eplb_output_read_back(mode: str) -> None:
    loads = _zipf_loads()
    plan = make_plan("eplb", loads, None, _ctx(mode=mode))
    groups, nodes = (4, 4) if mode == "hierarchical" else (1, 1)
    phy2log, log2phy, _ = rebalance_experts(loads.sum(axis=1), 288, groups, nodes, 32, mode=mode)
    back = placement_from_eplb(phy2log, 32, log2phy=log2phy)
    assert np.array_equal(back.copies, plan.placement.copies)
    assert np.array_equal(back.home, plan.placement.home)
