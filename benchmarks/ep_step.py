"""Expert-parallel training step time, static EP against the Balancer, on skewed routing.

    .venv/bin/python benchmarks/ep_step.py            # 2 gloo ranks, 1 thread each, < 2 min

Two ranks, one intra-op thread each, fp32. Each rank runs a residual stack of `--layers` MoE
layers (SwiGLU experts, d_model 128, d_expert 1024, 32 experts, top-2, 1,024 tokens per rank
and step, 16 + 2 slots per rank) whose routers are `ReplayRouter`s: each layer's per-expert counts
follow a recorded trace, scaled to the batch. A step is forward, `(y * g).sum()` backward, router
gradients summed over ranks, AdamW step.

Traces (one JSON line each):

- `smartmoe-5001`: the SmartMoE-AE sample (`../shared/data/smartmoe-ae-sample`, 16 ranks,
  24 layers, 32 experts, top-2), iteration 5001, reduced to 2 source ranks as the simulator does
  (`sim.scaling.ScaledTrace`: a seeded sample of the observed rows), layers 0, 8, 15 and 23
  (evenly spaced) for a 4-layer stack;
- `zipf-1.2`: `trace_generate.zipf` with s = 1.2 (expert popularity by a random permutation per
  layer, the same on both ranks).

Three models are stepped in rotation, one step each per round (the first to go rotating too), so
machine noise hits all alike:

- `static`: plain static EP (no Balancer);
- `balanced`: the same model under `Balancer(policy, replan_every)`, default `auto` every 5 steps,
  priced on the `cpu-2` modelled cluster; its time includes Trans, Agg, planning and migration;
- `ideal`: static EP on uniform routing (every rank computes exactly the mean load, and there
  is nothing to transfer): perfectly balanced compute at no transfer cost.

Each rank times its own steps from a common start (a barrier); a step's time is the slowest
rank's. `*_ms` are medians over the timed steps, after a warm-up that includes the first plan;
`speedup` and `ideal_speedup` are medians over rounds of static / balanced and static / ideal
(steps of one round run back to back, so they share the machine's load); `fraction_of_ideal =
speedup / ideal_speedup`; `gain_fraction = (speedup - 1) / (ideal_speedup - 1)` is the share of
the possible gain achieved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from poise.runtime.launch import run_ranks

SMARTMOE_LAYERS = (0, 8, 15, 23)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_data = os.environ.get(
        "POISE_SHARED_DATA", str(Path(__file__).resolve().parents[1].parent / "shared" / "data")
    )
    p.add_argument("--data", default=default_data, help="folder with smartmoe-ae-sample/")
    p.add_argument("--traces", nargs="+", default=["smartmoe-5001", "zipf-1.2"])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank and step")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-expert", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--spare-slots", type=int, default=2)
    p.add_argument("--policy", default="auto")
    p.add_argument("--replan-every", type=int, default=5)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps (the first plan included)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model")
    p.add_argument("--world", type=int, default=2)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------- traces
def load_trace(name: str, args: argparse.Namespace) -> Any:
    """`Trace` `[1, layers, world, experts]` for the named case."""
    from poise.sim.scaling import ScaledTrace
    from poise.trace.generate import generate
    from poise.trace.importers import load_any
    from poise.trace.trace import Trace

    if name == "smartmoe-5001":
        sample = load_any(str(Path(args.data) / "smartmoe-ae-sample"))
        if args.layers > len(SMARTMOE_LAYERS) or sample.experts != args.experts:
            raise SystemExit("smartmoe-5001 needs --layers <= 4 and --experts 32")
        layers = list(SMARTMOE_LAYERS[: args.layers])
        scaled = ScaledTrace.create(sample.counts[-1:, layers], args.world, seed=0)
        counts = scaled.step(0).astype(np.int64)[None]
        return Trace(counts, np.array([int(sample.step_ids[-1])]), sample.top_k,
                     int(counts.sum(axis=3).max()), name=name)  # fmt: skip
    if name.startswith("zipf-"):
        return generate("zipf", steps=1, layers=args.layers, devices=args.world,
                        experts=args.experts, top_k=args.top_k, tokens_per_device=args.tokens,
                        seed=0, s=float(name.removeprefix("zipf-")), name=name)  # fmt: skip
    if name == "uniform":
        per = args.tokens * args.top_k // args.experts
        counts = np.full((1, args.layers, args.world, args.experts), per, dtype=np.int64)
        return Trace(counts, np.array([0]), args.top_k, args.tokens, name=name)
    raise SystemExit(f"unknown trace {name!r} (smartmoe-5001, zipf-S, uniform)")


# ----------------------------------------------------------------------------------- ranks
def _model(args: argparse.Namespace, trace: Any, rank: int) -> Any:
    import torch
    import torch.distributed as dist

    from poise.nn import MoE, MoEConfig, ReplayRouter, apply_expert_parallel

    torch.manual_seed(0)  # routers alike on every rank
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        [
            MoE(MoEConfig(args.d_model, args.d_expert, args.experts, args.top_k, init_seed=layer),
                router=ReplayRouter(args.d_model, args.experts, args.top_k, trace,
                                    layer=layer, rank=rank))
            for layer in range(args.layers)
        ]
    )  # fmt: skip
    slots = args.experts // args.world + args.spare_slots
    apply_expert_parallel(model, dist.group.WORLD, num_slots=slots)
    return model


class _Runner:
    """One model, its optimizer and (optionally) its Balancer, stepped one step at a time."""

    def __init__(self, args: argparse.Namespace, trace: Any, rank: int, policy: str | None):
        import torch

        from poise.runtime.balancer import Balancer

        self.model = _model(args, trace, rank)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.balancer = (
            Balancer(self.model, self.opt, policy, replan_every=args.replan_every)
            if policy
            else None
        )
        gen = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(args.tokens, args.d_model, generator=gen)
        self.g = torch.randn(args.tokens, args.d_model, generator=gen)
        self.times: list[float] = []

    def step(self) -> None:
        import torch.distributed as dist

        from poise.nn import sync_router_grads

        dist.barrier()
        t0 = time.perf_counter()
        y = self.x
        for block in self.model.blocks:
            y = y + block(y)
        (y * self.g).sum().backward()
        sync_router_grads(self.model)
        if self.balancer is not None:
            self.balancer.reduce_replicas()
        self.opt.step()
        if self.balancer is not None:
            self.balancer.step()
        self.opt.zero_grad()
        self.times.append(time.perf_counter() - t0)


def _rank(rank: int, world: int, args: argparse.Namespace, name: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    runners = {
        "static": _Runner(args, load_trace(name, args), rank, None),
        "balanced": _Runner(args, load_trace(name, args), rank, args.policy),
        "ideal": _Runner(args, load_trace("uniform", args), rank, None),
    }
    order = list(runners)
    for r in range(args.warmup + args.steps):
        for key in order[r % 3 :] + order[: r % 3]:  # rotate who goes first
            runners[key].step()
    out: dict[str, Any] = {}
    for key, runner in runners.items():
        t = torch.tensor(runner.times[args.warmup :], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank ends
        out[key] = t.tolist()
    balancer = runners["balanced"].balancer
    assert balancer is not None
    stats = list(balancer.stats)[args.warmup :]
    out["stats"] = {
        "max_over_mean": float(np.mean([np.mean(s.max_over_mean) for s in stats])),
        "static_max_over_mean": float(np.mean(balancer.stats[0].max_over_mean)),
        "bytes_per_step": float(
            np.mean([s.trans_bytes + s.agg_bytes + s.migrate_bytes for s in stats])
        ),
        "seconds": {
            k: float(np.mean([s.seconds.get(k, 0.0) for s in stats]))
            for k in ("gate", "dispatch", "experts", "combine", "transfers", "plan")
        },
        "replicas": int(balancer.plan.placement.replicas().sum()),
        "moved_homes": int(sum(s.moved_homes for s in balancer.stats)),
    }
    return out


def run_trace(name: str, args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    res = run_ranks(_rank, args.world, args, name, timeout_s=600)[0]
    static = statistics.median(res["static"]) * 1e3
    balanced = statistics.median(res["balanced"]) * 1e3
    ideal = statistics.median(res["ideal"]) * 1e3
    rounds = list(zip(res["static"], res["balanced"], res["ideal"], strict=True))
    speedup = statistics.median(s / b for s, b, _ in rounds)
    ideal_speedup = statistics.median(s / i for s, _, i in rounds)
    st = res["stats"]
    return {
        "bench": "ep_step",
        "trace": name,
        "static_ms": round(static, 2),
        "balanced_ms": round(balanced, 2),
        "ideal_ms": round(ideal, 2),
        "speedup": round(speedup, 3),
        "ideal_speedup": round(ideal_speedup, 3),
        "fraction_of_ideal": round(speedup / ideal_speedup, 3),
        "gain_fraction": round((speedup - 1) / (ideal_speedup - 1), 3)
        if ideal_speedup > 1
        else None,
        "policy": args.policy,
        "replan_every": args.replan_every,
        "max_over_mean_static": round(st["static_max_over_mean"], 3),
        "max_over_mean_balanced": round(st["max_over_mean"], 3),
        "replicas": st["replicas"],
        "moved_homes": st["moved_homes"],
        "transfer_bytes_per_step": round(st["bytes_per_step"]),
        "balanced_ms_by_phase": {k: round(v * 1e3, 2) for k, v in st["seconds"].items()},
        # Other processes on this machine take CPU from the ranks and hide their imbalance.
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in args.traces:
        print(json.dumps(run_trace(name, args)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
