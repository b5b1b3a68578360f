"""Per-step token splitting (`poise.core.token_split`, `Assignment.by_counts`): hand cases,
never worse than the plan's fixed split, integer routes with exact margins, the same on every
call, and the cost model's price of a splitting plan equal to pricing each step's explicit
assignment."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.placement import Assignment, Placement
from poise.core.token_split import fill_row, split_routes, split_totals, water_fill
from poise.cost.model import CostModel
from poise.cost.traffic import Routing
from poise.plan.policies.base import PlanContext
from poise.plan.policies.registry import make_plan
from poise.sim.simulator import simulate

from .helpers import toy_cluster, toy_spec


def _two_holders() -> tuple[Placement, np.ndarray]:
    """One layer, 3 devices, 3 experts: expert 0 homed on device 0 with a replica on device 1,
    expert 1 on device 0, expert 2 on device 1; device 2 holds no expert."""
    home = np.array([[0, 0, 1]])
    placement = Placement.from_homes(home, 3, 2)
    placement.copies[0, 1, 0] = 1  # replica of expert 0 on device 1
    return placement, home


def test_water_fill_by_hand() -> None:
    # Holders with 100 and 10 tokens of other work; 50 tokens to split: all to the lighter
    # (10 + 50 = 60 < 100).
    np.testing.assert_array_equal(
        water_fill(np.array([[100.0, 10.0]]), np.array([50.0]), True), [[0, 50]]
    )
    # 100 tokens: level 105 = 100 + 5 = 10 + 95.
    np.testing.assert_array_equal(
        water_fill(np.array([[100.0, 10.0]]), np.array([100.0]), True), [[5, 95]]
    )
    # 101 tokens: level 105.5; floors 5 and 95, the last token to the least loaded (105 each:
    # the lower device).
    np.testing.assert_array_equal(
        water_fill(np.array([[100.0, 10.0]]), np.array([101.0]), True), [[6, 95]]
    )
    np.testing.assert_allclose(
        water_fill(np.array([[100.0, 10.0]]), np.array([101.0]), False), [[5.5, 95.5]]
    )
    # Padding (inf) gets nothing; three holders 0, 3, 9 and 9 tokens: level 6 -> 6, 3, 0.
    got = water_fill(np.array([[0.0, 3.0, 9.0, np.inf]]), np.array([9.0]), True)
    np.testing.assert_array_equal(got, [[6, 3, 0, 0]])


def test_split_routes_by_hand() -> None:
    """Expert 0 on devices 0 and 1; device 2 sends it 50 tokens. Device 0 also computes 100
    tokens of expert 1, device 1 10 of expert 2: the plan's even split (25 / 25) gives way to
    the water-fill."""
    placement, _ = _two_holders()
    counts = np.zeros((1, 3, 3), dtype=np.int64)
    counts[0, 0, 1] = 100  # device 0's other work: 100 tokens of expert 1 (its own)
    counts[0, 1, 2] = 10  # device 1's: 10 tokens of expert 2 (its own)
    counts[0, 2, 0] = 50  # device 2 holds no copy of expert 0: 50 tokens to split
    fixed = Assignment.even(placement)
    routes = fixed.with_split().split(placement, counts)
    assert routes[0, 2, 0].tolist() == [0, 50, 0]  # 100 vs 10 + 50: all to device 1
    assert fixed.split(placement, counts)[0, 2, 0].tolist() == [25, 25, 0]
    counts[0, 2, 0] = 101  # level 105.5 -> 5 and 95, one more to device 0 (lower on a tie)
    routes = fixed.with_split().split(placement, counts)
    assert routes[0, 2, 0].tolist() == [6, 95, 0]
    np.testing.assert_allclose(
        fixed.with_split().resolve(placement, counts).weights[0, 0], [5.5 / 101, 95.5 / 101, 0]
    )


def test_routes_cut_sources_in_proportion() -> None:
    """Two sources (devices 2, 3) share 30 and 10 tokens; holders get 20 and 20: each source's
    tokens go half and half, the margins exactly."""
    placement = Placement.from_homes(np.array([[0, 1, 2, 3]]), 4, 2)
    placement.copies[0, 1, 0] = 1
    counts = np.zeros((1, 4, 4), dtype=np.int64)
    counts[0, 2, 0], counts[0, 3, 0] = 30, 10
    plan_routes = Assignment.to_home(placement).split(placement, counts)
    routes = split_routes(placement.copies, plan_routes, counts)
    assert routes[0, 2, 0].tolist() == [15, 15, 0, 0]
    assert routes[0, 3, 0].tolist() == [5, 5, 0, 0]


def _random_plan(rng: np.random.Generator, L: int, D: int, E: int) -> Placement:
    home = np.tile((np.arange(E) * D) // E, (L, 1))
    placement = Placement.from_homes(home, D, E // D + 2)
    for layer in range(L):
        for _ in range(int(rng.integers(0, 2 * D))):
            d, e = int(rng.integers(D)), int(rng.integers(E))
            if placement.copies[layer, d].sum() < placement.slots_per_device:
                placement.copies[layer, d, e] = 1
    return placement


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    D=st.sampled_from([2, 3, 4, 8]),
    kind=st.sampled_from(["even", "to_home", "balanced"]),
)
def test_never_worse_than_the_fixed_split(seed: int, D: int, kind: str) -> None:
    """Max device load with splitting <= with the plan's fixed shares (the forecast split), in
    whole tokens (the runtime's routes) and in real numbers (the cost model's); routes
    conserve every source's tokens and send only to holders."""
    rng = np.random.default_rng(seed)
    L, E = 2, 8
    placement = _random_plan(rng, L, D, E)
    scale = rng.integers(1, 200, size=(1, 1, E))  # skewed experts
    counts = rng.integers(0, 50, size=(L, D, E)) * scale
    forecast = rng.integers(0, 50, size=(L, D, E)).astype(np.float64)
    fixed = {
        "even": Assignment.even(placement),
        "to_home": Assignment.to_home(placement),
        "balanced": Assignment.balanced(placement, forecast),
    }[kind]
    split = fixed.with_split()
    r_fixed, r_split = fixed.split(placement, counts), split.split(placement, counts)
    assert (r_split.sum(axis=3) == counts).all()
    assert r_split.min() >= 0
    assert not (r_split.sum(axis=1).transpose(0, 2, 1) * (placement.copies == 0)).any()
    assert (r_split.sum(axis=(1, 2)).max(axis=1) <= r_fixed.sum(axis=(1, 2)).max(axis=1)).all()
    f_fixed = fixed.received(placement, counts).sum(axis=2).max(axis=1)
    f_split = split.received(placement, counts).sum(axis=2).max(axis=1)
    assert (f_split <= f_fixed * (1 + 1e-12) + 1e-9).all()
    # deterministic: the same routes from a fresh call
    np.testing.assert_array_equal(split.split(placement, counts.copy()), r_split)


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.integers(0, 5_000), min_size=1, max_size=8),
    total=st.integers(0, 20_000),
    halves=st.booleans(),
    integer=st.booleans(),
)
def test_the_one_row_water_fill_is_numpys_to_the_last_bit(
    base: list[int], total: int, halves: bool, integer: bool
) -> None:
    """`fill_row` (Python floats, the runtime's one-layer path) against `water_fill` (NumPy,
    the cost model's many layers) on the same row, bit for bit: ties, empty totals and
    fractional loads (the real split's) included."""
    row = [b / 2 if halves else float(b) for b in base]
    want = water_fill(np.array([row]), np.array([float(total)]), integer)[0]
    got = np.array(fill_row(row, float(total), integer))
    assert got.tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), D=st.sampled_from([2, 3, 4, 8]), integer=st.booleans())
def test_one_layer_splits_as_it_does_among_many(seed: int, D: int, integer: bool) -> None:
    """`split_totals` on each layer alone (its one-layer path, expert by expert in Python)
    equals its result for that layer among all of them (the NumPy path over layers), bit for
    bit."""
    rng = np.random.default_rng(seed)
    L, E = 3, 8
    placement = _random_plan(rng, L, D, E)
    counts = rng.integers(0, 50, size=(L, D, E)) * rng.integers(1, 200, size=(1, 1, E))
    held = placement.copies > 0
    start = np.where(held, rng.integers(0, 40, size=(L, D, E)), 0).astype(np.float64)
    if not integer:
        counts = counts + rng.random((L, D, E))
    x_all, shed_all = split_totals(placement.copies, counts, start, integer=integer)
    for layer in range(L):
        one = slice(layer, layer + 1)
        x, shed = split_totals(placement.copies[one], counts[one], start[one], integer=integer)
        assert x.tobytes() == x_all[one].tobytes() and shed.tobytes() == shed_all[one].tobytes()


def test_price_with_splitting_is_the_price_of_each_steps_assignment() -> None:
    rng = np.random.default_rng(3)
    cluster = toy_cluster(devices_per_node=2, nodes=2)
    ctx = PlanContext.create(cluster, _spec(), slots_per_device=4)
    L, D, E = ctx.spec.moe_layers, 4, ctx.spec.experts
    placement = _random_plan(rng, L, D, E)
    split = Assignment.even(placement).with_split()
    cost = CostModel(cluster, ctx.spec)
    pricer = cost.pricer(placement, split)
    for _ in range(3):
        counts = rng.integers(0, 300, size=(L, D, E)).astype(np.float64)
        got = pricer.price(counts)
        want = cost.price(placement, split.resolve(placement, counts), counts)
        np.testing.assert_array_equal(got.layer_s, want.layer_s)
        np.testing.assert_array_equal(got.device_load, want.device_load)
        fixed = cost.price(placement, split.with_split(False), counts)
        assert got.device_load.max(axis=1).tolist() <= fixed.device_load.max(axis=1).tolist()


def _spec():
    return toy_spec(experts=8, layers=2)


def test_plans_split_under_the_context_setting_and_simulate_models_it() -> None:
    rng = np.random.default_rng(5)
    cluster = toy_cluster(devices_per_node=2, nodes=2)
    spec = _spec()
    loads = rng.integers(0, 100, size=(spec.moe_layers, 4, spec.experts)).astype(np.float64)
    loads[:, :, 0] *= 20
    on = PlanContext.create(cluster, spec, slots_per_device=4, split_tokens=True)
    off = PlanContext.create(cluster, spec, slots_per_device=4)
    for policy in ("eplb", "shadow", "auto"):
        a, b = make_plan(policy, loads, None, on), make_plan(policy, loads, None, off)
        assert a.assignment.by_counts and not b.assignment.by_counts
    trace = rng.integers(0, 100, size=(6, spec.moe_layers, 4, spec.experts))
    trace[:, :, :, 0] *= 20
    runs = {
        flag: simulate(trace, cluster, spec, ["eplb"], replan_every=2, split_tokens=flag)
        for flag in (False, True)
    }
    assert runs[True].runs["eplb"].last_plan.assignment.by_counts
    assert (
        runs[True].runs["eplb"].device_load.max(axis=1).mean()
        <= runs[False].runs["eplb"].device_load.max(axis=1).mean()
    )


def test_holders_shed_their_own_tokens_by_hand() -> None:
    """Expert 0 on both devices (home 0, replica 1): no remote tokens. Device 0 routes 600 of
    its own tokens to it, device 1 100, and device 1 also computes 200 of expert 1. Keeping
    their own gives 600 / 300; the level is (700 + 200) / 2 = 450: device 0 keeps 450 and sheds
    150 to device 1 (100 + 150 + 200 = 450)."""
    placement = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    placement.copies[0, 1, 0] = 1
    counts = np.array([[[600, 0], [100, 200]]])
    split = Assignment.to_home(placement).with_split()
    routes = split.split(placement, counts)
    assert routes[0, 0, 0].tolist() == [450, 150]
    assert routes[0, 1, 0].tolist() == [0, 100]
    assert routes[0, 1, 1].tolist() == [0, 200]
    resolved = split.resolve(placement, counts)
    resolved.validate(placement)
    np.testing.assert_allclose(resolved.shed[0, :, 0], [150 / 600, 0.0])
    np.testing.assert_allclose(resolved.weights[0, 0], [0.0, 1.0])  # the shed go to device 1
    np.testing.assert_allclose(resolved.received(placement, counts)[0], [[450, 0], [250, 200]])
    # already level: nobody sheds (400 / 300 + 100 on both sides)
    counts = np.array([[[400, 0], [100, 300]]])
    assert split.split(placement, counts)[0, :, 0].tolist() == [[400, 0], [0, 100]]
    assert split.resolve(placement, counts).shed is None


def _least_max_by_enumeration(base: np.ndarray, total: int) -> int:
    """The least max of `base[h] + y[h]` over every integer split `y` of `total` (a naive
    reference for 2 or 3 holders)."""
    best = None
    for y0 in range(total + 1):
        left = total - y0
        splits = [(left,)] if len(base) == 2 else [(y1, left - y1) for y1 in range(left + 1)]
        for rest in splits:
            y = (y0, *rest)
            m = int(max(b + v for b, v in zip(base, y, strict=True)))
            best = m if best is None else min(best, m)
    assert best is not None
    return best


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    D=st.sampled_from([2, 3, 4]),
    holders=st.sampled_from([2, 3]),
)
def test_one_replicated_expert_reaches_the_least_max_of_any_split(
    seed: int, D: int, holders: int
) -> None:
    """One replicated expert (the others homed, one each): the split's max device load is the
    least any division of that expert's tokens among its holders can give (enumerated), in
    whole tokens, and the real split's is at most that; routes conserve every count."""
    holders = min(holders, D)
    rng = np.random.default_rng(seed)
    E = D
    placement = Placement.from_homes(np.arange(E)[None, :], D, 2)
    hold = rng.choice(D, size=holders, replace=False)
    placement.copies[0, hold, 0] = 1
    placement.home[0, 0] = int(hold[0])
    placement.copies[0, 0, 0] = 1 if 0 in hold else 0
    counts = rng.integers(0, 40, size=(1, D, E))
    counts[0, :, 0] = rng.integers(0, 60, size=D)
    split = Assignment.to_home(placement).with_split()
    routes = split.split(placement, counts)
    assert (routes.sum(axis=3) == counts).all() and routes.min() >= 0
    load = routes.sum(axis=(1, 2))[0]  # [D]
    others = counts[0, :, 1:].sum(axis=0)  # expert e >= 1 is computed by device e (its home)
    base = np.zeros(D, dtype=np.int64)
    base[1:] = others
    want = max(_least_max_by_enumeration(base[hold], int(counts[0, :, 0].sum())),
               int(np.delete(base, hold).max(initial=0)))  # fmt: skip
    assert int(load.max()) == want
    real = split.received(placement, counts).sum(axis=2)[0]
    assert real.max() <= want + 1e-9


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), D=st.sampled_from([2, 3, 4]))
def test_cost_model_loads_and_traffic_follow_the_routes(seed: int, D: int) -> None:
    """The cost model's per-device loads and dispatch traffic of a splitting plan (real shares,
    shedding included) match the runtime's integer routes, counted directly: tokens each device
    computes (`routes` summed over sources) and sends to other devices (off the diagonal), to
    within the rounding of whole tokens."""
    rng = np.random.default_rng(seed)
    spec = toy_spec(experts=4, layers=2)
    placement = _random_plan(rng, 2, D, 4)
    counts = rng.integers(0, 60, size=(2, D, 4))
    counts[:, :, 0] *= 10  # a hot expert, which sources holding it may have to shed
    split = Assignment.even(placement).with_split()
    routes = split.split(placement, counts)  # [L, D_src, E, D_dst]
    computed = routes.sum(axis=(1, 2))  # [L, D]
    off = routes * (1 - np.eye(D, dtype=np.int64))[None, :, None, :]
    sent, got = off.sum(axis=(2, 3)), off.sum(axis=(1, 2))  # [L, D] each
    cluster = toy_cluster(devices_per_node=D)
    priced = CostModel(cluster, spec).price(placement, split, counts)
    slack = 2 * D  # whole-token rounding per (layer, expert, holder)
    assert np.abs(priced.device_load - computed).max() <= slack
    send, recv = Routing(cluster, placement, split.resolve(placement, counts)).traffic(counts)
    assert np.abs(send.sum(axis=0) - sent).max() <= slack * 4
    assert np.abs(recv.sum(axis=0) - got).max() <= slack * 4
