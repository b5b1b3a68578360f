"""What background planning costs the training thread: a planning thread against a worker process.

    .venv/bin/python benchmarks/planner_overlap.py            # ~1 min on 2 cores

The training side is one process's loop of forward + backward of the `tiny` GPT-MoE with
`many-experts`' experts (32 experts top-2, d_expert 512; batch 8 x 128 tokens, 1 thread), the
same mix of small tensor operations and Python a rank runs. The planning side is
`poise.runtime.planning_job.run_job`, the Balancer's own job, `auto` on the live cost model,
for 4 MoE layers of 32 experts on 2 ranks (the `cpu-2` cluster), from a 20-step window of Zipf
loads, submitted again as soon as it returns, for as long as the training loop runs:

- `alone`: no planning;
- `thread`: on a thread of the training process at nice 19 (`BackgroundPlanner(process=False)`);
- `process`: in the planner's worker process at nice 19 (`BackgroundPlanner()`, the default).

Modes rotate over `--rounds` rounds; one JSON line per mode with the median ms per training
iteration, `ratio_vs_alone` (median over rounds of the mode's ms over `alone`'s in the same
round) and the planning jobs finished per second. The thread mode holds the interpreter lock
whenever the planner's Python runs, and the training thread needs it between its operations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.models.gpt import GPTMoE, model_config
from poise.plan.predict import parse_predictor
from poise.runtime import selfcal
from poise.runtime.plan_inputs import default_cluster
from poise.runtime.planner import BackgroundPlanner
from poise.runtime.planning_job import PlanningJob, run_job

L, D, E, TOP_K, SLOTS, WINDOW = 4, 2, 32, 2, 17, 20


def planning_job(seed: int = 0) -> PlanningJob:
    """`auto` for L layers of E experts on D ranks from a window of Zipf(1.0) loads."""
    rng = np.random.default_rng(seed)
    spec = ModelSpec(
        name="many-experts", d_model=128, d_expert=512, experts=E, top_k=TOP_K, moe_layers=L,
        dtype_bytes=4, tokens_per_device=512, optimizer_bytes_per_param=8.0, activation="swiglu",
    )  # fmt: skip
    weights = 1.0 / np.arange(1, E + 1)
    probs = np.stack([rng.permutation(weights) for _ in range(L)])
    probs /= probs.sum(axis=1, keepdims=True)
    history = np.stack(
        [
            np.stack(
                [
                    [rng.multinomial(512 * TOP_K, probs[layer]) for _ in range(D)]
                    for layer in range(L)
                ]
            )
            for _ in range(WINDOW)
        ]
    )  # fmt: skip  [S, L, D, E]
    placement = Placement.from_homes(np.tile(np.repeat(np.arange(D), E // D), (L, 1)), D, SLOTS)
    static = Plan(
        "static", placement, Assignment.to_home(placement), transfers_between(None, placement, spec)
    )
    rows = np.zeros((WINDOW, 1 + len(selfcal.MEASURED)))
    rows[:, 0] = np.arange(WINDOW)
    return PlanningJob(
        history=history, fit_counts=history, fit_rows=rows, settled=np.ones(WINDOW, bool),
        static_counts=history[:0], static_rows=rows[:0],
        balanced_counts=history[:0], balanced_rows=rows[:0],
        current=static, static=static, prior=default_cluster(D), spec=spec,
        previous=selfcal.Fit(), policy="auto", predictor=parse_predictor("ema"),
        options={"auto": {"horizon": 10}}, slots=SLOTS, calibrate=False, split_tokens=True,
        horizon=10, measured_switch=None,
    )  # fmt: skip


def training_loop() -> Any:
    """`step()`: one forward + backward of the tiny GPT-MoE with many-experts' experts."""
    cfg = model_config("tiny", {"num_experts": E, "top_k": TOP_K, "d_expert": 512}, source="bench")
    model = GPTMoE(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def timed_round(step: Any, iterations: int, planner: BackgroundPlanner | None, job) -> dict:
    """ms per iteration of `step` while `planner` (None: nothing) plans `job` back to back."""
    stop = threading.Event()
    done = [0]

    def keep_planning() -> None:
        n = 0
        while not stop.is_set():
            planner.submit(partial(run_job, job), requested_at=n, adopt_at=n)
            planner.take()
            n += 1
        done[0] = n

    feeder = None
    if planner is not None:
        planner.submit(partial(run_job, job), 0, 0)  # warm: imports, first call
        planner.take()
        feeder = threading.Thread(target=keep_planning, daemon=True)
        feeder.start()
        time.sleep(0.2)
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    seconds = time.perf_counter() - t0
    stop.set()
    if feeder is not None:
        feeder.join()
    return {"ms": seconds / iterations * 1e3, "jobs_per_s": done[0] / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=20, help="training iterations per round")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    step = training_loop()
    for _ in range(3):
        step()  # warm-up
    job = planning_job()
    planners = {
        "alone": None,
        "thread": BackgroundPlanner(process=False),
        "process": BackgroundPlanner(preload=(run_job.__module__,)),
    }
    modes = list(planners)
    got: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                got[m].append(timed_round(step, args.iterations, planners[m], job))
    finally:
        for planner in planners.values():
            if planner is not None:
                planner.close()
    for m in modes:
        ratios = [x["ms"] / a["ms"] for x, a in zip(got[m], got["alone"], strict=True)]
        line = {
            "bench": "planner_overlap",
            "mode": m,
            "ms_per_iteration": round(statistics.median(x["ms"] for x in got[m]), 2),
            "ratio_vs_alone": round(statistics.median(ratios), 3),
            "planning_jobs_per_s": round(statistics.median(x["jobs_per_s"] for x in got[m]), 2),
            "rounds": args.rounds,
            "iterations": args.iterations,
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
