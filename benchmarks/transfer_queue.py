"""Does a bulk transfer in flight hold back the tokens' next all-to-all on the same group?

    .venv/bin/python benchmarks/transfer_queue.py                  # 2 gloo ranks, ~20 s
    .venv/bin/python benchmarks/transfer_queue.py --world 4 --mb 3.2

Each step of a 2- or 4-rank run (gloo, 1 thread a rank) does two things:

1. It launches one asynchronous `all_to_all_single` per layer of `--mb` MB a rank pair, as the
   Balancer's Trans does at a step boundary.
2. It then runs the layers' forward: per layer, a small synchronous all-to-all (64 KB a rank
   pair: a dispatch) and `--compute-ms` of GEMMs.

The bulk transfers run either on the tokens' group (`shared`) or on a second group over the
same ranks (`separate`, `poise.runtime.moves.transfer_group`). The two kinds take turns step by
step. Printed, one JSON line: the median latency of each layer's dispatch under each kind, in
ms, and the ratio shared / separate for the first layer's dispatch, which is issued right
after the bulk transfers. Gloo serves a group's collectives from one queue with 2 worker
threads, so on one group the first dispatch waits behind the bulk transfers. The step's total
is given too: on shared CPU cores the bytes still cost their copies, whichever queue holds
them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

DISPATCH_BYTES = 64 * 1024  # a rank pair's rows of one small dispatch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="gloo ranks")
    p.add_argument("--layers", type=int, default=4, help="bulk transfers and dispatches a step")
    p.add_argument("--mb", type=float, default=1.6, help="MB a rank pair per bulk transfer")
    p.add_argument("--compute-ms", type=float, default=5.0, help="GEMM time per layer")
    p.add_argument("--steps", type=int, default=40, help="steps of each kind")
    return p.parse_args(argv)


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from poise.runtime.moves.transfer_group import transfer_group

    own = transfer_group(None)
    layers = args["layers"]
    bulk = [torch.randn(world * int(args["mb"] * 2**20 / 4)) for _ in range(layers)]
    sinks = [torch.empty_like(b) for b in bulk]
    small = torch.randn(world * DISPATCH_BYTES // 4)
    small_out = torch.empty_like(small)
    a = torch.randn(128, 128)
    # GEMMs per layer for --compute-ms, timed once here (the same count on every rank)
    t0 = time.perf_counter()
    for _ in range(50):
        a = torch.tanh(a @ a)
    per_gemm = (time.perf_counter() - t0) / 50
    reps = torch.tensor([max(1, round(args["compute_ms"] * 1e-3 / per_gemm))], dtype=torch.long)
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)
    dispatch: dict[str, list[list[float]]] = {"shared": [], "separate": []}
    step_s: dict[str, list[float]] = {"shared": [], "separate": []}
    for step in range(2 * args["steps"]):
        kind = ("shared", "separate")[step % 2]
        group = None if kind == "shared" else own
        dist.barrier()
        t_step = time.perf_counter()
        handles = [
            dist.all_to_all_single(o, b, group=group, async_op=True)
            for o, b in zip(sinks, bulk, strict=True)
        ]
        row = []
        for _ in range(layers):
            t1 = time.perf_counter()
            dist.all_to_all_single(small_out, small)
            row.append(time.perf_counter() - t1)
            for _ in range(int(reps)):
                a = torch.tanh(a @ a)
        for h in handles:
            h.wait()
        step_s[kind].append(time.perf_counter() - t_step)
        dispatch[kind].append(row)
    if rank != 0:
        return None
    return {"dispatch": dispatch, "step_s": step_s, "gemms_per_layer": int(reps)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from poise.runtime.launch import run_ranks

    t0 = time.perf_counter()
    out = run_ranks(_rank, args.world, vars(args), timeout_s=600)[0]
    by_layer = {
        kind: [
            round(statistics.median(row[k] for row in rows) * 1e3, 2) for k in range(args.layers)
        ]
        for kind, rows in out["dispatch"].items()
    }
    steps = {kind: round(statistics.median(v) * 1e3, 1) for kind, v in out["step_s"].items()}
    line = {
        "bench": "transfer_queue",
        "world": args.world,
        "layers": args.layers,
        "bulk_mb_per_pair": args.mb,
        "compute_ms_per_layer": args.compute_ms,
        "steps_each": args.steps,
        "dispatch_ms_by_layer": by_layer,
        "first_dispatch_shared_over_separate": round(
            by_layer["shared"][0] / by_layer["separate"][0], 2
        ),
        "step_ms": steps,
        "step_shared_over_separate": round(steps["shared"] / steps["separate"], 3),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
