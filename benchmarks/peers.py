"""Peer MoE layers for the benchmarks: DeepSpeed-MoE and torchtitan's MoE layer, through their
public APIs, each behind a check that says why it cannot run (`note`) instead of failing.

Both come with the `bench` extra (`pip install -e '.[bench]'`); neither is a dependency of
Poise. A layer here maps `x [T, D]` to `(y [T, D], aux)` like the benchmarks' Poise layers, and
routes as its own router decides: the benchmarks fix that routing through the inputs (routing
features read by the gate weight they copy in).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator

import torch
from torch import nn

from poise.runtime.launch import free_port

INSTALL_HINT = "pip install -e '.[bench]'"


# ----------------------------------------------------------------------------- availability
def _note(module: str, probe: str) -> str:
    """ "" when `probe` imports, "<module> not installed (...)" when `module` is absent, else
    "<module> not importable: <error>"."""
    if importlib.util.find_spec(module) is None:
        return f"{module} not installed ({INSTALL_HINT})"
    try:
        importlib.import_module(probe)
    except Exception as exc:  # a broken install, or a version with another layout
        return f"{module} not importable: {type(exc).__name__}: {exc}"
    return ""


def deepspeed_note() -> str:
    """ "" when DeepSpeed-MoE (`deepspeed.moe.layer`) imports on the CPU, else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with stdout_to_stderr():
        return _note("deepspeed", "deepspeed.moe.layer")


def torchtitan_note() -> str:
    """ "" when torchtitan's MoE layer (`torchtitan.models.common.moe`) imports, else why not."""
    return _note("torchtitan", "torchtitan.models.common.moe")


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


def init_deepspeed_comm() -> None:
    """Give DeepSpeed its communication backend on gloo: the process group already started
    (the benchmark's ranks), or a fresh 1-rank group in a single process."""
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        os.environ.update(env, MASTER_PORT=str(free_port()))
    else:
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    with stdout_to_stderr():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)


# ----------------------------------------------------------------------------- expert FFNs
class SwiGLU(nn.Module):
    """`(silu(x @ W_gate) * (x @ W_in)) @ W_out`, no biases: Poise's SwiGLU expert."""

    def __init__(self, d_model: int, d_expert: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(d_model, d_expert, bias=False)
        self.w_gate = nn.Linear(d_model, d_expert, bias=False)
        self.w_out = nn.Linear(d_expert, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(nn.functional.silu(self.w_gate(x)) * self.w_in(x))


def expert_ffn(d_model: int, d_expert: int, activation: str) -> nn.Module:
    """One expert as Poise computes it: `gelu` (two GEMMs) or `swiglu` (three), no biases."""
    if activation == "swiglu":
        return SwiGLU(d_model, d_expert)
    return nn.Sequential(
        nn.Linear(d_model, d_expert, bias=False),
        nn.GELU(),
        nn.Linear(d_expert, d_model, bias=False),
    )


# ----------------------------------------------------------------------------- layers
class DeepSpeedLayer(nn.Module):
    """`deepspeed.moe.layer.MoE`, top-`k` deterministic (no sampled second expert).

    `drop=True`: capacity `ceil(capacity_factor * T * k / E)` per expert, assignments past it
    dropped; `drop=False` (dropless): every expert padded to the largest load over the
    expert-parallel group. Weights `N(0, 0.02)`, the gate's `gate`. `ep_size` > 1 splits the
    experts over the ranks of the process group (DeepSpeed's all-to-all); call
    `init_deepspeed_comm` first. `last_counts` holds DeepSpeed's per-expert assignments before
    any drop, from the last forward."""

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        experts: int,
        top_k: int,
        gate: torch.Tensor,
        *,
        drop: bool,
        capacity_factor: float = 1.0,
        activation: str = "gelu",
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE as DSMoE

        with stdout_to_stderr():
            self.moe = DSMoE(
                d_model,
                expert_ffn(d_model, d_expert, activation),
                num_experts=experts,
                ep_size=ep_size,
                k=top_k,
                capacity_factor=capacity_factor,
                eval_capacity_factor=capacity_factor,
                min_capacity=0,
                drop_tokens=drop,
                top2_2nd_expert_sampling=False,  # deterministic top-2, as the other layers
            )
            self.moe.set_deepspeed_parallelism()
        with torch.no_grad():
            for p in self.moe.parameters():
                nn.init.normal_(p, std=0.02)
            self.moe.deepspeed_moe.gate.wg.weight.copy_(gate)
        self.last_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux, counts = self.moe(x)
        self.last_counts = counts
        return y, aux

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every rank holds (the gate): DeepSpeed marks expert parameters
        `allreduce=False`, the others are summed over data-parallel ranks."""
        return [p for p in self.parameters() if getattr(p, "allreduce", True)]


class TorchtitanLayer(nn.Module):
    """torchtitan 0.3's MoE layer (`torchtitan.models.common.moe.MoE`): SwiGLU grouped experts
    of hidden `d_expert`, local token dispatcher (all experts in this process), softmax top-`k`
    router with `gate` as its weight, no load-balancing bias or loss. Its experts compute in
    bf16 (torchtitan casts inputs and weights for `torch._grouped_mm`)."""

    def __init__(
        self, d_model: int, d_expert: int, experts: int, top_k: int, gate: torch.Tensor
    ) -> None:
        super().__init__()
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import (
            GroupedExperts,
            RoutedExperts,
            TokenChoiceTopKRouter,
        )
        from torchtitan.models.common.moe import MoE as TTMoE
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

        E, M, H, k = experts, d_model, d_expert, top_k
        config = TTMoE.Config(
            num_experts=E,
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=M, hidden_dim=H, num_experts=E),
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

    def counts(self, x: torch.Tensor) -> torch.Tensor:
        """`[E]` assignments per expert its router makes for `x [T, D]`."""
        with torch.no_grad():
            _, ids, _ = self.moe.router(x.unsqueeze(0))
        return torch.bincount(ids.reshape(-1), minlength=self.moe.router.gate.weight.shape[0])


__all__ = [
    "DeepSpeedLayer",
    "SwiGLU",
    "TorchtitanLayer",
    "deepspeed_note",
    "expert_ffn",
    "init_deepspeed_comm",
    "stdout_to_stderr",
    "torchtitan_note",
]
