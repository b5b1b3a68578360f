"""A switch's re-lay: `transfers.migrate` moving one expert's home, with and without stable slots.

    .venv/bin/python benchmarks/migrate.py          # 2 gloo ranks, 1 thread each, ~20 s

Two ranks, one MoE layer's stacked SwiGLU expert tensors as in `train_speedup`'s `many-experts`
setting (d_model 128, d_expert 512, fp32, 32 experts, 16 + 1 slots per rank) with AdamW moments
after one step. The plan moves expert 0's home from rank 0 to rank 1 (the other 31 stay), then
moves it back, alternately; each direction is one `migrate` call (homes only, as
`Balancer.apply` calls it). Slot maps:

- `canonical`: `slot_maps(placement)`, homes in expert order on every rank: expert 0 leaving
  rank 0 shifts its 15 other homes down a slot, and arriving first on rank 1 shifts all 16 up;
- `stable`: `slot_maps(placement, previous=maps in force)` (what the Balancer uses): homes that
  stay keep their slots, so the move re-lays about three rows.

Rounds rotate the two variants; one JSON line each with the median seconds per `migrate`, the
rows it rewrote on each rank (`Migration.relaid_rows`, rank 0's and rank 1's, from the first
call), and `ratio_vs_canonical` (median over rounds of this variant's time over canonical's).

Then the path the rows take: `--homes` experts of each rank (default 8 of 16) swap ranks and
swap back (stable slot maps, homes with their moments), each direction one `migrate` through
gloo's all-to-all in fresh buffers (`gloo`), through gloo with the packed rows in buffers kept
between calls (`gloo-reused`, `transfers.Scratch`, as the Balancer migrates by default) or
through shared memory (`link`, a `HostLink` channel, as the Balancer migrates with
`host_link`), rounds rotating the three. One JSON line per path: the median ms per call, the MB
moved (all ranks), and `ratio_vs_gloo` (median over rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

SLOTS, D_MODEL, D_EXPERT, EXPERTS = 17, 128, 512, 32
PATHS = ("gloo", "gloo-reused", "shared-memory")
ROUNDS_PATHS = 6


def _rank(rank: int, world: int, rounds: int, homes: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from poise.core.placement import Placement
    from poise.nn.slots import slot_maps
    from poise.runtime.moves import transfers as tr

    shapes = [(SLOTS, D_MODEL, D_EXPERT), (SLOTS, D_MODEL, D_EXPERT), (SLOTS, D_EXPERT, D_MODEL)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    home = np.repeat(np.arange(world), EXPERTS // world)
    moved = home.copy()
    moved[0] = 1
    static = Placement.from_homes(home[None], world, SLOTS)
    other = Placement.from_homes(moved[None], world, SLOTS)
    times: dict[str, list[float]] = {"canonical": [], "stable": []}
    relaid: dict[str, int] = {}
    for r in range(rounds):
        order = ["canonical", "stable"] if r % 2 == 0 else ["stable", "canonical"]
        for name in order:
            maps = slot_maps(static, 0, SLOTS)
            for target in (other, static):
                keep = maps if name == "stable" else None
                new = slot_maps(target, 0, SLOTS, previous=keep)
                dist.barrier()
                t0 = time.perf_counter()
                m = tr.migrate(params, opt, maps, new, rank, fill_replicas=False)
                times[name].append(time.perf_counter() - t0)
                relaid.setdefault(name, m.relaid_rows)
                maps = new
    paths = _paths(params, opt, home, world, homes)
    return {"times": times, "relaid": relaid, "paths": paths}


def _paths(params: list, opt: Any, home: np.ndarray, world: int, homes: int) -> dict[str, Any]:
    """`migrate` of `homes` experts each way per call, through gloo and through shared memory
    (module docstring): per path the seconds of each call, and the bytes moved."""
    import torch.distributed as dist

    from poise.core.placement import Placement
    from poise.nn.slots import slot_maps
    from poise.runtime.moves import transfers as tr
    from poise.runtime.moves.exchange import Scratch
    from poise.runtime.moves.host_link import HostLink

    per_rank = EXPERTS // world
    swapped = home.copy()
    for r in range(world):  # the first `homes` experts of each rank go to the next rank
        swapped[r * per_rank : r * per_rank + homes] = (r + 1) % world
    layouts = [Placement.from_homes(h[None], world, SLOTS) for h in (home, swapped)]
    link = HostLink.connect()
    assert link is not None, "the ranks do not share memory"
    channels = {"gloo": None, "gloo-reused": None, "shared-memory": link.channel("migrate")}
    scratch = {"gloo-reused": Scratch()}
    times: dict[str, list[float]] = {p: [] for p in channels}
    moved = 0
    maps = slot_maps(layouts[0], 0, SLOTS)
    for r in range(ROUNDS_PATHS):
        for path in PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]:
            for target in (layouts[1], layouts[0]):
                new = slot_maps(target, 0, SLOTS, previous=maps)
                dist.barrier()
                t0 = time.perf_counter()
                m = tr.migrate(params, opt, maps, new, dist.get_rank(), link=channels[path],
                               scratch=scratch.get(path))  # fmt: skip
                times[path].append(time.perf_counter() - t0)
                moved = m.home_total_bytes
                maps = new
    return {"times": times, "bytes": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--homes", type=int, default=8, help="homes of each rank that swap")
    args = parser.parse_args()
    if not 0 < args.homes <= EXPERTS // 2:
        parser.error(f"--homes: must be in [1, {EXPERTS // 2}], got {args.homes}")
    from poise.runtime.launch import run_ranks

    results = run_ranks(_rank, 2, args.rounds, args.homes)
    # a call's time is the slower rank's
    per_call = {
        name: np.maximum(*(np.asarray(r["times"][name]) for r in results))
        for name in ("canonical", "stable")
    }
    for name, t in per_call.items():
        ratios = t / per_call["canonical"]
        print(
            json.dumps(
                {
                    "bench": "migrate",
                    "slots": name,
                    "median_ms": round(1e3 * statistics.median(t.tolist()), 2),
                    "relaid_rows": [r["relaid"][name] for r in results],
                    "ratio_vs_canonical": round(statistics.median(ratios.tolist()), 3),
                    "calls": int(t.size),
                }
            ),
            flush=True,
        )

    call = {p: np.maximum(*(np.asarray(r["paths"]["times"][p]) for r in results)) for p in PATHS}
    for path, t in call.items():
        per_round = {p: call[p].reshape(ROUNDS_PATHS, -1).mean(axis=1) for p in PATHS}
        print(
            json.dumps(
                {
                    "bench": "migrate",
                    "path": path,
                    "homes_moved": 2 * args.homes,
                    "mb_moved": round(results[0]["paths"]["bytes"] / 1e6, 1),
                    "median_ms": round(1e3 * statistics.median(t.tolist()), 2),
                    "ratio_vs_gloo": round(
                        statistics.median((per_round[path] / per_round["gloo"]).tolist()), 3
                    ),
                    "calls": int(t.size),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
