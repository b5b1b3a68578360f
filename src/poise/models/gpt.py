"""GPT-MoE: a decoder-only byte-level transformer with `poise.nn.MoE` feed-forward layers.

    cfg = model_config("tiny")                      # or GPTConfig(...), model_config("small", ...)
    model = GPTMoE(cfg, seed=0)                     # compute only: every expert, one device
    apply_expert_parallel(model, group)             # optional: expert parallel over `group`
    logits = model(idx)                             # idx [B, T] int64 -> logits [B, T, V]
    loss = cross_entropy(logits, targets) + model.aux_loss()

Each block is pre-norm: `x + attn(norm(x))`, then `x + ffn(norm(x))`, with RMSNorm, rotary
positions on queries and keys, causal `scaled_dot_product_attention`, and as FFN either an MoE
layer (`poise.nn.MoE`; `poise.nn.apply_expert_parallel` makes it expert parallel) or a dense
SwiGLU MLP. Layer i is MoE when `(i + 1) % moe_every == 0` (every layer for 1, every second
layer starting with the second for 2). The output head is the token embedding (tied weights).

Initialisation does not depend on the world size or the layout: non-expert parameters are drawn
from one generator seeded by `seed` in `named_parameters` order (normal(0, 0.02); the output
projections of attention and FFN scaled by 1/sqrt(2 * layers)), and each expert from its own
generator (the layer's `init_seed` and the expert id, see `poise.nn.MoE`). Every rank builds the
same model; `apply_expert_parallel` then keeps each rank's expert slots.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from poise.core.errors import ConfigError
from poise.nn.config import MoEConfig
from poise.nn.moe import MoE, find_moe_layers


@dataclass(frozen=True)
class GPTConfig:
    """Shapes of a GPT-MoE. `d_ff`: hidden width of dense FFNs; `d_expert`: of each expert.
    `context`: the longest sequence (rotary tables are built for it)."""

    vocab_size: int = 256
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    d_ff: int = 384
    d_expert: int = 256
    num_experts: int = 8
    top_k: int = 2
    moe_every: int = 1
    context: int = 128
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    activation: str = "swiglu"
    capacity_factor: float | None = None

    def validate(self, source: str | None = None) -> None:
        def bad(field: str, msg: str) -> ConfigError:
            return ConfigError(msg, source=source, field=f"model.{field}")

        for name in (
            "vocab_size",
            "d_model",
            "layers",
            "heads",
            "d_ff",
            "d_expert",
            "num_experts",
            "top_k",
            "moe_every",
            "context",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, f"must be an integer >= 1, got {v!r}")
        if self.d_model % self.heads:
            raise bad("heads", f"must divide d_model={self.d_model}, got {self.heads}")
        if (self.d_model // self.heads) % 2:
            raise bad("heads", "d_model / heads must be even (rotary positions rotate pairs)")
        if self.top_k > self.num_experts:
            raise bad("top_k", f"must be <= num_experts={self.num_experts}, got {self.top_k}")
        if self.moe_every > self.layers:
            raise bad("moe_every", f"must be <= layers={self.layers} (else no MoE layer)")
        if self.activation not in ("swiglu", "gelu"):
            raise bad("activation", f"must be swiglu or gelu, got {self.activation!r}")

        def number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        cap = self.capacity_factor
        if cap is not None and not (number(cap) and cap > 0):
            raise bad("capacity_factor", f"must be a number > 0 or null, got {cap!r}")
        if not (number(self.rope_base) and self.rope_base > 1):
            raise bad("rope_base", f"must be a number > 1, got {self.rope_base!r}")
        if not (number(self.norm_eps) and self.norm_eps > 0):
            raise bad("norm_eps", f"must be a number > 0, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))


MODEL_PRESETS: dict[str, GPTConfig] = {
    # 2 CPU ranks: 0.3 M dense + 3.1 M expert parameters (1.1 M active per token).
    "tiny": GPTConfig(),
    # A few GPUs: 8.6 M dense + 201 M expert parameters (34 M active per token).
    "small": GPTConfig(
        d_model=512, layers=8, heads=8, d_ff=1536, d_expert=1024, num_experts=16, top_k=2,
        context=512,
    ),
    # A node of 8 GPUs: 68 M dense + 4.8 B expert parameters (370 M active), top-4 of 64.
    "medium": GPTConfig(
        d_model=1024, layers=16, heads=16, d_ff=4096, d_expert=1536, num_experts=64, top_k=4,
        context=1024,
    ),
}  # fmt: skip


def model_config(preset: str, overrides: dict[str, Any] | None = None, source: str | None = None):
    """The preset `preset` with `overrides` (GPTConfig field names) applied and validated."""
    if preset not in MODEL_PRESETS:
        raise ConfigError(
            f"unknown model preset {preset!r} (known: {', '.join(MODEL_PRESETS)})",
            source=source,
            field="model",
        )
    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    for key in overrides or {}:
        if key not in fields:
            raise ConfigError(
                f"unknown model setting (known: {', '.join(fields)})",
                source=source,
                field=f"model_args.{key}",
            )
    cfg = dataclasses.replace(MODEL_PRESETS[preset], **(overrides or {}))
    cfg.validate(source)
    return cfg


# ------------------------------------------------------------------------------ layers
def rotary_tables(context: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos, sin [context, head_dim / 2]` for rotary positions (pairs (2i, 2i + 1) rotate by
    `pos * base ** (-2i / head_dim)`)."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(context, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x [B, H, T, hd]` rotated by position: `cos, sin [T, hd / 2]`."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    """Causal multi-head self-attention: `x [B, T, D] -> [B, T, D]`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, hd]
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class DenseFFN(nn.Module):
    """SwiGLU (or GELU) MLP: `x [..., D] -> [..., D]` through a hidden width `d_ff`."""

    def __init__(self, d_model: int, d_ff: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.w_in = nn.Linear(d_model, d_ff, bias=False)
        self.w_gate = nn.Linear(d_model, d_ff, bias=False) if activation == "swiglu" else None
        self.w_out = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)
        h = F.silu(self.w_gate(x)) * h if self.w_gate is not None else F.gelu(h)
        return self.w_out(h)


class Block(nn.Module):
    """Pre-norm transformer block: `x [B, T, D] -> [B, T, D]`."""

    def __init__(self, cfg: GPTConfig, ffn: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = ffn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.ffn(self.norm2(x))


class GPTMoE(nn.Module):
    """Decoder-only GPT with MoE FFNs: `forward(idx [B, T]) -> logits [B, T, V]` (T <= context).

    Compute only: every MoE layer holds all E experts (`poise.nn.apply_expert_parallel` shards
    them over a process group afterwards). `balance_coef`, `z_loss_coef`, `expert_bias`: router
    settings (see `poise.nn.Router`);
    `seed`: initialisation (independent of the world size and the layout)."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        expert_bias: bool = False,
        experts_impl: str = "auto",
        overlap_degree: int = 1,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        blocks = []
        for i in range(cfg.layers):
            if cfg.is_moe(i):
                moe_cfg = MoEConfig(
                    d_model=cfg.d_model,
                    d_expert=cfg.d_expert,
                    num_experts=cfg.num_experts,
                    top_k=cfg.top_k,
                    activation=cfg.activation,  # type: ignore[arg-type]
                    balance_coef=balance_coef,
                    z_loss_coef=z_loss_coef,
                    expert_bias=expert_bias,
                    capacity_factor=cfg.capacity_factor,
                    overlap_degree=overlap_degree,
                    experts_impl=experts_impl,  # type: ignore[arg-type]
                    init_seed=seed * 7919 + i,
                )
                ffn: nn.Module = MoE(moe_cfg)
            else:
                ffn = DenseFFN(cfg.d_model, cfg.d_ff, cfg.activation)
            blocks.append(Block(cfg, ffn))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        cos, sin = rotary_tables(cfg.context, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_dense(seed)
        if device is not None:
            self.to(device)

    # ------------------------------------------------------------------ parameters
    def expert_parameters(self) -> list[nn.Parameter]:
        """The stacked per-slot expert tensors of every MoE layer (`[P, ...]` each)."""
        return [w for m in find_moe_layers(self) for w in m.experts.weights()]

    def dense_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every other parameter (replicated on all ranks: embedding, attention, norms, dense
        FFNs, routers), in `named_parameters` order."""
        experts = {id(p) for p in self.expert_parameters()}
        return [(n, p) for n, p in self.named_parameters() if id(p) not in experts]

    @torch.no_grad()
    def init_dense(self, seed: int) -> None:
        """Draw the non-expert parameters from one generator seeded by `seed`."""
        gen = torch.Generator().manual_seed(int(seed))
        scaled = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.dense_named_parameters():
            if p.ndim == 1:  # norms
                p.fill_(1.0)
                continue
            std = scaled if name.endswith(("attn.proj.weight", "ffn.w_out.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)

    def aux_loss(self) -> torch.Tensor:
        """The routers' weighted balance and z losses of the last forward, summed over layers."""
        losses = [m.last_forward.aux_loss for m in find_moe_layers(self)]
        return torch.stack([x.to(self.rope_cos.device) for x in losses]).sum()

    def num_parameters(self) -> dict[str, int]:
        """`{"dense": n, "experts": n}` parameters of the whole model (all experts counted once,
        whatever the slots)."""
        dense = sum(p.numel() for _, p in self.dense_named_parameters())
        per_expert = sum(w[0].numel() for w in self.expert_parameters())
        return {"dense": dense, "experts": per_expert * self.cfg.num_experts}

    # ------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """`idx [B, T]` token ids -> `logits [B, T, V]`."""
        T = idx.shape[1]
        if self.cfg.context < T:
            raise ConfigError(
                f"sequence of {T} tokens exceeds the model's context {self.cfg.context}",
                field="context",
            )
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.embed.weight)


__all__ = [
    "MODEL_PRESETS",
    "GPTConfig",
    "GPTMoE",
    "apply_rotary",
    "model_config",
    "rotary_tables",
]
