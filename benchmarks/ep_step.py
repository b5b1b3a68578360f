"""Expert-parallel step time, static EP against the Balancer, on recorded and skewed routing.

    .venv/bin/python benchmarks/ep_step.py            # 2 gloo ranks, 1 thread each, ~4 min

Two ranks each run a residual stack of `--layers` MoE layers (SwiGLU experts, d_model 128,
d_expert 1024, 32 experts top-2, 1,024 tokens a rank and step, 16 + 2 slots a rank) whose
routers replay a trace's per-expert counts (`ReplayRouter`), then a linear loss's backward (its
sign alternating, so the weights stay bounded), the routers' gradient sum and `HomeRowsAdamW`.
Traces: `smartmoe-5001` (the SmartMoE-AE sample, iteration 5001, layers 0, 8, 15, 23, reduced
to 2 source ranks) and `zipf-1.2` (generated). Models stepped in rotation, one step each a round:

- `static`: plain EP; `balanced`: the same under `Balancer(--policy, --replan-every)` (default
  `auto` every 5 steps; probe steps off, `--probe-every 0`: a 40-step window is too short for
  them), its time including Trans, Agg, planning and migration;
- `ideal`: static EP with each layer's loads re-dealt so that every rank's homes hold an even
  share (`poise.report.ideal_homes`); `uniform`: every expert at the mean load;
- peers where the `bench` extra is installed: DeepSpeed-MoE (dropless and capacity 1.25) and
  torchtitan's MoE, on the same tokens and expert choices; `--compare POLICY ...`: more
  Balancer policies in the same rotation.

One JSON line per trace and model. A step's time is the slowest rank's; `*_ms` are medians over
the `--steps` (40) timed steps after `--warmup` (default `2 x replan_every + 1`: the first
adoptions); `speedup`, `ideal_speedup` are medians over rounds of static / model;
`gain_fraction = (speedup - 1) / (ideal_speedup - 1)`, `gain_fraction_90` its central 90% over
2,000 bootstrap resamples of the rounds (how far the machine's noise moves it); `target_met`:
`gain_fraction >= GAIN_TARGET`, `target_met_90`: the interval's lower end too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from peers import deepspeed_note, torchtitan_note
from poise.runtime.launch import run_ranks

SMARTMOE_LAYERS = (0, 8, 15, 23)
GAIN_TARGET = 0.85  # issue 18: the judged line's gain fraction on each trace
PEERS = {"deepspeed": ("deepspeed-nodrop", "deepspeed-drop"), "torchtitan": ("torchtitan",)}
FEATURE = 16.0  # routing feature of a token's second expert (first: 2x), against |y| of a few


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
    from poise.train.config import POLICIES

    p.add_argument("--policy", default="auto", choices=POLICIES)
    p.add_argument(
        "--compare",
        nargs="*",
        default=[],
        choices=POLICIES,
        metavar="POLICY",
        help="more Balancer policies stepped in the same rotation, one line each (not judged)",
    )
    p.add_argument("--replan-every", type=int, default=5)
    p.add_argument(
        "--probe-every",
        type=int,
        default=0,
        help="the probe steps (default 0: off; the module docstring says why)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps (default 2 x replan-every + 1: the first adoption included)",
    )
    p.add_argument(
        "--steps", type=int, default=40, help="timed steps per model (module docstring: why 40)"
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--capacity-factor", type=float, default=1.25, help="DeepSpeed-MoE with dropping"
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed-MoE")
    p.add_argument("--no-torchtitan", action="store_true", help="skip torchtitan's MoE")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = first_adoption_warmup(args.replan_every)
    return args


def first_adoption_warmup(replan_every: int) -> int:
    """Untimed steps that hold the Balancer's first adoptions: at the first re-plan a homes move
    is adopted only as far as a plan from the window's older half held on its newer half (the
    forecast's miss, `poise.runtime.control.job.forecast_miss`), at the second as far as the
    first one's held on the steps since; each decided one step after its request (the planner's
    lag), so `2 * replan_every + 1`."""
    return 2 * replan_every + 1


def peer_notes(args: argparse.Namespace) -> dict[str, str]:
    """Per peer package, "" when it runs here, else why not ("... not installed", "skipped")."""
    return {
        "deepspeed": "skipped (--no-deepspeed)" if args.no_deepspeed else deepspeed_note(),
        "torchtitan": "skipped (--no-torchtitan)" if args.no_torchtitan else torchtitan_note(),
    }


def peer_systems(notes: dict[str, str]) -> list[str]:
    """The peer systems (`PEERS`' names) whose package runs here."""
    return [name for pkg, names in PEERS.items() if not notes[pkg] for name in names]


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
    if name.startswith("ideal:"):  # the named trace, its loads dealt evenly to the ranks' homes
        return ideal_trace(load_trace(name.removeprefix("ideal:"), args), args.world)
    if name == "uniform":
        per = args.tokens * args.top_k // args.experts
        counts = np.full((1, args.layers, args.world, args.experts), per, dtype=np.int64)
        return Trace(counts, np.array([0]), args.top_k, args.tokens, name=name)
    raise SystemExit(f"unknown trace {name!r} (smartmoe-5001, zipf-S, uniform, ideal:NAME)")


def ideal_trace(trace: Any, world: int) -> Any:
    """`trace` with each layer's expert loads re-dealt to the experts so that static EP's
    contiguous homes hold an even share per rank (`poise.report.ideal_homes.balanced_order`
    on the loads summed over steps and source ranks): every expert's load, and so every GEMM's
    shape, is one the trace has; only which rank holds it changes."""
    from poise.report.ideal_homes import balanced_order
    from poise.trace.trace import Trace

    order = balanced_order(trace.counts.sum(axis=(0, 2)), world)  # [L, E]
    counts = np.take_along_axis(trace.counts, order[None, :, None, :], axis=3)
    return Trace(counts, trace.step_ids, trace.top_k, trace.tokens_per_device,
                 name=f"ideal:{trace.name}")  # fmt: skip


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


def _routing_features(
    args: argparse.Namespace, trace: Any, rank: int
) -> tuple[list[Any], list[np.ndarray]]:
    """Per layer, `f_l [T, D]`: `2 * FEATURE` in column e1 and `FEATURE` in column e2 of each
    token, its first and second expert as this rank's `ReplayRouter` for layer l chooses them;
    and per layer the `[E]` assignments per expert."""
    import torch

    from poise.nn import ReplayRouter

    if args.top_k != 2 or args.experts > args.d_model:
        raise SystemExit("the peers need --top-k 2 and --experts <= --d-model")
    feats, counts = [], []
    for layer in range(args.layers):
        router = ReplayRouter(args.d_model, args.experts, args.top_k, trace, layer=layer, rank=rank)
        choices = router.select(torch.zeros(args.tokens, args.experts))
        f = torch.zeros(args.tokens, args.d_model)
        rows = torch.arange(args.tokens)
        f[rows, choices[:, 0]] = 2 * FEATURE
        f[rows, choices[:, 1]] = FEATURE
        feats.append(f)
        counts.append(np.bincount(choices.reshape(-1).numpy(), minlength=args.experts))
    return feats, counts


def _peer_model(args: argparse.Namespace, system: str) -> Any:
    """`blocks`: one peer MoE layer per layer, SwiGLU experts, the gate reading columns `:E`."""
    import torch
    import torch.distributed as dist

    from peers import DeepSpeedLayer, TorchtitanLayer, init_deepspeed_comm

    torch.manual_seed(0)  # gates and replicated weights alike on every rank
    gate = torch.zeros(args.experts, args.d_model)
    gate[:, : args.experts] = torch.eye(args.experts)
    dims = (args.d_model, args.d_expert, args.experts, args.top_k, gate)
    if system.startswith("deepspeed"):
        init_deepspeed_comm()
        drop = system == "deepspeed-drop"
        cf = args.capacity_factor if drop else 1.0
        ep = dist.get_world_size()
        make = lambda: DeepSpeedLayer(  # noqa: E731
            *dims, drop=drop, capacity_factor=cf, activation="swiglu", ep_size=ep
        )
    else:
        make = lambda: TorchtitanLayer(*dims)  # noqa: E731
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([make() for _ in range(args.layers)])
    return model


def loss_sign(step: int) -> float:
    """The sign of step `step`'s loss (module docstring): +1 on even steps, -1 on odd ones."""
    return -1.0 if step % 2 else 1.0


class _PeerRunner:
    """A peer's stack on this rank's tokens and routing: forward, backward, gate gradients
    summed over the ranks, AdamW step (expert parameters local to the rank)."""

    def __init__(self, args: argparse.Namespace, trace: Any, rank: int, system: str) -> None:
        import torch

        self.system = system
        self.model = _peer_model(args, system)
        self.feats, self.want = _routing_features(args, trace, rank)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        gen = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(args.tokens, args.d_model, generator=gen)
        self.g = torch.randn(args.tokens, args.d_model, generator=gen)
        self.capacity_factor = args.capacity_factor
        self.times: list[float] = []
        self.rows: list[int] = []  # per layer, expert rows this rank computes (DeepSpeed)
        self.dropped: list[float] = []  # per layer, share of this rank's assignments dropped

    def _replicated(self) -> list[Any]:
        from peers import DeepSpeedLayer

        out = []
        for block in self.model.blocks:
            if isinstance(block, DeepSpeedLayer):
                out += block.replicated_parameters()
            else:
                out += list(block.moe.router.parameters())
        return out

    def step(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        y = self.x
        for block, f in zip(self.model.blocks, self.feats, strict=True):
            y = y + block(y + f)[0]
        (y * self.g).sum().mul(loss_sign(len(self.times))).backward()
        for p in self._replicated():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        self.opt.step()
        self.opt.zero_grad()
        self.times.append(time.perf_counter() - t0)
        if len(self.times) == 1:  # routed as Poise's ReplayRouters (before any drop)
            self._check_routing()

    def _check_routing(self) -> None:
        """Assert every layer routed as Poise's `ReplayRouter`s (counts before any drop) and
        record DeepSpeed's expert rows per rank (`E * capacity`, as its all-to-all pads)."""
        import torch
        import torch.distributed as dist

        from peers import DeepSpeedLayer

        y = self.x
        with torch.no_grad():
            blocks = zip(self.model.blocks, self.feats, self.want, strict=True)
            for layer, (block, f, want) in enumerate(blocks):
                out = block(y + f)[0]
                if isinstance(block, DeepSpeedLayer):
                    got = block.last_counts
                    if self.system == "deepspeed-drop":
                        cap = math.ceil(self.capacity_factor * want.sum() / want.size)
                        self.dropped.append(float(np.maximum(want - cap, 0).sum() / want.sum()))
                    else:
                        top = torch.tensor(float(want.max()))
                        dist.all_reduce(top, op=dist.ReduceOp.MAX)
                        cap = int(top)
                    self.rows.append(cap * want.size)
                else:
                    got = block.counts(y + f)
                assert got is not None and (got.cpu().numpy() == want).all(), (self.system, layer)
                y = y + out


class _Runner:
    """One model, its optimizer and (optionally) its Balancer, stepped one step at a time."""

    def __init__(self, args: argparse.Namespace, trace: Any, rank: int, policy: str | None):
        import torch

        from poise.runtime.balancer import Balancer, BalancerConfig
        from poise.runtime.home_optimizer import HomeRowsAdamW, home_rows

        self.model = _model(args, trace, rank)
        self.opt = HomeRowsAdamW(self.model.parameters(), home_rows(self.model), lr=1e-4)
        self.balancer = (
            Balancer(
                self.model,
                self.opt,
                policy,
                args.replan_every,
                BalancerConfig(probe_every=args.probe_every),
            )
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
        (y * self.g).sum().mul(loss_sign(len(self.times))).backward()
        sync_router_grads(self.model)
        if self.balancer is not None:
            self.balancer.reduce_replicas()
        self.opt.step()
        if self.balancer is not None:
            self.balancer.step()
        self.opt.zero_grad()
        self.times.append(time.perf_counter() - t0)


def balancer_stats(balancer: Any, warmup: int) -> dict[str, Any]:
    """What a balanced model's Balancer did over the timed steps (after `warmup`)."""
    stats = list(balancer.stats)[warmup:]
    return {
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
        "probe_steps": int(sum(s.probe for s in stats)),
        # plan switches inside the timed steps: a migration there is one-off work the window
        # charges in full (a long run pays it once)
        "switches": [
            {
                "after_step": s.step + 1,  # 1-based: the step whose boundary switched
                "moved_homes": s.moved_homes,
                "migrate_mb": round(s.migrate_bytes / 1e6, 1),
                "migrate_ms": round(s.seconds.get("migrate", 0.0) * 1e3, 1),
            }
            for s in stats
            if s.switched
        ],
    }


def _rank(rank: int, world: int, args: argparse.Namespace, name: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    runners = {
        "static": _Runner(args, load_trace(name, args), rank, None),
        "balanced": _Runner(args, load_trace(name, args), rank, args.policy),
        "ideal": _Runner(args, load_trace(f"ideal:{name}", args), rank, None),
        "uniform": _Runner(args, load_trace("uniform", args), rank, None),
    }
    for policy in getattr(args, "compare", []):
        runners[f"balanced:{policy}"] = _Runner(args, load_trace(name, args), rank, policy)
    for system in getattr(args, "peers", []):
        runners[system] = _PeerRunner(args, load_trace(name, args), rank, system)
    order = list(runners)
    n = len(order)
    for r in range(args.warmup + args.steps):
        for key in order[r % n :] + order[: r % n]:  # rotate who goes first
            runners[key].step()
    out: dict[str, Any] = {}
    for key, runner in runners.items():
        t = torch.tensor(runner.times[args.warmup :], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank ends
        out[key] = t.tolist()
    peers = {k: r for k, r in runners.items() if isinstance(r, _PeerRunner)}
    out["peer_rows"] = {k: r.rows for k, r in peers.items() if r.rows}
    dropped = {k: torch.tensor(r.dropped).mean() for k, r in peers.items() if r.dropped}
    for t in dropped.values():
        dist.all_reduce(t)  # mean over the ranks
    out["peer_dropped"] = {k: float(t) / world for k, t in dropped.items()}
    out["stats"] = {
        key: balancer_stats(runner.balancer, args.warmup)
        for key, runner in runners.items()
        if isinstance(runner, _Runner) and runner.balancer is not None
    }
    return out


def _max_over_mean(trace: Any) -> float:
    """The ranks' slowest over mean load under static homes, mean over layers."""
    per_rank = trace.counts.sum(axis=(0, 2)).reshape(trace.layers, trace.devices, -1).sum(axis=2)
    return float(np.mean(per_rank.max(axis=1) / per_rank.mean(axis=1)))


def gain_fraction(speedup: float, ideal_speedup: float) -> float | None:
    """`(speedup - 1) / (ideal_speedup - 1)`: the share of the possible gain achieved (None
    where the ideal gains nothing)."""
    return (speedup - 1) / (ideal_speedup - 1) if ideal_speedup > 1 else None


def target_verdict(fraction: float | None, interval: list[float] | None) -> dict[str, Any]:
    """The judged line's verdict (module docstring): `target`, `target_met` (the figure at
    least `GAIN_TARGET`; False where the ideal gains nothing) and `target_met_90` (the 90%
    interval's lower end too; None without an interval)."""
    met = fraction is not None and fraction >= GAIN_TARGET
    return {
        "target": GAIN_TARGET,
        "target_met": met,
        "target_met_90": None if interval is None else bool(interval[0] >= GAIN_TARGET),
    }


def gain_fraction_interval(
    static: list[float],
    balanced: list[float],
    ideal: list[float],
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> list[float] | None:
    """The central `level` interval of the gain fraction over bootstrap resamples of the rounds
    (each round's static, balanced and ideal steps drawn together, as they ran together; the
    fraction recomputed from the medians of each resample's ratios, as the line computes it):
    how far the machine's noise alone could move the figure. None with fewer than 3 rounds or
    no resample whose ideal gains anything."""
    s, b, i = (np.asarray(x, dtype=np.float64) for x in (static, balanced, ideal))
    if len(s) < 3:
        return None
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(s), size=(resamples, len(s)))
    speedup = np.median(s[pick] / b[pick], axis=1)
    ideal_speedup = np.median(s[pick] / i[pick], axis=1)
    ok = ideal_speedup > 1
    if not ok.any():
        return None
    fractions = (speedup[ok] - 1) / (ideal_speedup[ok] - 1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(fractions, [tail, 100 - tail])
    return [round(float(lo), 3), round(float(hi), 3)]


def policy_line(
    name: str,
    key: str,
    policy: str,
    res: dict[str, Any],
    args: argparse.Namespace,
    load: list[float],
) -> dict[str, Any]:
    """Poise's line for the balanced model `key` (`policy`) against the same rounds' static,
    ideal and uniform steps."""
    static = statistics.median(res["static"]) * 1e3
    balanced = statistics.median(res[key]) * 1e3
    ideal = statistics.median(res["ideal"]) * 1e3
    rounds = list(zip(res["static"], res[key], res["ideal"], strict=True))
    speedup = statistics.median(s / b for s, b, _ in rounds)
    ideal_speedup = statistics.median(s / i for s, _, i in rounds)
    uniform = zip(res["static"], res["uniform"], strict=True)
    uniform_speedup = statistics.median(s / u for s, u in uniform)
    fraction = gain_fraction(speedup, ideal_speedup)
    interval = gain_fraction_interval(res["static"], res[key], res["ideal"])
    judged = key == "balanced"  # the target is judged on `--policy`'s line
    st = res["stats"][key]
    return {
        "bench": "ep_step",
        "trace": name,
        "impl": "poise",
        "static_ms": round(static, 2),
        "balanced_ms": round(balanced, 2),
        "ideal_ms": round(ideal, 2),
        "speedup": round(speedup, 3),
        "ideal_speedup": round(ideal_speedup, 3),
        "fraction_of_ideal": round(speedup / ideal_speedup, 3),
        "gain_fraction": None if fraction is None else round(fraction, 3),
        "gain_fraction_90": interval,
        # uniform routing (every expert the mean load): the same tokens in GEMMs of equal size,
        # which no placement of this trace's loads has; its speed-up over static EP holds that
        "uniform_ms": round(statistics.median(res["uniform"]) * 1e3, 2),
        "uniform_speedup": round(uniform_speedup, 3),
        "policy": policy,
        "judged": judged,
        **(target_verdict(fraction, interval) if judged else {}),
        "replan_every": args.replan_every,
        "max_over_mean_static": round(st["static_max_over_mean"], 3),
        "max_over_mean_balanced": round(st["max_over_mean"], 3),
        "max_over_mean_ideal": round(_max_over_mean(load_trace(f"ideal:{name}", args)), 4),
        "replicas": st["replicas"],
        "moved_homes": st["moved_homes"],
        "probe_steps": st["probe_steps"],
        "switches_timed": st["switches"],
        "transfer_bytes_per_step": round(st["bytes_per_step"]),
        "balanced_ms_by_phase": {k: round(v * 1e3, 2) for k, v in st["seconds"].items()},
        # Other processes on this machine take CPU from the ranks and hide their imbalance.
        "load_avg_1min": load,
    }


def run_trace(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Poise's line for the trace (`--policy`), one per `--compare` policy, then one line per
    peer in `args.peers`."""
    load_before = os.getloadavg()[0]
    res = run_ranks(_rank, args.world, args, name, timeout_s=600)[0]
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    lines = [policy_line(name, "balanced", args.policy, res, args, load)]
    lines += [policy_line(name, f"balanced:{p}", p, res, args, load) for p in args.compare]
    return lines + [peer_line(name, system, res, args, load) for system in args.peers]


def peer_line(
    trace: str, system: str, res: dict[str, Any], args: argparse.Namespace, load: list[float]
) -> dict[str, Any]:
    """A peer's JSON line: median step and its per-round ratios to Poise's static and balanced
    steps; DeepSpeed's expert rows per rank and layer (`E * capacity`) against Poise's `T * k`."""
    ts = res[system]
    line: dict[str, Any] = {
        "bench": "ep_step",
        "trace": trace,
        "impl": system,
        "step_ms": round(statistics.median(ts) * 1e3, 2),
        "ratio_vs_static": round(
            statistics.median(p / s for p, s in zip(ts, res["static"], strict=True)), 3
        ),
        "ratio_vs_balanced": round(
            statistics.median(p / b for p, b in zip(ts, res["balanced"], strict=True)), 3
        ),
        "expert_parallel": system.startswith("deepspeed"),
    }
    if system == "deepspeed-drop":
        line["capacity_factor"] = args.capacity_factor
        line["dropped_fraction"] = round(res["peer_dropped"][system], 4)
    rows = res["peer_rows"].get(system)
    if rows:
        line["expert_rows_per_rank"] = round(float(np.mean(rows)))
        line["poise_assignments_per_rank"] = args.tokens * args.top_k
    line["load_avg_1min"] = load
    return line


def skipped_lines(notes: dict[str, str]) -> list[dict[str, Any]]:
    """One line per peer system that cannot run here, with the reason."""
    return [
        {"bench": "ep_step", "impl": name, "skipped": note}
        for pkg, note in notes.items()
        if note
        for name in PEERS[pkg]
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    notes = peer_notes(args)
    args.peers = peer_systems(notes)
    for line in skipped_lines(notes):
        print(json.dumps(line), flush=True)
    for name in args.traces:
        for line in run_trace(name, args):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
