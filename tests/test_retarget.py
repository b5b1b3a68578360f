"""Replica retargeting (`poise.plan.retarget`): the greedy by hand, its invariants on random
layers, and the plan it makes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.cost.per_step import device_compute, live_parts
from poise.plan.retarget import replica_picks, retargeted


def layer_replicas(counts: np.ndarray, home: np.ndarray, slots: int, k: int) -> list:
    """`[(expert, device)]`: `replica_picks` on one layer's `counts[D, E]` and `home[E]`."""
    return [(e, d) for _, e, d in replica_picks(counts[None], home[None], slots, k)]


def _spec(E: int) -> ModelSpec:
    return ModelSpec(
        "toy", d_model=8, d_expert=16, experts=E, top_k=1, moe_layers=2, tokens_per_device=64
    )


def test_the_hot_expert_of_the_heavy_rank_gets_the_replica_by_hand() -> None:
    # homes: experts 0, 1 on rank 0; 2, 3 on rank 1; 3 slots a rank (one spare)
    counts = np.array([[60, 10, 5, 5], [20, 10, 5, 5]])  # T = 80, 20, 10, 10; loads 100, 20
    home = np.array([0, 0, 1, 1])
    assert layer_replicas(counts, home, slots=3, k=1) == [(0, 1)]
    # the heavy side is rank 1 now: its hottest expert (3) goes to rank 0
    counts = np.array([[1, 1, 5, 40], [1, 1, 5, 30]])
    assert layer_replicas(counts, home, slots=3, k=1) == [(3, 0)]
    # a balanced step keeps no replica; no spare slot, none either
    assert layer_replicas(np.array([[5, 5, 5, 5], [5, 5, 5, 5]]), home, slots=3, k=1) == []
    assert layer_replicas(counts, home, slots=2, k=1) == []


def test_three_ranks_two_replicas_by_hand() -> None:
    # homes: e0, e1 on rank 0; e2, e3 on rank 1; e4, e5 on rank 2; one spare slot a rank
    home = np.array([0, 0, 1, 1, 2, 2])
    counts = np.array([[50, 30, 5, 5, 0, 0], [10, 10, 0, 0, 0, 0], [0, 0, 0, 0, 5, 5]])
    # totals 60, 40, 5, 5, 5, 5: loads 100, 10, 10. First: e0 (60 on rank 0) to rank 1 (the
    # lowest of the tied least-loaded), 45 of it moved (half the gap, less than 60): loads
    # 55, 55, 10. Second: the heaviest is rank 0 (the lowest of the tie), its largest share
    # e1 (40 against e0's 15), to rank 2, the only one left with a free slot: 22.5 moved.
    assert layer_replicas(counts, home, slots=3, k=2) == [(0, 1), (1, 2)]
    assert layer_replicas(counts, home, slots=3, k=1) == [(0, 1)]


def test_a_layer_balanced_last_step_lends_its_replica_to_one_that_was_not() -> None:
    home = np.array([[0, 0, 1, 1, 2, 2]] * 2)
    counts = np.zeros((2, 3, 6), dtype=np.int64)
    counts[0] = 5  # layer 0: every rank computes 10 pairs of each of its two experts' 30
    counts[1] = [[50, 30, 5, 5, 0, 0], [10, 10, 0, 0, 0, 0], [0, 0, 0, 0, 5, 5]]  # as above
    # two replicas in all: both go to layer 1, in the order of the one-layer case
    assert replica_picks(counts, home, slots=3, k=2) == [(1, 0, 1), (1, 1, 2)]
    # with one, layer 1's first (45 pairs moved off rank 0)
    assert replica_picks(counts, home, slots=3, k=1) == [(1, 0, 1)]
    # layer 0 skewed so that its first pick sheds 25 pairs, more than layer 1's second (22.5)
    # and less than its first (45): it takes the second replica
    counts[0] = [[0, 0, 15, 10, 0, 0], [0, 0, 15, 10, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert replica_picks(counts, home, slots=3, k=2) == [(1, 0, 1), (0, 2, 0)]


def _max_after(counts: np.ndarray, home: np.ndarray, reps: list[tuple[int, int]]) -> float:
    """The least maximum device load `counts[D, E]` allows with homes `home` plus `reps`, each
    expert's tokens split freely among its holders (a naive linear search over the level)."""
    D, E = counts.shape
    T = counts.sum(axis=0).astype(float)
    holders = [{int(home[e])} | {d for x, d in reps if x == e} for e in range(E)]
    lo, hi = T.sum() / D, T.sum()
    for _ in range(60):  # bisection on the level: feasible if a flow fits every device under it
        mid = (lo + hi) / 2
        if _fits(T, holders, D, mid):
            hi = mid
        else:
            lo = mid
    return hi


def _fits(T: np.ndarray, holders: list[set[int]], D: int, level: float) -> bool:
    """Whether every expert's tokens fit on its holders with no device above `level` (Hall's
    condition over every set of devices: tokens that can only go there must fit there)."""
    for size in range(1, D + 1):
        for devices in itertools.combinations(range(D), size):
            inside = sum(t for t, h in zip(T, holders, strict=True) if h <= set(devices))
            if inside > level * size + 1e-9:
                return False
    return True


@settings(max_examples=80, deadline=None)
@given(
    D=st.integers(2, 4),
    per=st.integers(1, 3),
    spare=st.integers(0, 2),
    k=st.integers(0, 4),
    seed=st.integers(0, 10_000),
)
def test_retargeting_respects_slots_and_never_raises_the_heaviest_rank(
    D: int, per: int, spare: int, k: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    E = D * per
    home = rng.permutation(np.repeat(np.arange(D), per))
    counts = rng.integers(0, 50, size=(D, E)) * (rng.random(E) < 0.7)
    reps = layer_replicas(counts, home, slots=per + spare, k=k)
    assert len(reps) <= k
    placed = np.bincount([d for _, d in reps], minlength=D)
    assert (placed <= spare).all()  # only free slots
    assert len(set(reps)) == len(reps)  # one copy of an expert per device
    assert all(home[e] != d for e, d in reps)  # never on the expert's home
    homes_alone = _max_after(counts, home, [])
    assert _max_after(counts, home, reps) <= homes_alone + 1e-6
    if k and spare and counts.sum() and homes_alone > counts.sum() / D + 1:
        # an imbalanced layer with a free slot and a replica to give gets one
        assert reps


def _plan(E: int, D: int, slots: int, replicas: list[tuple[int, int, int]]) -> Plan:
    home = np.tile(np.repeat(np.arange(D), E // D), (2, 1))
    placement = Placement.from_homes(home, D, slots)
    for layer, e, d in replicas:
        placement.copies[layer, d, e] = 1
    assignment = Assignment.even(placement).with_split(True)
    return Plan("eplb", placement, assignment, transfers_between(None, placement, _spec(E)))


def test_a_retargeted_plan_keeps_homes_and_split_and_follows_the_step() -> None:
    E, D = 4, 2
    plan = _plan(E, D, 3, [(0, 0, 1), (1, 0, 1)])  # both layers replicate expert 0 on rank 1
    counts = np.zeros((2, D, E), dtype=np.int64)
    counts[0] = [[60, 10, 5, 5], [20, 10, 5, 5]]  # layer 0: expert 0 still hot
    counts[1] = [[1, 1, 5, 40], [1, 1, 5, 30]]  # layer 1: expert 3 hot now, on rank 1
    new = retargeted(plan, counts, _spec(E))
    assert np.array_equal(new.placement.home, plan.placement.home)
    assert new.assignment.by_counts and new.policy == "eplb"
    assert new.placement.copies[0, 1, 0] == 1  # kept
    assert new.placement.copies[1, 1, 0] == 0 and new.placement.copies[1, 0, 3] == 1  # moved
    moved = new.transfers
    assert moved is not None and len(moved.migrations) == 0 and moved.migrate_bytes.sum() == 0
    new.placement.validate()
    new.assignment.validate(new.placement)
    # the same counts again: nothing to change, the very plan back
    assert retargeted(new, counts, _spec(E)) is new
    # a plan without replicas is never given any
    bare = _plan(E, D, 3, [])
    assert retargeted(bare, counts, _spec(E)) is bare


def _wandering_trace(S: int, D: int, E: int) -> np.ndarray:
    """`[S, 2, D, E]`: every source sends 40 tokens to the step's hot expert, `(s // 3) % 4`
    (one of device 0's homes for 4 experts a device), and 2 to each other expert."""
    counts = np.full((S, 2, D, E), 2)
    for s in range(S):
        counts[s, :, :, (s // 3) % 4] = 40
    return counts


def test_the_simulator_prices_retargeted_replicas_as_the_runtime_runs_them() -> None:
    from poise.sim.simulator import simulate
    from tests.helpers import toy_cluster

    S, D, E = 30, 2, 8
    counts = _wandering_trace(S, D, E)
    spec = ModelSpec(
        "toy", d_model=64, d_expert=256, experts=E, top_k=1, moe_layers=2, tokens_per_device=54
    )
    cluster = toy_cluster(D, bw=1e12, flops=1e9)
    runs = {
        retarget: simulate(
            counts, cluster, spec, ["eplb"], replan_every=6, split_tokens=True,
            retarget=retarget, dense_params=0,
        ).runs["eplb"]
        for retarget in (False, True)
    }  # fmt: skip
    off, on = runs[False], runs[True]
    # steps whose hot expert was the step before's, after the first plan (step 6) and off
    # the steps plans take effect at (6, 12, ...): one replica of it levels each layer
    follow = [s for s in range(7, S) if s // 3 == (s - 1) // 3 and s % 6]
    assert all(on.max_over_mean[s] < 1.01 for s in follow), on.max_over_mean
    assert on.max_over_mean[follow].mean() < off.max_over_mean[follow].mean() - 0.2
    assert on.step_s[7:].sum() < off.step_s[7:].sum()
    # where a plan takes effect it runs its own replicas, as the runtime does at a switch
    for s in range(6, S, 6):
        assert on.max_over_mean[s] == off.max_over_mean[s]


def test_steps_are_priced_on_the_replicas_they_ran() -> None:
    """A plan replicating e0 on d1 (homes e0, e1 on d0; e2, e3 on d1); every other step d1 is
    the heavy side and retargeting ran a replica of e2 on d0 instead. `ran_plans` gives each
    step the plan that ran, and the marginal compute fit on every rank's expert seconds (2 x the
    model's forward on what ran, + 5 us) reads 2 from them, where pricing every step on the
    plan's own replicas (what the fit did before retargeting) reads something else."""
    from poise.core.placement import Assignment
    from poise.cost.model import CostModel
    from poise.plan.retarget import ran_plans
    from poise.runtime.selfcal import fit as selfcal
    from tests.helpers import toy_cluster, toy_spec

    spec = toy_spec(experts=4)
    cost = CostModel(toy_cluster(bw=1e9, flops=1e9), spec)
    p = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 3)
    p.copies[0, 1, 0] = 1  # e0's replica on d1
    plan = Plan("eplb", p, Assignment.even(p).with_split(True), transfers_between(None, p, spec))
    counts = np.zeros((8, 1, 2, 4))
    ran = []
    for s in range(8):  # the replicated expert sheds 16 pairs; its neighbour keeps d0 or d1 ahead
        hot = 0 if s % 2 else 2
        counts[s, 0, :, :] = 5
        counts[s, 0, :, hot] = 8
        counts[s, 0, :, hot + 1] = 30 + s
        ran.append(np.array([[0, 1, 0]]) if hot == 0 else np.array([[0, 0, 2]]))
    per_step = ran_plans(plan, ran, counts)
    assert isinstance(per_step, list) and len(per_step) == 8
    assert all(per_step[s] is plan for s in range(1, 8, 2))  # the plan's own: itself
    assert per_step[0].placement.copies[0, 0, 2] == 1 and per_step[0].placement.copies[0, 1, 0] == 0
    assert np.array_equal(per_step[0].placement.home, plan.placement.home)
    assert ran_plans(plan, [np.array([[0, 1, 0]])] * 8, counts) is plan
    assert ran_plans(plan, None, counts) is plan

    rank = 2.0 * device_compute(cost, per_step, counts) + 5e-6
    measured = np.zeros((8, len(selfcal.MEASURED)))
    measured[:, selfcal.EXPERTS] = rank.max(axis=1)
    _, fit = selfcal.fit_cluster(cost.cluster, cost, per_step, counts, measured, rank_experts=rank)
    assert fit.k_compute == pytest.approx(2.0) and fit.expert_fixed_s == pytest.approx(5e-6)
    _, blind = selfcal.fit_cluster(cost.cluster, cost, plan, counts, measured, rank_experts=rank)
    assert abs(blind.k_compute - 2.0) > 0.3, blind.k_compute
    # the model's evidence: static's busy seconds less what ran, step by step
    from poise.runtime.control.evidence import model_evidence

    static = Plan("static", Placement.from_homes(p.home, 2, 3), Assignment.to_home(
        Placement.from_homes(p.home, 2, 3)), transfers_between(None, p, spec))  # fmt: skip
    judged = model_evidence(cost, static, per_step, counts, measured)
    by_step = [
        live_parts(cost, static, counts[s : s + 1])[0, 0]
        - live_parts(cost, per_step[s], counts[s : s + 1])[0, 0]
        for s in range(8)
    ]
    assert judged.saving_s == pytest.approx(np.mean(by_step))
    assert model_evidence(cost, static, plan, counts, measured).saving_s < judged.saving_s


def test_the_paired_clocks_model_prices_the_replicas_the_neighbours_ran() -> None:
    """The paired clock's modelled saving (`modelled_clock_parts`): where the probes'
    neighbours ran retargeted replicas, the homes alone less what each neighbour ran, priced
    one neighbour at a time on its own counts (the reference here), meaned; where they ran the
    plan's own (or nothing says what they ran), on the probe steps' counts as before."""
    from poise.core.placement import Assignment
    from poise.cost.model import CostModel
    from poise.cost.per_step import live_parts
    from poise.plan.retarget import ran_plans
    from poise.runtime.control.clock import Probes, modelled_clock_parts
    from poise.runtime.moves.homes import homes_alone
    from tests.helpers import toy_cluster, toy_spec

    spec = toy_spec(experts=4)
    cost = CostModel(toy_cluster(bw=1e9, flops=1e9), spec)
    p = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 3)
    p.copies[0, 1, 0] = 1  # e0's replica on d1
    plan = Plan("eplb", p, Assignment.even(p).with_split(True), transfers_between(None, p, spec))
    probe = np.zeros((1, 1, 2, 4)) + 5
    probe[0, 0, :, 0] = 20  # the probe step: e0 hot
    pairs = np.zeros((2, 1, 2, 4)) + 5
    pairs[:, 0, :, 3] = [[30, 30], [40, 36]]  # its neighbours: e3 hot, on d1
    rows = np.zeros((1, 7))
    ran = (np.array([[0, 0, 3]]), np.array([[0, 0, 3]]))  # they ran e3's replica on d0
    probes = Probes(probe, rows, pairs, np.zeros((2, 7)), np.array([0, 0]), ran)
    busy, transfers = modelled_clock_parts(cost, plan, probes)
    alone = homes_alone(plan, spec)
    each = [ran_plans(plan, ran, pairs)[q] for q in range(2)]
    alone_busy = [live_parts(cost, alone, pairs[q : q + 1])[0, 0] for q in range(2)]
    ran_parts = [live_parts(cost, each[q], pairs[q : q + 1])[0] for q in range(2)]
    savings = [a - r[0] for a, r in zip(alone_busy, ran_parts, strict=True)]
    assert busy == pytest.approx(np.mean(savings))
    assert transfers == pytest.approx(np.mean([r[1] for r in ran_parts]))
    assert busy > 0  # e3's replica sheds d1's excess; the plan's own (e0 on d1) would add to it
    own = Probes(probe, rows, pairs, np.zeros((2, 7)), np.array([0, 0]))
    old = (
        live_parts(cost, alone, probe)[0, 0] - live_parts(cost, plan, probe)[0, 0],
        live_parts(cost, plan, probe)[0, 1],
    )
    assert modelled_clock_parts(cost, plan, own) == pytest.approx(old)


def test_the_records_hand_the_clock_what_each_probes_neighbours_ran() -> None:
    """`StepRecords.probe_pairs` gives each neighbour's `ran` rows with it (`Probes.pair_ran`),
    and a subset keeps them with their neighbours."""
    from poise.runtime.records import PROBE, REPLICAS, StepRecords
    from poise.runtime.selfcal import fit as selfcal

    records = StepRecords(10)
    layouts = [REPLICAS, PROBE, REPLICAS, REPLICAS, PROBE, REPLICAS]
    for i, layout in enumerate(layouts):
        ran = np.zeros((0, 3), np.int64) if layout == PROBE else np.array([[0, 1, i]])
        row = np.zeros(1 + len(selfcal.MEASURED))
        row[0] = i
        records.append(np.full((1, 2, 8), float(i)), row, layout, True, None, ran)
    probes = records.probe_pairs()
    assert [int(c[0, 0, 0]) for c in probes.pair_counts] == [0, 2, 3, 5]
    assert probes.pair_ran is not None
    assert [r.tolist() for r in probes.pair_ran] == [[[0, 1, i]] for i in (0, 2, 3, 5)]
    second = probes.subset(np.array([False, True]))
    assert second.pair_ran is not None
    assert [r.tolist() for r in second.pair_ran] == [[[0, 1, 3]], [[0, 1, 5]]]


def _three_step_wander(S: int) -> np.ndarray:
    """`[S, 1, 2, 4]`: homes e0, e1 on d0 and e2, e3 on d1; each source sends 30 tokens to the
    step's hot expert, e0 on steps 0-2, 6-8, ... and e2 on steps 3-5, 9-11, ..., and 4 to each
    other expert."""
    counts = np.full((S, 1, 2, 4), 4.0)
    for s in range(S):
        counts[s, 0, :, 0 if (s // 3) % 2 == 0 else 2] = 30
    return counts


def test_a_plan_as_run_follows_the_step_before_by_hand() -> None:
    """`as_run`: the plan's own replica on step 0, then step s's where step s-1's counts put
    it (the heavy device's hot expert onto the other device); a plan without replicas is
    itself."""
    from poise.plan.retarget import as_run

    counts = _three_step_wander(8)
    plan = _plan(4, 2, 3, [(0, 2, 0)])  # layer 0 replicates e2 on d0 (layer 1 has no counts)
    plan = dataclasses_replace_layers(plan, 1)
    ran = as_run(plan, counts, _spec(4))
    assert isinstance(ran, list) and len(ran) == 8 and ran[0] is plan
    for s, step_plan in enumerate(ran[1:], start=1):
        hot = 0 if ((s - 1) // 3) % 2 == 0 else 2
        other = 1 if hot == 0 else 0
        reps = {(int(d), int(e)) for d, e in np.argwhere(step_plan.placement.replicas()[0])}
        assert reps == {(other, hot)}, (s, reps)
        assert np.array_equal(step_plan.placement.home, plan.placement.home)
    bare = dataclasses_replace_layers(_plan(4, 2, 3, []), 1)
    assert as_run(bare, counts, _spec(4)) is bare


def dataclasses_replace_layers(plan: Plan, layers: int) -> Plan:
    """`plan`'s first `layers` layers (`_plan` makes two)."""
    import dataclasses

    keep = np.arange(layers)
    return dataclasses.replace(
        plan,
        placement=plan.placement.take_layers(keep),
        assignment=plan.assignment.take_layers(keep),
        transfers=None,
    )


def test_the_guard_prices_recent_steps_as_the_plans_would_run_them() -> None:
    """`price(retarget=True)`: two plans with the same homes and one replica each run the same
    replicas once retargeted, so their recent steps differ on the first alone (each runs its
    own replica there), where pricing each on its own replica credits the one whose replica sat
    on the expert hot more often. Against the homes alone, the gain as run equals the per-step
    reference: step 0 on the plan's own replica, each later step s with the replica of step
    s-1's hot expert, built by hand."""
    from poise.cost.model import CostModel
    from poise.cost.per_step import live_parts
    from poise.runtime.control.pricing import price
    from poise.runtime.moves.homes import homes_alone
    from tests.helpers import toy_cluster

    spec = ModelSpec("toy", d_model=8, d_expert=16, experts=4, top_k=1, moe_layers=1)
    cost = CostModel(toy_cluster(bw=1e9, flops=1e9), spec)
    counts = _three_step_wander(12)
    stale = dataclasses_replace_layers(_plan(4, 2, 3, [(0, 2, 0)]), 1)  # e2 on d0
    fresh = dataclasses_replace_layers(_plan(4, 2, 3, [(0, 0, 1)]), 1)  # e0 on d1
    loads = counts.mean(axis=0)
    three = counts[:3]  # e0 hot on each
    as_run = price(cost, stale, fresh, loads, recent=three, retarget=True)
    first = live_parts(cost, stale, three[:1])[0] - live_parts(cost, fresh, three[:1])[0]
    assert first[0] > 0  # step 0: e0 hot, the fresh plan's own replica sheds it
    assert as_run.recent_gain_s == pytest.approx(first.sum() / 3)
    # on their own replicas, every one of the three steps credits the fresh plan so
    own = price(cost, stale, fresh, loads, recent=three)
    assert own.recent_gain_s == pytest.approx(first.sum())

    alone = homes_alone(stale, spec)
    judged = price(cost, alone, stale, loads, recent=counts, retarget=True)
    by_step = [live_parts(cost, alone, counts[:1])[0] - live_parts(cost, stale, counts[:1])[0]]
    for s in range(1, len(counts)):
        hot = 0 if ((s - 1) // 3) % 2 == 0 else 2
        p = Placement.from_homes(stale.placement.home, 2, 3)
        p.copies[0, 1 if hot == 0 else 0, hot] = 1
        ran = Plan("eplb", p, Assignment.balanced(p, counts[s - 1]).with_split(True), None)
        by_step.append(
            live_parts(cost, alone, counts[s : s + 1])[0]
            - live_parts(cost, ran, counts[s : s + 1])[0]
        )
    assert judged.recent_gain_s == pytest.approx(np.mean([b.sum() for b in by_step]))
    # on its own replica the stale plan sheds the hot expert on half the steps only
    blind = price(cost, alone, stale, loads, recent=counts)
    assert judged.recent_gain_s > blind.recent_gain_s


def test_planning_jobs_price_as_run_where_the_balancer_retargets() -> None:
    """`PlanningJob.retarget` reaches the job's pricing (each candidate against the plan in
    force, priced as `price(retarget=)` prices it on the fitted cluster), and the Balancer
    hands its `retarget` setting to every job."""
    from dataclasses import replace

    from poise.cost.model import CostModel
    from poise.runtime.control.job import run_job
    from poise.runtime.control.pricing import price
    from tests.helpers import one_rank_balancer, one_rank_steps, replica_job, spy_jobs

    # e1 replicated on d0 in force, one step run under it; policy static: the candidate is static
    hot = np.array([[[40.0, 20.0], [30.0, 10.0]]])  # e0 hot now, on d0: retargeting follows it
    history = np.stack([hot] * 6)
    job = replica_job(steps=1, calibrate=False)
    job = replace(job, history=history, fit_counts=history[:1])
    results = {flag: run_job(replace(job, retarget=flag)) for flag in (False, True)}
    for flag, result in results.items():
        fitted = CostModel(result.cluster, job.spec)
        prior = CostModel(job.prior, job.spec)
        got = result.candidates[0]
        direct = price(
            fitted, job.current, got.plan, history[-1], switch_cost=prior, recent=history,
            retarget=flag, horizon=got.horizon, forecast_free=got.forecast_free,
        )  # fmt: skip
        assert got == direct
    # as run, the replica in force follows e0, so leaving it for the static layout loses more
    assert results[True].candidates[0].recent_gain_s < results[False].candidates[0].recent_gain_s
    for setting in (False, True):
        model, opt, balancer = one_rank_balancer(replan_every=2, plan_lag=0, retarget=setting)
        seen = spy_jobs(balancer, lambda job, _: job.retarget)
        one_rank_steps(model, opt, balancer, 4)
        balancer.close()
        assert seen and set(seen) == {setting}
