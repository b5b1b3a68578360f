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
same expert FFN: `deepspeed-drop` (capacity factor 1.0, tokens dropped) and `deepspeed-nodrop`
(every expert padded to the largest load). Each step is forward, `(y * g).sum() + 0.01 * aux`
backward, gradients dropped. Where `torchtitan` imports (the `bench` extra), torchtitan's MoE
layer (`torchtitan.models.common.moe.MoE`, torchtitan 0.3: SwiGLU experts, local token
dispatcher, softmax top-k, no load-balancing bias) runs as `torchtitan` beside `poise-swiglu`
(Poise with SwiGLU experts of the same size, its peer). Repetitions are interleaved (rotating
order); figures are medians, `ratio_vs_dense` and `ratio_vs_poise` the medians of per-repetition
time ratios (`ratio_vs_poise`: against `poise`, or `poise-swiglu` for SwiGLU layers). One JSON
line per (routing, impl).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from poise.nn import MoE, MoEConfig
from poise.nn.router import capacity_keep
from poise.runtime.launch import free_port

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
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed-MoE")
    p.add_argument("--no-torchtitan", action="store_true", help="skip torchtitan's MoE")
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


class TorchtitanLayer(nn.Module):
    """torchtitan 0.3's MoE layer with SwiGLU experts of hidden `d_expert`, the same gate."""

    def __init__(self, args: argparse.Namespace, gate: torch.Tensor) -> None:
        super().__init__()
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import (
            GroupedExperts,
            RoutedExperts,
            TokenChoiceTopKRouter,
        )
        from torchtitan.models.common.moe import MoE as TTMoE
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

        E, M, F, k = args.experts, args.d_model, args.d_expert, args.top_k
        config = TTMoE.Config(
            num_experts=E,
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=M, hidden_dim=F, num_experts=E),
                token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k),
            ),
            router=TokenChoiceTopKRouter.Config(
                num_experts=E,
                gate=Linear.Config(in_features=M, out_features=E),
                top_k=k,
                score_func="softmax",
            ),
            load_balance_coeff=None,
        )
        self.moe = config.build()
        with torch.no_grad():
            for p in self.moe.parameters():
                nn.init.normal_(p, std=0.02)
            self.moe.router.gate.weight.copy_(gate)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.moe(x.unsqueeze(0)).squeeze(0), x.new_zeros(())


def init_torchtitan() -> str:
    """ "" when torchtitan's MoE layer imports, else why not."""
    try:
        import torchtitan.models.common.moe  # noqa: F401
    except Exception as exc:  # ImportError, or a version with another layout
        return f"torchtitan not importable: {type(exc).__name__}: {exc}"
    return ""


class DeepSpeedLayer(nn.Module):
    def __init__(self, args: argparse.Namespace, gate: torch.Tensor, drop: bool) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE as DSMoE

        expert = nn.Sequential(
            nn.Linear(args.d_model, args.d_expert, bias=False),
            nn.GELU(),
            nn.Linear(args.d_expert, args.d_model, bias=False),
        )
        self.moe = DSMoE(
            args.d_model,
            expert,
            num_experts=args.experts,
            ep_size=1,
            k=args.top_k,
            capacity_factor=1.0,
            eval_capacity_factor=1.0,
            min_capacity=0,
            drop_tokens=drop,
            top2_2nd_expert_sampling=False,  # deterministic top-2, as the other layers
        )
        self.moe.set_deepspeed_parallelism()
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(gate)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux, _ = self.moe(x)
        return y, aux


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """DeepSpeed prints progress on stdout (Python and C++): keep stdout for the JSON lines."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def init_deepspeed() -> str:
    """Import DeepSpeed and give it a 1-rank gloo group; "" when ready, else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except Exception as exc:  # ImportError, or a broken install
        return f"deepspeed not importable: {type(exc).__name__}: {exc}"
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    os.environ.update(env, MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return ""


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ds_note = "skipped (--no-deepspeed)" if args.no_deepspeed else ""
    if not ds_note and device.type != "cpu":
        ds_note = "skipped: timed on the CPU (gloo) only"
    if not ds_note:
        with stdout_to_stderr():
            ds_note = init_deepspeed()
    if ds_note:
        print(f"# deepspeed: {ds_note}", file=sys.stderr)
    gate = gate_weight(args.experts, args.d_model, args.top_k)
    layers: dict[str, nn.Module] = {
        "poise": PoiseLayer(args, gate),
        "dense": DenseFFN(args.d_model, args.top_k * args.d_expert),
    }
    if not ds_note:
        with stdout_to_stderr():
            layers["deepspeed-drop"] = DeepSpeedLayer(args, gate, drop=True)
            layers["deepspeed-nodrop"] = DeepSpeedLayer(args, gate, drop=False)
    tt_note = "skipped (--no-torchtitan)" if args.no_torchtitan else init_torchtitan()
    if tt_note:
        print(f"# torchtitan: {tt_note}", file=sys.stderr)
    else:
        layers["poise-swiglu"] = PoiseLayer(args, gate, activation="swiglu")
        layers["torchtitan"] = TorchtitanLayer(args, gate)
    for layer in layers.values():
        layer.to(device=device, dtype=dtype)
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
    poise_counts = layers["poise"].moe.last_counts.cpu().numpy()
    assert (poise_counts == np.bincount(choices.ravel(), minlength=args.experts)).all()
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
        if name == "poise":
            line["experts_impl"] = layers[name].moe.experts.resolved_impl(x)
        if name == "deepspeed-drop":
            line["dropped_fraction"] = round(dropped_fraction(choices, args.experts, 1.0), 4)
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
