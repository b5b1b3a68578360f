"""Parm's schedules in the torch runtime: forward + backward time of MP + EP + ESP per schedule.

    .venv/bin/python benchmarks/parm_step.py          # 4 gloo ranks, 1 thread each, ~1 min

Four ranks on this machine's CPU (gloo, fp32), MP = ESP = 2: two "nodes" of two ranks, EP = 2
across them (`poise.runtime.parm.groups`). Each node runs its own batch of `--batch` x
`--seq` tokens through a pre-norm block (model-parallel attention, `--heads` heads, then a
`ParallelMoE`: `--experts` SwiGLU experts of width `--d-expert`, top-`--top-k`, dropless), with
the same weights under every schedule:

- `baseline`: DeepSpeed-MoE's MP + EP + ESP (the node's tokens duplicated through gate, EP
  all-to-all, ESP all-gather and experts);
- `s1`, `s2`: Parm's two schedules (MP paused around the MoE layer; S1 EP all-to-all then ESP
  collectives, S2 one all-to-all over the world);
- `auto`: the schedule `ParmChooser` picks (Parm's alpha-beta condition, `poise.layouts.parm`, on
  the
  modelled cluster of this run unless told otherwise), reported as `chosen`.

A step is `(y * g).sum().backward()` after the forward. The schedules are stepped in rotation,
one step each per round (who goes first rotating), so machine noise hits all alike. Each rank
times its own steps from a common start (a barrier); a step lasts until its slowest rank ends.
One JSON line per schedule: `ms` the median forward + backward time of the MoE layer alone,
`block_ms` that of the whole block (attention included, which no schedule changes),
`speedup_vs_baseline` the median over rounds of baseline / schedule for the MoE layer (steps of
one round share the machine's load) and `block_speedup_vs_baseline` the same for the block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from poise.runtime.launch import run_ranks

SCHEDULES = ("baseline", "s1", "s2", "auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mp", type=int, default=2, help="MP degree = ESP degree (ranks per node)")
    p.add_argument("--batch", type=int, default=4, help="samples per node and step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sample")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-expert", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    p.add_argument("--steps", type=int, default=10, help="timed rounds")
    return p.parse_args(argv)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from poise.models.gpt import GPTConfig, rotary_tables
    from poise.runtime.parm.groups import ParallelGroups
    from poise.runtime.parm.layer import parallel_block

    cfg = GPTConfig(
        d_model=args.d_model,
        heads=args.heads,
        d_expert=args.d_expert,
        num_experts=args.experts,
        top_k=args.top_k,
        context=args.seq,
    )
    groups = ParallelGroups.build(mp=args.mp)
    cos, sin = rotary_tables(cfg.context, cfg.head_dim, cfg.rope_base)
    blocks = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)  # the same weights under every schedule, alike on every rank
        blocks[schedule] = parallel_block(cfg, groups, schedule=schedule, init_seed=1)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(100 + groups.node)  # one batch per node
    x = torch.randn(args.batch, args.seq, args.d_model, generator=gen)
    g = torch.randn(args.batch, args.seq, args.d_model, generator=gen)
    moe_in = torch.randn(args.batch, args.seq, args.d_model, generator=gen)

    def block_step(block: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        xi = x.clone().requires_grad_()
        (block(xi, cos, sin) * g).sum().backward()
        return time.perf_counter() - t0

    def moe_step(block: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        xi = moe_in.clone().requires_grad_()
        (block.ffn(xi) * g).sum().backward()
        return time.perf_counter() - t0

    times: dict[str, dict[str, list[float]]] = {s: {"moe": [], "block": []} for s in SCHEDULES}
    for r in range(args.warmup + args.steps):
        order = SCHEDULES[r % len(SCHEDULES) :] + SCHEDULES[: r % len(SCHEDULES)]
        for kind, step in (("moe", moe_step), ("block", block_step)):
            for schedule in order:
                t = step(blocks[schedule])
                if r >= args.warmup:
                    times[schedule][kind].append(t)
    out: dict[str, Any] = {}
    for schedule, kinds in times.items():
        out[schedule] = {}
        for kind, ts in kinds.items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank ends
            out[schedule][kind] = t.tolist()
        out[schedule]["chosen"] = blocks[schedule].ffn.last_schedule
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    res = run_ranks(_rank, args.world, args, threads=args.threads, timeout_s=900)[0]
    base = res["baseline"]
    for schedule in SCHEDULES:
        r = res[schedule]
        line = {
            "bench": "parm_step",
            "schedule": schedule,
            "chosen": r["chosen"],
            "mp": args.mp,
            "esp": args.mp,
            "ep": args.world // args.mp,
            "world": args.world,
            "tokens_per_node": args.batch * args.seq,
            "d_model": args.d_model,
            "d_expert": args.d_expert,
            "experts": args.experts,
            "top_k": args.top_k,
            "ms": round(statistics.median(r["moe"]) * 1e3, 2),
            "block_ms": round(statistics.median(r["block"]) * 1e3, 2),
            "speedup_vs_baseline": round(
                statistics.median(b / t for b, t in zip(base["moe"], r["moe"], strict=True)), 3
            ),
            "block_speedup_vs_baseline": round(
                statistics.median(b / t for b, t in zip(base["block"], r["block"], strict=True)),
                3,
            ),
            "rounds": args.steps,
            "threads_per_rank": args.threads,
            "load_before": round(load_before, 2),
            "cpus": os.cpu_count(),
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
