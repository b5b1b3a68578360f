"""What background planning costs the training ranks: a planning thread, a worker process at
nice 19, and one at SCHED_IDLE.

    .venv/bin/python benchmarks/planner_overlap.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/planner_overlap.py --ranks 4 --rounds 6   # ~1.5 min

The training side is a forward + backward loop of the `tiny` GPT-MoE with 32 experts top-2
(d_expert 512, batch 8 x 128 tokens, 1 thread): one process, or `--ranks` gloo ranks with small
all-reduces where a rank waits as at the all-to-alls. The planning side, beside rank 0, runs the
Balancer's own job (`poise.runtime.control.job.run_job`, `auto`, 4 layers of 32 experts on 2
ranks, a 20-step window of Zipf loads) again and again while training runs:

- `alone`: no planning; `thread`: on a thread of rank 0's process at nice 19 (`--ranks 1`);
- `process`: in the planner's worker process at nice 19 (the default);
- `process-idle`: in the worker process at Linux's SCHED_IDLE.

Modes rotate over `--rounds` rounds; one JSON line per mode: the median ms per training
iteration, `ratio_vs_alone` (median over rounds against `alone` in the same round), the jobs
finished per second, and `training_ms_per_job`, the training's extra milliseconds per finished
job: what one re-plan costs the ranks.
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
from poise.runtime.control.job import PlanningJob, run_job
from poise.runtime.plan_inputs import default_cluster
from poise.runtime.planner.background import BackgroundPlanner
from poise.runtime.selfcal import fit as selfcal

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
        current=static, static=static, prior=default_cluster(D), spec=spec,
        previous=selfcal.Fit(), policy="auto", predictor=parse_predictor("ema"),
        options={"auto": {"horizon": 10}}, slots=SLOTS, calibrate=False, split_tokens=True,
        horizon=10,
    )  # fmt: skip


def training_loop(sync: Any = None) -> Any:
    """`step()`: one forward + backward of the tiny GPT-MoE with many-experts' experts, with
    `sync()` (the ranks' small all-reduces, where there are several) before, between and after
    them."""
    cfg = model_config("tiny", {"num_experts": E, "top_k": TOP_K, "d_expert": 512}, source="bench")
    model = GPTMoE(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0))
    sync = sync or (lambda: None)

    def step() -> None:
        sync()
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        sync()
        loss.backward()
        sync()
        model.zero_grad(set_to_none=True)

    return step


def timed_round(
    step: Any, iterations: int, planner: BackgroundPlanner | None, job, barrier: Any = None
) -> dict:
    """ms per iteration of `step` while `planner` (None: nothing) plans `job` back to back;
    `barrier()` (the ranks', where there are several) before and after the timed loop."""
    stop = threading.Event()
    done = [0]
    barrier = barrier or (lambda: None)

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
    barrier()
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    barrier()
    seconds = time.perf_counter() - t0
    stop.set()
    if feeder is not None:
        feeder.join()
    return {"ms": seconds / iterations * 1e3, "jobs_per_s": done[0] / seconds, "jobs": done[0]}


def make_planner(mode: str) -> BackgroundPlanner | None:
    preload = (run_job.__module__,)
    return {
        "alone": lambda: None,
        "thread": lambda: BackgroundPlanner(process=False),
        "process": lambda: BackgroundPlanner(preload=preload),
        "process-idle": lambda: BackgroundPlanner(preload=preload, priority="idle"),
    }[mode]()


def run_rounds(args: argparse.Namespace, modes: list[str], rank: int = 0, world: int = 1) -> dict:
    """`{mode: [round's figures]}` on this rank (rank 0 plans; every rank trains)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sync = barrier = None
    if world > 1:
        import torch.distributed as dist

        flag = torch.zeros(64)

        def sync() -> None:
            for _ in range(2):
                dist.all_reduce(flag)

        barrier = dist.barrier
    step = training_loop(sync)
    for _ in range(3):
        step()  # warm-up
    job = planning_job()
    planners = {m: make_planner(m) if rank == 0 else None for m in modes}
    got: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                got[m].append(timed_round(step, args.iterations, planners[m], job, barrier))
    finally:
        for planner in planners.values():
            if planner is not None:
                planner.close()
    return got


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, modes: list[str], queue):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        got = run_rounds(args, modes, rank, world)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(got)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=20, help="training iterations per round")
    p.add_argument("--ranks", type=int, default=1, help="gloo ranks training (1: one process)")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.rounds < 1 or args.iterations < 1:
        p.error("--ranks, --rounds and --iterations must be >= 1")
    modes = ["alone", "thread", "process", "process-idle"]
    if args.ranks == 1:
        got = run_rounds(args, modes)
    else:
        import torch.multiprocessing as mp

        from poise.runtime.launch import free_port

        modes.remove("thread")
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_rank, args=(args.ranks, free_port(), args, modes, queue), nprocs=args.ranks)
        got = queue.get()
    for m in modes:
        pairs = list(zip(got[m], got["alone"], strict=True))
        ratios = [x["ms"] / a["ms"] for x, a in pairs]
        # the training's seconds each finished job cost it
        per_job = [(x["ms"] - a["ms"]) * args.iterations / x["jobs"] for x, a in pairs if x["jobs"]]
        line = {
            "bench": "planner_overlap",
            "mode": m,
            "ranks": args.ranks,
            "ms_per_iteration": round(statistics.median(x["ms"] for x in got[m]), 2),
            "ratio_vs_alone": round(statistics.median(ratios), 3),
            "planning_jobs_per_s": round(statistics.median(x["jobs_per_s"] for x in got[m]), 2),
            "training_ms_per_job": round(statistics.median(per_job), 2) if per_job else None,
            "rounds": args.rounds,
            "iterations": args.iterations,
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
