"""Trans and Agg of one replica alone and beside expert compute, on ranks that share cores.

    .venv/bin/python benchmarks/contended_exchange.py    # 2 then 4 gloo ranks, 1 thread each, ~40 s
    .venv/bin/python benchmarks/contended_exchange.py --worlds 2 --layouts ring pair single

What a replica's bulk transfer costs a step where the ranks share the host's cores: the
start-up probe (`poise.runtime.selfcal.probe`) times the bytes on idle cores, while in training
Trans is
launched at a step boundary and waited for in the forward, with the ranks computing meanwhile.
Each rank holds one replica of an expert of the next rank (`--layouts ring`, the default; the
stacked SwiGLU tensors of `train_speedup`'s `skewed` settings: d_model 128, d_expert 1024,
fp32, 8 experts a rank and a spare slot, 1.5 MiB a row); `pair` puts two replicas of rank 1's
experts on rank 0 (every byte one way) and `single` one. A cost model whose links are full
duplex per device (each device's Trans time set by the larger of what it sends and receives)
prices `ring` like `single` and `pair` twice that; if the ranks' shared cores and memory carry
every byte (one link for all of them), `ring` and `pair` cost alike, twice `single`.
Per call, after a barrier, three modes in rotation:

- `exchange`: `trans_async` then `agg_async`, each launched and waited for (as the Balancer
  does per layer and step);
- `compute`: the rank's expert forward on 512 rows (SwiGLU, three GEMMs) `repeats` times;
- `both`: Trans and Agg launched, the compute run, then both waited for.

One JSON line per world size: the medians over calls of the slowest rank's `exchange_ms`,
`compute_ms` and `both_ms`, and `exposed_ms` = median over calls of the largest per-rank
(`both` - `compute` of the same rank and round); `exposed_vs_alone` = exposed_ms / exchange_ms:
about 1 where the transfer costs on busy cores what it costs on idle ones. `--repeats` sets how
long the compute beside the exchange runs (the window a Trans launched at a boundary stays in
flight before a layer waits for it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

D_MODEL, D_EXPERT, PER_RANK, ROWS = 128, 1024, 8, 512
MODES = ("exchange", "compute", "both")


LAYOUTS = ("ring", "pair", "single")


def replica_holders(layout: str, world: int) -> list[tuple[int, int]]:
    """`(holder rank, expert)` of each replica: `ring`, every rank one of the next rank's first
    expert (each rank sends one and receives one); `pair`, rank 0 two of rank 1's experts (all
    bytes one way, twice `single`'s); `single`, rank 0 one of rank 1's first expert."""
    if layout == "ring":
        return [(r, ((r + 1) % world) * PER_RANK) for r in range(world)]
    if layout == "pair":
        return [(0, PER_RANK), (0, PER_RANK + 1)]
    if layout == "single":
        return [(0, PER_RANK)]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _rank(rank: int, world: int, rounds: int, repeats: int, layout: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    from poise.core.placement import Placement
    from poise.nn.slots import slot_maps
    from poise.runtime.moves import exchange as ex
    from poise.runtime.moves import transfers as tr

    torch.set_num_threads(1)
    holders = replica_holders(layout, world)
    slots = PER_RANK + max(sum(h == r for h, _ in holders) for r in range(world))
    shapes = [(slots, D_MODEL, D_EXPERT), (slots, D_MODEL, D_EXPERT), (slots, D_EXPERT, D_MODEL)]
    params = [torch.randn(*s) for s in shapes]
    grads = [torch.randn(*s) for s in shapes]
    home = np.repeat(np.arange(world), PER_RANK)
    placement = Placement.from_homes(home[None], world, slots)
    for holder, expert in holders:
        placement.copies[0, holder, expert] = 1
    maps = slot_maps(placement, 0, slots)
    trans_routes, agg_routes = ex.trans_routes(maps), ex.agg_routes(maps)
    x = torch.randn(ROWS, D_MODEL)
    w_in, w_gate, w_out = (p[0] for p in params)

    def compute() -> None:
        for _ in range(repeats):
            (F.silu(x @ w_gate) * (x @ w_in)) @ w_out

    def launch() -> tuple[Any, Any]:
        return (
            tr.trans_async(params, maps, rank, routes=trans_routes),
            tr.agg_async(grads, maps, rank, routes=agg_routes),
        )

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "exchange":
                trans = tr.trans_async(params, maps, rank, routes=trans_routes)
                trans.wait()
                tr.agg_async(grads, maps, rank, routes=agg_routes).wait()
            elif mode == "compute":
                compute()
            else:
                trans, agg = launch()
                compute()
                trans.wait()
                agg.wait()
            times[mode].append(time.perf_counter() - t0)
    return {"times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=6, help="expert forwards per compute")
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=LAYOUTS,
        default=["ring"],
        help="where the replicas are (`replica_holders`); one line per layout and world size",
    )
    args = parser.parse_args()
    from poise.runtime.launch import run_ranks

    for world, layout in ((w, lay) for w in args.worlds for lay in args.layouts):
        results = run_ranks(_rank, world, args.rounds, args.repeats, layout)
        t = {m: np.array([r["times"][m] for r in results])[:, 1:] for m in MODES}  # [W, rounds]
        slowest = {m: float(np.median(t[m].max(axis=0))) for m in MODES}
        exposed = float(np.median((t["both"] - t["compute"]).max(axis=0)))
        print(
            json.dumps(
                {
                    "bench": "contended_exchange",
                    "ranks": world,
                    "layout": layout,
                    "cores": os.cpu_count(),
                    "exchange_ms": round(1e3 * slowest["exchange"], 3),
                    "compute_ms": round(1e3 * slowest["compute"], 3),
                    "both_ms": round(1e3 * slowest["both"], 3),
                    "exposed_ms": round(1e3 * exposed, 3),
                    "exposed_vs_alone": round(exposed / slowest["exchange"], 3),
                    "calls": int(t["both"].shape[1]),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
