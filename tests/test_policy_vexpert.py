"""FlexMoE's vExpert policy: trigger, expand on skew, slot bounds, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment
from poise.core.presets import get_cluster
from poise.core.spec import MODELS, ModelSpec
from poise.plan.policies import PlanContext, make_plan

from .helpers import assert_priced_as_the_cost_model, slow_gemm_cluster

SPEC = ModelSpec("four", d_model=64, d_expert=128, experts=4, top_k=1, moe_layers=1)


def _ctx(slots: int = 3, cluster=None, **options: object) -> PlanContext:
    """vExpert's context on `cluster` (default the `cpu-2` preset)."""
    return PlanContext.create(
        cluster or get_cluster("cpu-2"), SPEC, slots_per_device=slots, options={"vexpert": options}
    )


def test_no_action_below_threshold() -> None:
    loads = np.full((1, 2, 4), 100.0)
    plan = make_plan("vexpert", loads, None, _ctx())
    assert plan.placement.home.tolist() == [[0, 0, 1, 1]]
    assert plan.placement.replicas().sum() == 0
    assert plan.notes["moves_per_layer"] == [0]
    # Heavy skew (device loads 2020 vs 40, ratio 1.96) acts by default, not under threshold 2.
    loads[0, :, :] = 10.0
    loads[0, :, 0] = 1000.0
    assert make_plan("vexpert", loads, None, _ctx()).notes["moves_per_layer"] != [0]
    held = make_plan("vexpert", loads, None, _ctx(threshold=2.0))
    assert held.notes["moves_per_layer"] == [0]
    assert held.placement.replicas().sum() == 0


def test_skew_replicates_hot_expert_and_step_time_falls() -> None:
    # Expert 0 (home device 0) gets 1000 tokens from each device, the others 10.
    loads = np.full((1, 2, 4), 10.0)
    loads[0, :, 0] = 1000.0
    ctx = _ctx()
    static = make_plan("static", loads, None, ctx)
    plan = make_plan("vexpert", loads, None, ctx)
    assert plan.placement.copies[0, :, 0].tolist() == [1, 1]  # a replica on device 1
    assert plan.placement.home[0].tolist() == [0, 0, 1, 1]  # homes unchanged
    assert plan.notes["moves"]["expand"] >= 1
    assert plan.cost.step_s < static.cost.step_s
    assert plan.cost.max_over_mean < static.cost.max_over_mean
    # Device 1 keeps its own 1000 tokens of expert 0 instead of sending them: 1020 vs 1040.
    assert plan.cost.device_load[0].tolist() == [1020.0, 1040.0]


def test_full_slots_use_replace_and_slots_hold() -> None:
    # One slot of spare capacity in all: 8 experts, 2 devices, 5 slots each -> 2 free.
    spec = ModelSpec("eight", d_model=64, d_expert=128, experts=8, top_k=1, moe_layers=2)
    ctx = PlanContext.create(
        get_cluster("cpu-2"), spec, slots_per_device=5, options={"vexpert": {}}
    )
    loads = np.full((2, 2, 8), 10.0)
    loads[0, :, 0] = 1000.0
    loads[0, :, 1] = 800.0
    loads[1, :, 5] = 900.0
    first = make_plan("vexpert", loads, None, ctx)
    assert np.all(first.placement.slots_used() <= 5)
    # Load shifts to expert 6: the placement now has to free slots held by cold replicas.
    shifted = np.full((2, 2, 8), 10.0)
    shifted[:, :, 6] = 1000.0
    shifted[:, :, 7] = 900.0
    second = make_plan("vexpert", shifted, first, ctx)
    assert np.all(second.placement.slots_used() <= 5)
    assert second.notes["moves"]["replace"] >= 1  # every slot was full: shrink + expand
    # Never worse than staying put (moves priced with their migrations), better on the whole.
    stay = ctx.cost.price(first.placement, Assignment.balanced(first.placement, shifted), shifted)
    assert np.all(second.cost.layer_s <= stay.layer_s + 1e-15)
    assert second.cost.step_s < stay.step_s


def test_deterministic_and_valid_on_zipf() -> None:
    rng = np.random.default_rng(7)
    cluster = get_cluster("dgx-h100:4")
    spec = MODELS["zipf-256"].with_(moe_layers=2)
    p = 1.0 / np.arange(1, 257) ** 0.8
    loads = np.stack(
        [rng.multinomial(8192 * 8, rng.permutation(p / p.sum()), size=32) for _ in range(2)]
    ).astype(np.float64)
    ctx = PlanContext.create(cluster, spec, slots_per_device=9)
    a = make_plan("vexpert", loads, None, ctx)
    b = make_plan("vexpert", loads, None, ctx)
    assert np.array_equal(a.placement.copies, b.placement.copies)
    assert np.array_equal(a.placement.home, b.placement.home)
    assert np.all(a.placement.slots_used() <= 9)
    static = make_plan("static", loads, None, ctx)
    assert a.cost.step_s < static.cost.step_s
    capped = make_plan(
        "vexpert",
        loads,
        None,
        PlanContext.create(
            cluster, spec, slots_per_device=9, options={"vexpert": {"max_moves": 1}}
        ),
    )
    assert max(capped.notes["moves_per_layer"]) <= 1


def test_layers_in_lockstep_match_layers_alone() -> None:
    """The search runs every layer's loop in one batch; each layer must end where it would
    alone, including with a previous plan in force (migrations priced) and layers that never
    trigger."""
    rng = np.random.default_rng(11)
    cluster = get_cluster("dgx-h100:4")
    spec = MODELS["zipf-256"].with_(experts=64, moe_layers=4)
    p = 1.0 / np.arange(1, 65) ** 1.1
    loads = np.stack(
        [rng.multinomial(4096, rng.permutation(p / p.sum()), size=32) for _ in range(4)]
    ).astype(np.float64)
    loads[2] = 128.0  # uniform: below the trigger
    ctx = PlanContext.create(cluster, spec, slots_per_device=3)
    first = make_plan("vexpert", loads[::-1].copy(), None, ctx)
    together = make_plan("vexpert", loads, first, ctx)
    one = spec.with_(moe_layers=1)
    ctx_one = PlanContext.create(cluster, one, slots_per_device=3)
    for layer in range(4):
        prev_one = make_plan("vexpert", loads[::-1][layer : layer + 1].copy(), None, ctx_one)
        alone = make_plan("vexpert", loads[layer : layer + 1], prev_one, ctx_one)
        assert np.array_equal(alone.placement.copies[0], together.placement.copies[layer])
        assert np.array_equal(alone.placement.home[0], together.placement.home[layer])
        assert alone.notes["moves_per_layer"][0] == together.notes["moves_per_layer"][layer]
    assert first.notes["moves_per_layer"][1] == 0  # loads[2], uniform, from the static placement
    assert sum(together.notes["moves_per_layer"]) > 0


def test_flexmoe_properties_on_a_replan() -> None:
    """What FlexMoE's loop guarantees, on a first plan (from the static placement) and a re-plan
    from it on other loads (replace, shrink and migrate priced with their migrations; pipelined
    schedule; fractional counts in one layer, uniform ones in another):

    - the trigger: a layer whose balance ratio under the placement it starts from is at most
      the threshold is left alone (no move, the same copies);
    - the cost model guides every move, each strictly lowering the predicted layer time: no layer
      ends above staying where it started, and a layer that moved ends strictly below; so the
      first plan is never priced above static's;
    - a hot expert is what the loop expands: each skewed layer's hottest expert gets copies;
    - the vExperts fit the slots, every expert keeps a copy on its home, and the tokens are
      conserved (every expert computes all it is sent);
    - at most `max_moves` (4 E) moves per layer, and the move counts add up."""
    from poise.cost.model import CostModel
    from poise.cost.schedule import Schedule

    rng = np.random.default_rng(7)
    cluster = get_cluster("dgx-h100:4")
    spec = MODELS["zipf-256"].with_(experts=64, moe_layers=4)
    p = 1.0 / np.arange(1, 65) ** 1.1
    loads = np.stack(
        [rng.multinomial(4096 * 3, rng.permutation(p / p.sum()), size=32) for _ in range(4)]
    ).astype(np.float64)
    loads[1] = 128.0
    loads[3] *= 0.37
    cost = CostModel(cluster, spec, Schedule("pipelined", 4))
    ctx = PlanContext.create(cluster, spec, slots_per_device=4, cost=cost)
    first_loads = loads[::-1].copy()
    static = make_plan("static", first_loads, None, ctx)
    first = make_plan("vexpert", first_loads, None, ctx)
    plan = make_plan("vexpert", loads, first, ctx)
    idle = 0
    for start, on, made in ((static.placement, first_loads, first), (first.placement, loads, plan)):
        placement = made.placement
        stay = ctx.cost.price(start, Assignment.balanced(start, on), on)
        dev = Assignment.balanced(start, on).received(start, on).sum(axis=2)
        ratio = dev.max(axis=1) / dev.mean(axis=1)
        moves = np.array(made.notes["moves_per_layer"])
        for layer in range(4):
            if ratio[layer] <= 1.1:
                idle += 1
                assert moves[layer] == 0
                assert np.array_equal(placement.copies[layer], start.copies[layer])
            if moves[layer]:
                assert made.cost.layer_s[layer] < stay.layer_s[layer] * (1 - 1e-12)
            else:
                assert made.cost.layer_s[layer] == pytest.approx(stay.layer_s[layer], rel=1e-9)
        assert np.all(moves <= 4 * 64)
        assert sum(made.notes["moves"].values()) == moves.sum()
        assert np.all(placement.slots_used() <= 4)
        held = np.take_along_axis(placement.copies, placement.home[:, None, :], axis=1)
        assert np.all(held >= 1)  # [L, 1, E]: each home holds its expert
        computed = made.assignment.received(placement, on).sum(axis=1)
        np.testing.assert_allclose(computed, on.sum(axis=1), rtol=1e-9)
    assert idle >= 1  # the uniform layer of the first plan: the trigger was checked
    assert np.all(first.cost.layer_s <= static.cost.layer_s * (1 + 1e-12))
    assert first.cost.step_s < static.cost.step_s
    for layer in (0, 1, 3):  # the skewed layers of the first plan
        hottest = first_loads[layer].sum(axis=0).argmax()
        assert first.placement.copies[layer, :, hottest].sum() >= 2
    assert first.placement.copies[2].sum() == 64  # the uniform one: homes only
    # The loop stops where no move helps: re-planned on the same loads from its own plan (no
    # migration was priced from the static start; now one would be), nothing moves.
    again = make_plan("vexpert", first_loads, first, ctx)
    assert again.notes["moves_per_layer"] == [0, 0, 0, 0]
    assert np.array_equal(again.placement.copies, first.placement.copies)


def test_the_trigger_alone_holds_back_a_helpful_move() -> None:
    """Below the threshold nothing is searched, even where a move would pay: device loads 1080
    and 920 (balance ratio 1.08 <= 1.1), expert 0 (home device 0) the hottest, 80 of its tokens
    from device 1. With threshold 1.0 the cost model expands it onto device 1, which keeps those
    80 (loads 1000 and 1000: the compute moved off the busiest device is worth more than one
    small expert's Trans and Agg, on a test cluster of slow GEMMs and fast links,
    `helpers.slow_gemm_cluster`: 80 tokens' 3 x 32,768 FLOP at 5e10 FLOP/s, about 157 us,
    against 2 x (32 KiB / 4 GB/s + 30 us), about 76 us; on the calibrated `cpu-2` the Trans and
    Agg, about 2 x (32 KiB / 1.68 GB/s + 145 us) = 329 us, cost more than the 38 us saved); at
    the default 1.1 the loop never starts."""
    # Device 0 computes experts 0, 1: 600 + 480 = 1080; device 1 experts 2, 3: 920.
    loads = np.array([[[520.0, 240.0, 230.0, 230.0], [80.0, 240.0, 230.0, 230.0]]])
    cluster = slow_gemm_cluster(2, one_link=False)
    held = make_plan("vexpert", loads, None, _ctx(cluster=cluster))
    assert held.notes["moves_per_layer"] == [0]
    assert held.placement.replicas().sum() == 0
    eager = make_plan("vexpert", loads, None, _ctx(cluster=cluster, threshold=1.0))
    assert eager.placement.copies[0, :, 0].tolist() == [1, 1]
    assert eager.cost.device_load[0].tolist() == [1000.0, 1000.0]
    assert eager.cost.step_s < held.cost.step_s


@pytest.mark.parametrize(("slots", "moves"), [(4, ("shrink", "replace")), (3, ("replace",))])
def test_a_replica_that_computes_nothing_is_shrunk(slots: int, moves: tuple[str, ...]) -> None:
    """A copy whose expert gets no tokens any more saves no compute and no all-to-all but still
    costs its Trans and Agg every step, so dropping it lowers the predicted time and the loop
    cannot stop with it in place (FlexMoE's Shrink; or Expand into the slot Shrink frees, when
    every slot is full). 4 experts on 2 devices of 3 or 4 slots, homes [0, 0, 1, 1]; expert 0,
    once hot, was copied onto device 1; now expert 0 gets nothing and expert 1 (also homed on
    device 0) is hot, so every replica's Trans leaves device 0 (Trans in opposite directions
    would overlap on the full-duplex links, and dropping one of them would save no time)."""
    ctx = _ctx(slots)
    before = np.full((1, 2, 4), 10.0)
    before[0, :, 0] = 1000.0
    first = make_plan("vexpert", before, None, ctx)
    assert first.placement.copies[0, :, 0].tolist() == [1, 1]
    now = np.full((1, 2, 4), 10.0)
    now[0, :, 0] = 0.0
    now[0, :, 1] = 1000.0
    plan = make_plan("vexpert", now, first, ctx)
    assert plan.placement.copies[0, :, 0].tolist() == [1, 0]  # the idle replica is gone
    assert plan.placement.copies[0, :, 1].tolist() == [1, 1]  # the hot expert gained a copy
    # With a free slot the loop may shrink, or expand into the slot the shrink frees (the
    # better of the two, in one move); with every slot full only the latter exists.
    assert sum(plan.notes["moves"][m] for m in moves) >= 1
    stay = ctx.cost.price(first.placement, Assignment.balanced(first.placement, now), now)
    assert plan.cost.step_s < stay.step_s


def test_route_layers_equals_route_bit_for_bit() -> None:
    # Whole layers routed with only the multi-holder experts water-filled give `_route`'s
    # shares exactly, with few holders per expert (packed water-fill) and with many (full rows).
    from poise.plan.policies.vexpert import _route, _route_layers

    rng = np.random.default_rng(4)
    for extra in (0.05, 0.7):
        loads = rng.random((3, 16, 24)) * 100.0
        copies = (rng.random((3, 16, 24)) < extra).astype(np.int32)
        copies[:, 0] = 1  # every expert held somewhere
        if extra > 0.5:
            copies[1, :, 5] = 2  # an expert with two copies on every device
        counts_t = np.ascontiguousarray(loads.transpose(0, 2, 1))
        got = _route_layers(counts_t, copies.transpose(0, 2, 1))
        assert np.array_equal(got, _route(counts_t, copies.transpose(0, 2, 1)))


def test_search_state_keeps_fresh_sums() -> None:
    # The kept per-expert totals equal `received.sum(axis=1)` bit for bit after column updates;
    # copy counts and free slots equal their recount.
    from poise.plan.policies.vexpert import SearchState

    rng = np.random.default_rng(8)
    N, D, E, slots = 3, 16, 20, 4
    copies = np.zeros((N, D, E), dtype=np.int32)
    copies[:, np.arange(E) % D, np.arange(E)] = 1
    received = np.where(copies > 0, rng.random((N, D, E)) * 1e3, 0.0)
    copies_t = np.ascontiguousarray(copies.transpose(0, 2, 1))
    state = SearchState.start(np.zeros((N, E), dtype=np.int64), copies_t, copies, received, slots)
    for _ in range(30):
        rows = rng.integers(N, size=2)
        experts = rng.choice(E, size=2, replace=False)
        old = copies[rows, :, experts]
        new = old.copy()
        new[:, rng.integers(D)] += 1
        copies[rows, :, experts] = new
        state.set_columns(rows, experts, rng.random((2, D)) * rng.random() * 1e4, new, old)
    assert np.array_equal(state.total, state.received.sum(axis=1))
    assert np.array_equal(state.ncopies, copies.sum(axis=1))
    assert np.array_equal(state.free, slots - copies.sum(axis=2))


def test_the_searched_price_equals_the_cost_model() -> None:
    """`vexpert` hands `finish_plan` the price its search kept (searched layers) plus a fresh
    price of the layers it left alone; it equals `CostModel.price` of the plan with its
    migrations, first from nothing and then re-planned from its own plan on other loads."""
    from poise.cost.model import CostModel
    from poise.cost.schedule import parse_schedule

    cluster = get_cluster("dgx-h100:2")
    spec = ModelSpec("v", 64, 128, experts=24, top_k=2, moe_layers=4, tokens_per_device=512)
    migrations = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        schedule = parse_schedule(["sync", "pipelined(4)", "prophet"][seed % 3])
        ctx = PlanContext.create(
            cluster, spec, slots_per_device=2 + seed % 2, cost=CostModel(cluster, spec, schedule)
        )
        skew = rng.zipf(1.4, size=(4, cluster.num_devices, 24)).astype(float)
        loads = np.floor(100 * skew)
        loads[1] = 50.0  # a balanced layer: below the trigger, not searched
        other = np.floor(100 * rng.zipf(1.4, size=loads.shape).astype(float))
        first = make_plan("vexpert", loads, None, ctx)
        again = make_plan("vexpert", other, first, ctx)
        migrations += len(again.transfers.migrations)
        assert first.notes["moves_per_layer"][1] == 0
        for plan, on in ((first, loads), (again, other)):
            assert_priced_as_the_cost_model(plan, ctx.cost, on, device_load_rtol=1e-9)
    assert migrations > 0  # the re-plans moved homes, so the migration term was checked


def test_the_plan_routes_as_balanced_up_to_the_last_bit() -> None:
    """The plan keeps the shares its search priced; they are `Assignment.balanced` of the final
    placement (up to float rounding), on searched and unsearched layers alike."""
    cluster = get_cluster("dgx-h100:2")
    spec = ModelSpec("v", 64, 128, experts=24, top_k=2, moe_layers=3, tokens_per_device=512)
    ctx = PlanContext.create(cluster, spec, slots_per_device=3)
    rng = np.random.default_rng(7)
    loads = np.floor(100 * rng.zipf(1.4, size=(3, cluster.num_devices, 24)).astype(float))
    loads[2] = 40.0  # balanced: not searched
    plan = make_plan("vexpert", loads, None, ctx)
    assert plan.placement.replicas().sum() > 0
    assert plan.notes["moves_per_layer"][2] == 0
    balanced = Assignment.balanced(plan.placement, loads)
    np.testing.assert_allclose(plan.assignment.weights, balanced.weights, rtol=1e-12, atol=1e-15)
