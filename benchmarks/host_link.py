"""Trans and Agg of one layer through gloo's all-to-all and through shared memory (`HostLink`).

    .venv/bin/python benchmarks/host_link.py        # 2 gloo ranks, 1 thread each, ~15 s

Two ranks, one MoE layer's stacked SwiGLU expert tensors as in `train_speedup`'s `skewed`
setting (d_model 128, d_expert 1024, fp32, 16 experts, 8 + 1 slots per rank): each rank holds
one replica of an expert of the other (1.5 MiB a row). A call is one `trans_async` and one
`agg_async`, each launched and then waited for (the rows written or added), as the Balancer
does per layer and step. Rounds rotate the two paths; the time of a call is the slower rank's.
One JSON line per path: the median ms of Trans and of Agg (launch + wait), and `ratio_vs_gloo`
(median over rounds of this path's Trans + Agg over gloo's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

SLOTS, D_MODEL, D_EXPERT, EXPERTS = 9, 128, 1024, 16
PATHS = ("gloo", "shared-memory")


def _rank(rank: int, world: int, rounds: int, calls: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from poise.core.placement import Placement
    from poise.nn.slots import slot_maps
    from poise.runtime.moves import exchange as ex
    from poise.runtime.moves import transfers as tr
    from poise.runtime.moves.host_link import HostLink

    shapes = [(SLOTS, D_MODEL, D_EXPERT), (SLOTS, D_MODEL, D_EXPERT), (SLOTS, D_EXPERT, D_MODEL)]
    params = [torch.randn(*s) for s in shapes]
    grads = [torch.randn(*s) for s in shapes]
    home = np.repeat(np.arange(world), EXPERTS // world)
    placement = Placement.from_homes(home[None], world, SLOTS)
    for r in range(world):  # each rank replicates the first expert of the next rank
        placement.copies[0, r, ((r + 1) % world) * (EXPERTS // world)] = 1
    maps = slot_maps(placement, 0, SLOTS)
    trans_routes, agg_routes = ex.trans_routes(maps), ex.agg_routes(maps)
    link = HostLink.connect()
    assert link is not None, "the ranks do not share memory"
    links = {"gloo": (None, None), "shared-memory": (link.channel("t"), link.channel("a"))}
    times: dict[str, dict[str, list[float]]] = {p: {"trans": [], "agg": []} for p in PATHS}
    for r in range(rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            t_link, a_link = links[path]
            for _ in range(calls):
                dist.barrier()
                t0 = time.perf_counter()
                tr.trans_async(params, maps, rank, routes=trans_routes, link=t_link).wait()
                t1 = time.perf_counter()
                tr.agg_async(grads, maps, rank, routes=agg_routes, link=a_link).wait()
                t2 = time.perf_counter()
                times[path]["trans"].append(t1 - t0)
                times[path]["agg"].append(t2 - t1)
    return {"times": times, "row_bytes": sum(int(np.prod(s[1:])) * 4 for s in shapes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="calls per path and round")
    args = parser.parse_args()
    from poise.runtime.launch import run_ranks

    results = run_ranks(_rank, 2, args.rounds, args.calls)

    def slower(path: str, kind: str) -> np.ndarray:  # the slower rank's time of each call
        return np.maximum(*(np.asarray(r["times"][path][kind]) for r in results))

    both = {p: slower(p, "trans") + slower(p, "agg") for p in PATHS}
    per_round = {p: both[p].reshape(args.rounds, args.calls).mean(axis=1) for p in PATHS}
    for path in PATHS:
        print(
            json.dumps(
                {
                    "bench": "host_link",
                    "path": path,
                    "row_mib": round(results[0]["row_bytes"] / 2**20, 2),
                    "trans_ms": round(1e3 * statistics.median(slower(path, "trans")), 3),
                    "agg_ms": round(1e3 * statistics.median(slower(path, "agg")), 3),
                    "ratio_vs_gloo": round(
                        statistics.median((per_round[path] / per_round["gloo"]).tolist()), 3
                    ),
                    "calls": int(both[path].size),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
