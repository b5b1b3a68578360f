"""Hugging Face transformers' sparse MoE blocks (Mixtral / Qwen-MoE family) made balanceable.

    model = AutoModelForCausalLM.from_config(config)        # e.g. MixtralConfig, Qwen2MoeConfig
    convert_hf_moe(model)                                   # in place: every sparse MoE block
    apply_expert_parallel(model, group, num_slots=E // D + 1)   # then as the README's snippet

Each block (`model.layers[i].mlp`, a `MixtralSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`,
`Qwen3MoeSparseMoeBlock`, `Qwen3NextSparseMoeBlock` or `OlmoeSparseMoeBlock`) is replaced in
its parent by a `PoiseSparseMoeBlock` of the same forward, `hidden_states [B, T, M] -> [B, T,
M]` (transformers 5's blocks return the tensor alone; the router logits reach the model's
output through the recorder hooked on the gate). Weights, `M` = hidden size, `F` = the
experts' intermediate size, `E` experts:

- the gate (`MixtralTopKRouter`, ...): kept, module and weight `[E, M]`, and called for the
  routing (`adapters.routing.SourceRouter`): softmax, top-k, `norm_topk_prob` as the model
  does; the logits it returns are recorded as before (`output_router_logits=True`), so the
  model's load-balancing loss is unchanged;
- `experts.gate_up_proj [E, 2F, M]` (concatenated `[gate; up]`; `[E, M, 2F]` where the
  experts are stored transposed; interleaved gate and up rows where `is_concatenated` is
  false): `w_gate [E, M, F]` = the gate half transposed, `w_in [E, M, F]` = the up half
  transposed; `experts.down_proj [E, M, F]` (`[E, F, M]` transposed): `w_out [E, F, M]`;
  SwiGLU, `silu(x @ w_gate) * (x @ w_in) @ w_out`, is the experts' `act_fn(gate) * up`;
- Qwen2-MoE / Qwen3-Next: `shared_expert` (an MLP) and `shared_expert_gate` (`Linear(M, 1)`)
  kept as they are, `y = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)`;
- Mixtral's `router_jitter_noise` applied to the input in training, as the block does.

The experts compute in their weights' dtype, where Hugging Face's loop does too: a converted
fp32 model gives the outputs and gradients of the original within float summation order
(`tests/test_adapters_hf.py`). Refused with `ConfigError`: experts with biases, another
activation than SiLU, their own gating function, a post-expert norm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from poise.adapters.routing import SourceRouter
from poise.core.errors import ConfigError
from poise.nn.config import MoEConfig
from poise.nn.experts import ExpertsImpl
from poise.nn.moe import MoE

# block class name -> what its forward adds around gate and experts
FAMILIES = {
    "MixtralSparseMoeBlock": "jitter",
    "Qwen2MoeSparseMoeBlock": "shared",
    "Qwen3NextSparseMoeBlock": "shared",
    "Qwen3MoeSparseMoeBlock": "plain",
    "OlmoeSparseMoeBlock": "plain",
}


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "the Hugging Face adapter needs transformers: pip install 'poise[adapters]'",
            field="transformers",
        ) from exc
    return transformers


def _route_hf(router: SourceRouter, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The Hugging Face gate's own call on `x [T, M]`: `(router_logits [T, E], weights [T, k],
    experts [T, k])`."""
    logits, weights, experts = router.source(x)
    return logits, weights, experts


class PoiseSparseMoeBlock(nn.Module):
    """A Hugging Face sparse MoE block whose routed experts are a `poise.nn.MoE` (`moe`), which
    the Balancer balances; `forward(hidden_states [B, T, M]) -> [B, T, M]` as the block's.

    `moe.router.source` is the block's gate; `shared_expert`, `shared_expert_gate` are the
    block's own (Qwen2-MoE), else None; `jitter_noise` is Mixtral's."""

    def __init__(self, block: nn.Module, *, experts_impl: ExpertsImpl = "auto") -> None:
        super().__init__()
        name = type(block).__name__
        if name not in FAMILIES:
            raise ConfigError(
                f"{name} is not a supported sparse MoE block ({', '.join(FAMILIES)})",
                field="block",
            )
        self.family = FAMILIES[name]
        self.source_class = name
        gate, experts = block.gate, block.experts
        w_gate, w_in, w_out = expert_weights(experts)
        E, M, Fh = w_in.shape
        top_k = int(gate.top_k)
        norm = bool(getattr(gate, "norm_topk_prob", True))
        config = MoEConfig(
            d_model=M, d_expert=Fh, num_experts=E, top_k=top_k, renormalize=norm,
            experts_impl=experts_impl, init_seed=0,
        )  # fmt: skip
        router = SourceRouter(gate, gate.weight, top_k, _route_hf, renormalize=norm)
        kw = {"device": w_in.device, "dtype": w_in.dtype}
        self.moe = MoE(config, router=router, **kw)
        self.moe.load_expert_weights({"w_in": w_in, "w_gate": w_gate, "w_out": w_out})
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if self.family == "shared":
            self.shared_expert = block.shared_expert
            self.shared_expert_gate = block.shared_expert_gate
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states [B, T, M]` -> `[B, T, M]`: routed experts (+ the gated shared expert)."""
        batch, seq, M = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states)
            hidden_states *= noise.uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.view(-1, M)
        y = self.moe(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y = y + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(batch, seq, M)


@torch.no_grad()
def expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Hugging Face experts module's weights as Poise stacks them: `(w_gate [E, M, F],
    w_in [E, M, F], w_out [E, F, M])`, from `gate_up_proj` and `down_proj` in the layout its
    `is_transposed` / `is_concatenated` flags name (module docstring). `ConfigError` for
    experts Poise cannot compute alike."""
    for flag, bad in (("has_bias", True), ("has_post_expert_norm", True), ("has_gate", False)):
        if getattr(experts, flag, not bad) == bad:
            raise ConfigError(f"experts with {flag}={bad} are not supported", field="experts")
    act = getattr(experts, "act_fn", None)
    probe = torch.linspace(-8.0, 8.0, 161)
    if not callable(act) or not torch.equal(act(probe), F.silu(probe)):
        raise ConfigError(
            f"the experts' activation must be SiLU (SwiGLU experts), got {type(act).__name__}",
            field="experts.act_fn",
        )
    gate_fn = getattr(type(experts), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        raise ConfigError(
            f"{type(experts).__name__} has its own gating function", field="experts._apply_gate"
        )
    return stack_experts(experts, experts.gate_up_proj, experts.down_proj)


def stack_experts(
    experts: nn.Module, gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gate_up` and `down`, tensors laid out as `experts`' `gate_up_proj` and `down_proj`
    (their weights, or their gradients), as `(w_gate [E, M, F], w_in [E, M, F],
    w_out [E, F, M])`."""
    if getattr(experts, "is_transposed", False):  # [E, M, 2F], [E, F, M]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    # now gate_up [E, 2F, M], down [E, M, F]
    if getattr(experts, "is_concatenated", True):
        gate, up = gate_up.chunk(2, dim=1)
    else:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return (
        gate.transpose(1, 2).contiguous(),
        up.transpose(1, 2).contiguous(),
        down.transpose(1, 2).contiguous(),
    )


def convert_hf_moe(model: nn.Module, *, experts_impl: ExpertsImpl = "auto") -> list[str]:
    """Replace, in place, every supported sparse MoE block of `model` (module docstring) by a
    `PoiseSparseMoeBlock` holding the same weights; returns the replaced modules' names. Call
    it before `apply_expert_parallel` and before building the optimizer (the expert weights are
    new parameters). `ConfigError` where the model has no such block."""
    _require_transformers()
    names = [n for n, m in model.named_modules() if type(m).__name__ in FAMILIES and n]
    if not names:
        raise ConfigError(
            f"the model has no sparse MoE block of {', '.join(FAMILIES)}", field="model"
        )
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent, child, PoiseSparseMoeBlock(getattr(parent, child), experts_impl=experts_impl)
        )
    return names


__all__ = ["FAMILIES", "PoiseSparseMoeBlock", "convert_hf_moe", "expert_weights", "stack_experts"]
