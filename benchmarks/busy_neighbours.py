"""A rank's expert compute while the other ranks of its host wait, and while they compute too.

    .venv/bin/python benchmarks/busy_neighbours.py    # 2 then 4 gloo ranks, 1 thread each, ~40 s

The ideal of `train_speedup` (`poise.report.ideal`) prices every token-expert pair the slowest
rank sheds at `c`, the seconds of one pair's expert forward and backward, timed while the runs'
ranks wait. Under static EP the slowest rank computes while the others wait in a collective
(asleep, their cores free); under perfect balance every rank computes at once. Where the ranks
share a host's caches, memory bandwidth or physical cores (two vCPUs of one core under a
hypervisor), a pair costs more in the second case, and that part of the ideal's gain does not
exist on the host.

Each rank holds `train_speedup`'s `skewed` experts (SwiGLU, d_model 128, d_expert 1024, fp32,
8 experts and a spare slot, `poise.nn.Experts`) and `--rows` rows spread evenly over the 8. A
call, after a barrier: rank 0 times its forward and backward while the other ranks either
wait at the next barrier (`idle`) or run the same forward and backward (`busy`). Rounds of
`--calls` calls per mode, the order of the modes alternating from round to round. One JSON line
per world size: rank 0's median `idle_ms` and `busy_ms`, and `busy_over_idle`, the median over
rounds of the round's busy / idle mean: 1 where a busy neighbour costs nothing. `cores` is the
host's (`os.sched_getaffinity`); with more ranks than cores the ranks time-share the cores and
the ratio holds that too (`train_speedup`'s `shared_cores` prices it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

D_MODEL, D_EXPERT, EXPERTS, SLOTS = 128, 1024, 8, 9
MODES = ("idle", "busy")


def _rank(rank: int, world: int, rounds: int, calls: int, rows: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from poise.nn.experts import Experts

    torch.manual_seed(rank)
    experts = Experts(num_slots=SLOTS, d_model=D_MODEL, d_expert=D_EXPERT, activation="swiglu")
    counts = [rows // EXPERTS] * EXPERTS + [0]
    x = torch.randn(sum(counts), D_MODEL, requires_grad=True)

    def compute() -> None:
        experts(x, counts).sum().backward()

    for _ in range(2):  # warm-up: allocator, kernels
        compute()
    times: dict[str, list[list[float]]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            per_call = []
            for _ in range(calls):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0 or mode == "busy":
                    compute()
                per_call.append(time.perf_counter() - t0)
            times[mode].append(per_call)
    return {"times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=3, help="calls per mode and round")
    parser.add_argument("--rows", type=int, default=2048, help="rows per call, over 8 experts")
    args = parser.parse_args()
    from poise.runtime.launch import run_ranks

    cores = len(os.sched_getaffinity(0))
    for world in args.worlds:
        t0 = time.perf_counter()
        times = run_ranks(_rank, world, args.rounds, args.calls, args.rows)[0]["times"]
        means = {m: [statistics.fmean(c) for c in times[m]] for m in MODES}
        flat = {m: [t for c in times[m] for t in c] for m in MODES}
        print(
            json.dumps(
                {
                    "bench": "busy_neighbours",
                    "ranks": world,
                    "cores": cores,
                    "rows": args.rows,
                    "idle_ms": round(1e3 * statistics.median(flat["idle"]), 2),
                    "busy_ms": round(1e3 * statistics.median(flat["busy"]), 2),
                    "busy_over_idle": round(
                        statistics.median(
                            b / i for b, i in zip(means["busy"], means["idle"], strict=True)
                        ),
                        4,
                    ),
                    "busy_over_idle_rounds": [
                        round(b / i, 4) for b, i in zip(means["busy"], means["idle"], strict=True)
                    ],
                    "calls": len(flat["idle"]),
                    "seconds": round(time.perf_counter() - t0, 1),
                    "load_avg_1min": round(os.getloadavg()[0], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
