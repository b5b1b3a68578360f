"""Planner time of `auto`'s replica budget under retargeting, per planning job.

    .venv/bin/python benchmarks/replica_budget.py       # ~10 s

Where the live Balancer retargets replicas, each planning job of `auto` prices every number of
replicas `K` as it would run the recent steps (`poise.plan.replica_budget`) on the planner's
process, beside training. Per shape (`train_speedup.py`'s `skewed` and `skewed-4` models: 4
layers, d_model 128, d_expert 1024, top-1; `E` experts on `D` ranks, one spare slot a rank and
layer; a window of `S` steps of seeded skewed counts, each layer's hot expert drawn afresh every
step, as a router that wanders), the median time of one `replica_budget` call over `--calls`
calls, and the options it priced. For a ratio within the run, `as_run_ms`: the same prices taken
one option at a time through `poise.plan.retarget.as_run` and `live_parts`, as a reference
implementation without the shared per-step greedy, and `speedup` = `as_run_ms / budget_ms`.

One JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.cost.model import CostModel
from poise.plan.replica_budget import budget_options, replica_budget
from poise.plan.retarget import as_run
from poise.runtime.plan_inputs import default_cluster
from poise.runtime.selfcal.fit import live_parts

SHAPES = (("skewed", 2, 16), ("skewed-4", 4, 32))  # name, ranks, experts
LAYERS, STEPS = 4, 10


def case(devices: int, experts: int, seed: int = 0) -> tuple[CostModel, Plan, np.ndarray]:
    """The cost model, a plan on the static homes with no replica, and `[S, L, D, E]` counts."""
    spec = ModelSpec(
        "bench", d_model=128, d_expert=1024, experts=experts, top_k=1, moe_layers=LAYERS,
        tokens_per_device=1024,
    )  # fmt: skip
    cost = CostModel(default_cluster(devices), spec)
    home = np.tile(np.repeat(np.arange(devices), experts // devices), (LAYERS, 1))
    p = Placement.from_homes(home, devices, experts // devices + 1)
    plan = Plan("auto", p, Assignment.even(p).with_split(True), transfers_between(None, p, spec))
    rng = np.random.default_rng(seed)
    recent = rng.poisson(20, size=(STEPS, LAYERS, devices, experts)).astype(float)
    for s in range(STEPS):
        for layer in range(LAYERS):
            recent[s, layer, :, rng.integers(experts)] += 300
    return cost, plan, recent


def one_at_a_time(cost: CostModel, plan: Plan, recent: np.ndarray) -> list[float]:
    """The reference: each option's `as_run` priced by `live_parts` on its own."""
    out = []
    for own, _ in budget_options(plan, recent, plan.placement, cost.spec):
        runs = as_run(own, recent, cost.spec)
        out.append(float(live_parts(cost, runs, recent).sum(axis=1).mean()))
    return out


def timed_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=7)
    args = p.parse_args(argv)
    for name, devices, experts in SHAPES:
        cost, plan, recent = case(devices, experts)
        budget_ms = timed_ms(
            partial(replica_budget, cost, plan, recent, plan.placement), args.calls
        )
        as_run_ms = timed_ms(partial(one_at_a_time, cost, plan, recent), args.calls)
        chosen = replica_budget(cost, plan, recent, plan.placement)
        options = len(budget_options(plan, recent, plan.placement, cost.spec))
        line = {
            "bench": "replica_budget",
            "shape": name,
            "ranks": devices,
            "experts": experts,
            "layers": LAYERS,
            "steps": STEPS,
            "options": options,
            "chosen_replicas": int(chosen.placement.replicas().sum()),
            "budget_ms": round(budget_ms, 2),
            "as_run_ms": round(as_run_ms, 2),
            "speedup": round(as_run_ms / budget_ms, 2),
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
