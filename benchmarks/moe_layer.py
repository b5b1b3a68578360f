"""MoE layer forward+backward time against a dense FFN with the same active FLOPs.

    .venv/bin/python benchmarks/moe_layer.py                       # CPU, fp32, 1 thread
    .venv/bin/python benchmarks/moe_layer.py --device cuda --dtype bf16

One process, `torch.set_num_threads(1)` on the CPU: d_model 256, d_expert 1024, GELU experts,
8 experts, top-2, 8,192 tokens. The dense FFN has hidden size top_k * d_expert = 2,048, so it does
the MoE's expert FLOPs in one GEMM pair. Routing is fixed by the inputs, the same for every
implementation: each token carries a one-hot feature for its first and its second expert and the
gate weights read them (plus small noise), so every layer's own router picks exactly those
experts. `uniform`: both choices uniform (distinct); `zipf`: both drawn from Zipf(1.2) over the
experts (distinct), expert 0 the hottest.

Implementations: `poise` (`poise.nn.MoE`, dropless), `dense`, and where `deepspeed` imports
(the `bench` extra), DeepSpeed-MoE's `deepspeed.moe.layer.MoE` on a 1-rank gloo group with the
same expert FFN: `deepspeed-drop` (capacity factor `--capacity-factor`, default 1.25, assignments
past it dropped) and `deepspeed-nodrop` (dropless: every expert padded to the largest load).
Each step is forward, `(y * g).sum() + 0.01 * aux` backward, gradients dropped. Where
`torchtitan` imports (the `bench` extra; on a CPU build of torch it also needs `triton`),
torchtitan's MoE layer (`torchtitan.models.common.moe.MoE`, torchtitan 0.3: SwiGLU experts
computed in bf16, local token dispatcher, softmax top-k, no load-balancing bias) runs as
`torchtitan` beside `poise-swiglu` (Poise with SwiGLU experts of the same size, its peer).
Repetitions are interleaved (rotating order); figures are medians, `ratio_vs_dense` and
`ratio_vs_poise` the medians of per-repetition time ratios (`ratio_vs_poise`: against `poise`,
or `poise-swiglu` for SwiGLU layers). `--compile BACKEND` adds `poise` and `dense` under
`torch.compile` (`poise-compiled`, `dense-compiled`: their `ratio_vs_poise` / `ratio_vs_dense`
against their own eager forms are what compiling gains). Every layer's routing is checked
against the inputs' choices. One JSON line per (routing, impl), and one per peer system that
cannot run (`skipped`: why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from peers import (
    DeepSpeedLayer,
    TorchtitanLayer,
    deepspeed_note,
    init_deepspeed_comm,
    torchtitan_note,
)
from poise.nn import MoE, MoEConfig
from poise.nn.router import capacity_keep

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ZIPF_S = 1.2
FEATURE = 6.0  # size of the one-hot routing features (first choice: 2x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-expert", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--routing", nargs="+", default=["uniform", "zipf"])
    p.add_argument("--experts-impl", choices=["auto", "grouped", "loop"], default="auto")
    p.add_argument(
        "--capacity-factor", type=float, default=1.25, help="DeepSpeed-MoE with dropping"
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed-MoE")
    p.add_argument("--no-torchtitan", action="store_true", help="skip torchtitan's MoE")
    p.add_argument(
        "--compile",
        default=None,
        metavar="BACKEND",
        help="also time `poise` and `dense` under torch.compile(backend=BACKEND) as "
        "`poise-compiled` and `dense-compiled` (e.g. inductor, aot_eager)",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- routing inputs
def choose_experts(kind: str, tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """`[T, k]` distinct experts per token: uniform, or Zipf(1.2) over experts (0 hottest)."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        p = np.full(experts, 1.0 / experts)
    elif kind == "zipf":
        p = 1.0 / np.arange(1, experts + 1) ** ZIPF_S
        p /= p.sum()
    else:
        raise SystemExit(f"unknown routing {kind!r}")
    # k draws without replacement, each proportional to p among the experts left (Gumbel top-k).
    keys = np.log(p)[None, :] - np.log(-np.log(rng.random((tokens, experts))))
    return np.argsort(-keys, axis=1)[:, :top_k]


def routed_inputs(choices: np.ndarray, d_model: int, seed: int) -> torch.Tensor:
    """`x [T, D]`: noise, except columns `j * E + e` that hold one-hot features
    `FEATURE * (k - j)` for choice j, which `gate_weight` turns into logits."""
    T, k = choices.shape
    E = int(choices.max()) + 1 if choices.size else 1
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_model, generator=g)
    x[:, : k * E] = 0.0
    for j in range(k):
        x[torch.arange(T), j * E + torch.from_numpy(choices[:, j])] += FEATURE * (k - j)
    return x


def gate_weight(experts: int, d_model: int, top_k: int, seed: int = 1) -> torch.Tensor:
    """`[E, D]`: reads expert e's one-hot features (identity blocks) plus small noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, d_model, generator=g) * 0.002
    for j in range(top_k):
        w[:, j * experts : (j + 1) * experts] += torch.eye(experts)
    return w


# ----------------------------------------------------------------------------- layers
class DenseFFN(nn.Module):
    """`gelu(x @ W1) @ W2` with hidden `top_k * d_expert`, no biases (like the experts)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.ffn = nn.Sequential(
            nn.Linear(d_model, hidden, bias=False),
            nn.GELU(),
            nn.Linear(hidden, d_model, bias=False),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ffn(x), x.new_zeros(())


class PoiseLayer(nn.Module):
    def __init__(
        self, args: argparse.Namespace, gate: torch.Tensor, activation: str = "gelu"
    ) -> None:
        super().__init__()
        self.moe = MoE(
            MoEConfig(
                args.d_model,
                args.d_expert,
                args.experts,
                args.top_k,
                activation=activation,
                balance_coef=1.0,
                experts_impl=args.experts_impl,
                check_finite=True,
            )
        )
        with torch.no_grad():
            self.moe.router.weight.copy_(gate)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.moe(x), self.moe.last_forward.aux_loss


# ----------------------------------------------------------------------------- timing
def make_step(
    layer: nn.Module, x: torch.Tensor, g: torch.Tensor, device: torch.device
) -> Callable[[], float]:
    """One timed forward + backward; returns seconds."""

    def step() -> float:
        xi = x.detach().requires_grad_()
        _sync(device)
        t0 = time.perf_counter()
        y, aux = layer(xi)
        ((y * g).sum() + 0.01 * aux).backward()
        _sync(device)
        elapsed = time.perf_counter() - t0
        layer.zero_grad(set_to_none=True)
        return elapsed

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(steps: dict[str, Callable[[], float]], reps: int, warmup: int) -> dict:
    """Run every step `warmup + reps` times, rotating the order each round; keep the timed."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            t = steps[name]()
            if rep >= warmup:
                times[name].append(t)
    return times


def dropped_fraction(choices: np.ndarray, experts: int, capacity_factor: float) -> float:
    T, k = choices.shape
    cap = int(np.ceil(capacity_factor * T * k / experts))
    keep = capacity_keep(torch.from_numpy(choices), experts, cap)
    return float(1.0 - keep.float().mean())


def peer_notes(args: argparse.Namespace, device: torch.device) -> dict[str, str]:
    """Per peer system, "" when it runs here, else why not ("... not installed", "skipped
    ..."). DeepSpeed gets its 1-rank gloo group here when it imports."""
    ds = "skipped (--no-deepspeed)" if args.no_deepspeed else ""
    if not ds and device.type != "cpu":
        ds = "skipped: timed on the CPU (gloo) only"
    if not ds:
        ds = deepspeed_note()
        if not ds:
            init_deepspeed_comm()
    tt = "skipped (--no-torchtitan)" if args.no_torchtitan else torchtitan_note()
    return {"deepspeed": ds, "torchtitan": tt}


def skipped_lines(notes: dict[str, str]) -> list[dict[str, Any]]:
    """One line per peer system that cannot run here, with the reason."""
    systems = {"deepspeed": ("deepspeed-drop", "deepspeed-nodrop"), "torchtitan": ("torchtitan",)}
    return [
        {"bench": "moe_layer", "impl": name, "skipped": note}
        for pkg, note in notes.items()
        if note
        for name in systems[pkg]
    ]


def peer_layers(
    args: argparse.Namespace, gate: torch.Tensor, notes: dict[str, str]
) -> dict[str, nn.Module]:
    """The peers' layers (and `poise-swiglu`, torchtitan's Poise counterpart) that can run."""
    dims = (args.d_model, args.d_expert, args.experts, args.top_k, gate)
    layers: dict[str, nn.Module] = {}
    if not notes["deepspeed"]:
        cf = args.capacity_factor
        layers["deepspeed-drop"] = DeepSpeedLayer(*dims, drop=True, capacity_factor=cf)
        layers["deepspeed-nodrop"] = DeepSpeedLayer(*dims, drop=False)
    if not notes["torchtitan"]:
        layers["poise-swiglu"] = PoiseLayer(args, gate, activation="swiglu")
        layers["torchtitan"] = TorchtitanLayer(*dims)
    return layers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    notes = peer_notes(args, device)
    for line in skipped_lines(notes):
        print(json.dumps(line), flush=True)
    gate = gate_weight(args.experts, args.d_model, args.top_k)
    layers: dict[str, nn.Module] = {
        "poise": PoiseLayer(args, gate),
        "dense": DenseFFN(args.d_model, args.top_k * args.d_expert),
    }
    layers.update(peer_layers(args, gate, notes))
    for layer in layers.values():
        layer.to(device=device, dtype=dtype)
    if args.compile:
        for name in ("poise", "dense"):
            layers[f"{name}-compiled"] = torch.compile(layers[name], backend=args.compile)
    for routing in args.routing:
        for line in run_routing(args, routing, layers, device, dtype):
            print(json.dumps(line), flush=True)
    return 0


def run_routing(
    args: argparse.Namespace,
    routing: str,
    layers: dict[str, nn.Module],
    device: torch.device,
    dtype: torch.dtype,
) -> list[dict[str, Any]]:
    choices = choose_experts(routing, args.tokens, args.experts, args.top_k, seed=7)
    x = routed_inputs(choices, args.d_model, seed=8).to(device=device, dtype=dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    steps = {name: make_step(layer, x, g, device) for name, layer in layers.items()}
    times = interleaved(steps, args.reps, args.warmup)
    want = np.bincount(choices.ravel(), minlength=args.experts)
    # Every layer routed as the inputs say (DeepSpeed's counts are before any drop).
    assert (layers["poise"].moe.last_counts.cpu().numpy() == want).all()
    for name, layer in layers.items():
        if isinstance(layer, DeepSpeedLayer):
            assert layer.last_counts is not None
            assert (layer.last_counts.cpu().numpy() == want).all(), name
        if isinstance(layer, TorchtitanLayer):
            assert (layer.counts(x).cpu().numpy() == want).all(), name
    dense = times["dense"]
    out = []
    swiglu = ("poise-swiglu", "torchtitan")
    for name, ts in times.items():
        med = statistics.median(ts)
        line: dict[str, Any] = {
            "bench": "moe_layer",
            "routing": routing,
            "impl": name,
            "fwd_bwd_ms": round(med * 1e3, 2),
            "tokens_per_s": round(args.tokens / med, 1),
            "ratio_vs_dense": round(
                statistics.median(a / b for a, b in zip(ts, dense, strict=True)), 3
            ),
            "ratio_vs_poise": round(
                statistics.median(
                    a / b
                    for a, b in zip(
                        ts, times["poise-swiglu" if name in swiglu else "poise"], strict=True
                    )
                ),
                3,
            ),
        }
        if name.endswith("-compiled"):
            line["compile_backend"] = args.compile
        if name == "poise":
            line["experts_impl"] = layers[name].moe.experts.resolved_impl(x)
        if name == "deepspeed-drop":
            cf = args.capacity_factor
            line["capacity_factor"] = cf
            line["dropped_fraction"] = round(dropped_fraction(choices, args.experts, cf), 4)
        if name == "deepspeed-nodrop":
            line["padded_rows"] = int(np.bincount(choices.ravel()).max()) * args.experts
        line.update(
            device=str(device), dtype=args.dtype, tokens=args.tokens, reps=args.reps,
            max_expert_share=round(float(np.bincount(choices.ravel()).max() / choices.size), 3),
        )  # fmt: skip
        out.append(line)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
