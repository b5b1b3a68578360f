"""`auto`'s number of replicas priced as they run under retargeting
(`poise.plan.replica_budget`): by hand against per-step plans built here, its extremes, and
the planning job that applies it."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.cost.model import CostModel
from poise.cost.per_step import live_parts
from poise.plan.replica_budget import replica_budget
from tests.helpers import toy_cluster, toy_spec

E, D, SLOTS = 4, 2, 3  # homes e0, e1 on d0; e2, e3 on d1; one spare slot a device and layer


def _wander(S: int) -> np.ndarray:
    """`[S, 2, D, E]`: each source sends 30 tokens to the layer's hot expert and 4 to each other;
    layer 0's hot expert is e0 on steps 0-2, 6-8, ... and e2 on the others, layer 1's the
    opposite."""
    counts = np.full((S, 2, D, E), 4.0)
    for s in range(S):
        first = (s // 3) % 2 == 0
        counts[s, 0, :, 0 if first else 2] = 30
        counts[s, 1, :, 2 if first else 0] = 30
    return counts


def _plan(replicas: list[tuple[int, int, int]], spec) -> Plan:
    home = np.array([[0, 0, 1, 1]] * 2)
    p = Placement.from_homes(home, D, SLOTS)
    for layer, e, d in replicas:
        p.copies[layer, d, e] = 1
    return Plan("auto", p, Assignment.even(p).with_split(True), transfers_between(None, p, spec))


def _by_hand(cost: CostModel, counts: np.ndarray, k: int) -> float:
    """The mean `busy + transfers` of `k` replicas (0, 1 or 2) as they run `counts` with
    retargeting, each step's plan built here: a replica of each layer's hot expert of the step
    before onto the other device (layer 0's alone where k is 1: the layers' imbalance is equal
    and ties go to the lowest layer), step 0's from the window's newest step (the plan's own,
    which the budget takes from there)."""
    spec = cost.spec
    total = []
    for s in range(len(counts)):
        prev = counts[s - 1]  # step 0: counts[-1]
        reps = []
        for layer in range(k):
            hot = int(np.argmax(prev[layer].sum(axis=0)))
            reps.append((layer, hot, 1 if hot < 2 else 0))
        p = _plan(reps, spec).placement
        plan = Plan("auto", p, Assignment.balanced(p, prev).with_split(True), None)
        total.append(live_parts(cost, plan, counts[s : s + 1]).sum())
    return float(np.mean(total))


@pytest.mark.parametrize("bw, want", [(1e12, 2), (1e2, 0)])
def test_the_budget_keeps_the_replicas_that_pay_as_they_run(bw: float, want: int) -> None:
    """With cheap bytes both layers keep a replica that follows the router (2), where `auto`'s
    plan had one on a layer's expert that is cold half the time; with dear bytes none. The choice
    is the least of the by-hand prices, the homes stay, and the notes say the budget."""
    spec = toy_spec(experts=E, layers=2, d_model=8, d_expert=16)
    cost = CostModel(toy_cluster(D, bw=bw, flops=1e9), spec)
    counts = _wander(13)  # steps 0 and 12 alike: the plan's own replicas serve step 0 too
    auto = _plan([(0, 0, 1)], spec)
    prices = [_by_hand(cost, counts, k) for k in range(3)]
    assert int(np.argmin(prices)) == want, prices
    chosen = replica_budget(cost, auto, counts, auto.placement)
    assert int(chosen.placement.replicas().sum()) == want
    assert chosen.notes["replica_budget"] == want
    assert np.array_equal(chosen.placement.home, auto.placement.home)
    chosen.placement.validate()
    chosen.assignment.validate(chosen.placement)
    # a plan that already holds the best number comes back as it is
    again = replica_budget(cost, chosen, counts, auto.placement)
    assert again is chosen


def test_no_recent_steps_or_nothing_better_keeps_autos_plan() -> None:
    spec = toy_spec(experts=E, layers=2, d_model=8, d_expert=16)
    cost = CostModel(toy_cluster(D, bw=1e12, flops=1e9), spec)
    auto = _plan([(0, 0, 1)], spec)
    assert replica_budget(cost, auto, np.zeros((0, 2, D, E)), auto.placement) is auto
    even = np.full((4, 2, D, E), 5.0)  # balanced steps: no replica pays, none is added
    kept = replica_budget(cost, _plan([], spec), even, auto.placement)
    assert int(kept.placement.replicas().sum()) == 0


def test_the_planning_job_budgets_autos_replicas_where_the_balancer_retargets() -> None:
    """`run_job` with `retarget` gives `auto`'s plan the budget's number of replicas on the
    fitted cluster and the recent steps; without `retarget`, `auto`'s own. Here they differ:
    over links of 10 MB/s `auto`, pricing a step with its schedule (Trans and Agg beside
    compute), keeps a replica on every spare slot, while priced as the guard prices a plan
    (busy + transfers, exposed), none pays."""
    from dataclasses import replace

    from poise.runtime.control.job import run_job
    from tests.helpers import replica_job

    spec = toy_spec(experts=E, layers=2, d_model=8, d_expert=16)
    history = _wander(13)
    static = _plan([], spec)
    static = replace(static, policy="static", assignment=Assignment.to_home(static.placement))
    job = replica_job(steps=1)
    job = replace(
        job, history=history, fit_counts=history[:0], fit_rows=job.fit_rows[:0],
        settled=np.zeros(0, dtype=bool), calibrate=False, policy="auto", current=static,
        static=static, spec=spec, slots=SLOTS, split_tokens=True,
        prior=toy_cluster(D, bw=1e7, flops=1e9),
    )  # fmt: skip
    plain, budgeted = run_job(job), run_job(replace(job, retarget=True))
    fitted = CostModel(budgeted.cluster, job.spec)
    recent = history[-job.horizon :]
    want = replica_budget(fitted, plain.forecast, recent, job.current.placement)
    assert budgeted.forecast.digest() == want.digest()
    assert budgeted.forecast.digest() != plain.forecast.digest()
    assert budgeted.forecast.placement.replicas().sum() < plain.forecast.placement.replicas().sum()


def test_the_budget_takes_the_newest_steps_picks_first_then_older_ones_by_hand() -> None:
    """`budget_picks`: the newest step's greedy first (layer 0's e0 onto d1; its layer 1 was
    balanced), then the older steps' where a slot is still free: the step before adds layer 1's
    e2 onto d0 (its layer 0 pick, e0 onto d1 again, is already taken), the oldest nothing new
    (layer 0's d1 slot is taken by e0, so its e3 cannot go there)."""
    from poise.plan.replica_budget import budget_picks, greedy_by_step

    def picks(recent: np.ndarray, home: np.ndarray) -> list:
        return budget_picks(greedy_by_step(recent, home, SLOTS), home, SLOTS, D)

    recent = np.full((3, 2, D, E), 4.0)
    recent[2, 0, :, 0] = 30  # newest: layer 0's e0 hot, layer 1 even
    recent[1, 0, :, 0] = 30  # before: layer 0's e0 hot again, layer 1's e2
    recent[1, 1, :, 2] = 30
    recent[0, 0, :, 1] = 30  # oldest: layer 0's e1 hot (d0 again: its replica would take d1)
    home = np.array([[0, 0, 1, 1]] * 2)
    assert picks(recent, home) == [(0, 0, 1), (1, 2, 0)]
    assert picks(recent[2:], home) == [(0, 0, 1)]


@pytest.mark.parametrize("seed", range(6))
def test_the_options_run_what_as_run_gives_and_are_priced_so(seed: int) -> None:
    """`budget_options` builds each step's plan once for every `K` it serves; each option's runs
    are what `as_run` gives its own plan (the same replicas, step by step), and `budget_prices`
    prices them as `live_parts` on `as_run` does, one option at a time. Random skewed steps on
    3 ranks, 2 layers, 6 experts, one or two spare slots."""
    from poise.plan.replica_budget import budget_options, budget_prices
    from poise.plan.retarget import as_run

    rng = np.random.default_rng(seed)
    Dn, En, spare = 3, 6, 1 + seed % 2
    spec = toy_spec(experts=En, layers=2, d_model=8, d_expert=16)
    cost = CostModel(toy_cluster(Dn, bw=1e8, flops=1e9), spec)
    recent = rng.poisson(5, size=(5, 2, Dn, En)).astype(float)
    recent[:, :, :, rng.integers(En, size=5)] += 40
    home = np.tile(np.repeat(np.arange(Dn), En // Dn), (2, 1))
    p = Placement.from_homes(home, Dn, En // Dn + spare)
    plan = Plan("auto", p, Assignment.even(p).with_split(True), transfers_between(None, p, spec))
    options = budget_options(plan, recent, p, spec)
    assert len(options) >= 2 and options[0][0].placement.replicas().sum() == 0
    for k, (own, runs) in enumerate(options):
        assert own.placement.replicas().sum() == k
        own.placement.validate()  # every replica on a free slot of its device
        own.assignment.validate(own.placement)
        ref = as_run(own, recent, spec)
        ref = ref if isinstance(ref, list) else [ref] * len(recent)
        assert [r.placement.copies.tolist() for r in runs] == [
            r.placement.copies.tolist() for r in ref
        ]
        one = live_parts(cost, ref, recent).sum(axis=1).mean()
        assert budget_prices(cost, [runs], recent)[0] == pytest.approx(one, rel=1e-12)
    together = budget_prices(cost, [r for _, r in options], recent)
    apart = [budget_prices(cost, [r], recent)[0] for _, r in options]
    assert together == pytest.approx(apart, rel=1e-12)
