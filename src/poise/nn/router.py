"""Routers: which `top_k` experts each token goes to, with which weights.

`Router(d_model, num_experts, top_k)` scores tokens with a bias-free linear gate
(`logits [T, E] = x [T, D] @ weight [E, D]^T`, in float32) and:

- scores: `"softmax"` over experts (Switch, GShard, Mixtral) or `"sigmoid"` per expert
  (DeepSeek-V3);
- picks the `top_k` highest scores; with the aux-loss-free `expert_bias` (DeepSeek-V3) the bias
  is added for the selection only, the weights stay the unbiased scores;
- renormalises the chosen weights to sum to one (`renormalize`, default: when `top_k > 1`);
- balance loss (Switch / GShard): `E * sum_e f_e * P_e`, with `f_e` the share of this batch's
  `T * top_k` assignments that chose e (before any drop) and `P_e` the mean over tokens of e's
  probability (softmax; for sigmoid, the scores normalised per token). It is 1 for a uniform
  router; its gradient flows through `P` only;
- z-loss (ST-MoE): mean over tokens of `logsumexp(logits)^2`;
- `aux_loss = balance_coef * balance + z_loss_coef * z` (both coefficients default 0);
- capacity: `capacity_factor=None` is dropless (the default). Otherwise each expert keeps at most
  `ceil(capacity_factor * T * top_k / E)` assignments; priority goes to first choices in token
  order, then second choices, ... (GShard); the rest are dropped (`Routing.keep`).

The expert bias is updated outside `forward` with `update_bias(counts, rate)` (from an optimizer
step pre-hook, say; `poise.nn.install_bias_update` registers one): `bias += rate *
sign(mean(counts) - counts)`, with counts summed over every rank so the bias stays identical.

`ReplayRouter` replaces the selection by a recorded `Trace`: per-expert counts of (step, layer,
source rank) scaled to the batch's `T * top_k` assignments (like FastMoE's FileGate). It keeps
the gate so that the cost and the gradients of routing stay those of a real router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from poise.core.errors import ConfigError, TraceError
from poise.nn.counts import count_values
from poise.trace.trace import Trace

Score = Literal["softmax", "sigmoid"]
SCORES: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass
class Routing:
    """A router's decision for `T` tokens.

    - `experts [T, k]` long: the chosen experts, in choice order (distinct per token);
    - `weights [T, k]` float32: their combine weights (with gradient to the gate);
    - `counts [E]` long: assignments per expert before any drop (what the balancer records);
    - `keep [T, k]` bool, or None when nothing was dropped (dropless);
    - `logits [T, E]` float32; `aux_loss`, `balance_loss`, `z_loss`: scalars."""

    experts: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    keep: torch.Tensor | None
    logits: torch.Tensor
    aux_loss: torch.Tensor
    balance_loss: torch.Tensor
    z_loss: torch.Tensor


class Router(nn.Module):
    """Top-k gate over `num_experts` experts; `forward(x [T, D]) -> Routing`.

    Parameters: `weight [E, D]`. Buffers: `expert_bias [E]` when `expert_bias=True`."""

    expert_bias: torch.Tensor | None

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int = 2,
        *,
        score: Score = "softmax",
        renormalize: bool | None = None,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        expert_bias: bool = False,
        capacity_factor: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_router_args(d_model, num_experts, top_k, score, capacity_factor)
        self.d_model = int(d_model)
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.score: Score = score
        self.renormalize = self.top_k > 1 if renormalize is None else bool(renormalize)
        self.balance_coef = float(balance_coef)
        self.z_loss_coef = float(z_loss_coef)
        self.capacity_factor = capacity_factor
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device, dtype=dtype))
        bias = torch.zeros(num_experts, device=device, dtype=torch.float32)
        self.register_buffer("expert_bias", bias if expert_bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Like `nn.Linear`: uniform in +-1/sqrt(d_model)."""
        bound = 1.0 / math.sqrt(self.d_model)
        nn.init.uniform_(self.weight, -bound, bound)

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert keeps for a batch of `tokens` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> Routing:
        """`x [T, D]` -> `Routing` (see its docstring for shapes)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        experts = self.select(scores)
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        counts = count_values(experts, self.num_experts)
        cap = self.capacity(x.shape[0])
        keep = None if cap is None else capacity_keep(experts, self.num_experts, cap)
        balance, z = self._losses(logits, scores, counts, x.shape[0])
        aux = self.balance_coef * balance + self.z_loss_coef * z
        return Routing(experts, weights, counts, keep, logits, aux, balance, z)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores [T, E]` -> chosen experts `[T, k]` (bias added for the choice only)."""
        biased = scores if self.expert_bias is None else scores + self.expert_bias
        return biased.topk(self.top_k, dim=-1, sorted=True).indices

    def _losses(
        self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        zero = logits.new_zeros(())
        if tokens == 0:
            return zero, zero
        balance = zero
        if self.balance_coef:
            probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            f = counts.to(probs.dtype) / (tokens * self.top_k)
            balance = self.num_experts * (f * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean() if self.z_loss_coef else zero
        return balance, z

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor | np.ndarray, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free update: `bias += rate * sign(mean(counts) - counts)`.

        `counts [E]`: assignments per expert over the window (summed over all ranks)."""
        if self.expert_bias is None:
            raise ConfigError(
                "this router has no expert bias (build it with expert_bias=True)",
                field="router.expert_bias",
            )
        c = torch.as_tensor(counts, dtype=torch.float32, device=self.expert_bias.device)
        if c.shape != (self.num_experts,):
            raise ConfigError(
                f"counts must be [{self.num_experts}], got {tuple(c.shape)}", field="counts"
            )
        self.expert_bias.add_(rate * torch.sign(c.mean() - c))

    def extra_repr(self) -> str:
        cap = "dropless" if self.capacity_factor is None else f"capacity={self.capacity_factor}"
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score={self.score!r}, renormalize={self.renormalize}, {cap}"
        )


def _check_router_args(
    d_model: int, num_experts: int, top_k: int, score: str, capacity_factor: float | None
) -> None:
    if d_model < 1 or num_experts < 1:
        raise ConfigError(
            f"d_model and num_experts must be >= 1, got {d_model}, {num_experts}", field="router"
        )
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"must be in [1, {num_experts}], got {top_k}", field="router.top_k")
    if score not in SCORES:
        raise ConfigError(
            f"must be one of {', '.join(SCORES)}, got {score!r}", field="router.score"
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise ConfigError(
            f"must be > 0 (or None: dropless), got {capacity_factor}",
            field="router.capacity_factor",
        )


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """`[T, k]` bool: assignments kept when each expert takes at most `capacity`, first choices
    of all tokens (in token order) before second choices, and so on."""
    T, k = experts.shape
    flat = experts.t().reshape(-1)  # choice-major: priority order
    order = torch.argsort(flat, stable=True)
    counts = count_values(flat, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    return (pos < capacity).view(k, T).t()


# ----------------------------------------------------------------------------- replay
def scaled_counts(counts: np.ndarray, total: int, cap: int) -> np.ndarray:
    """`counts [E]` scaled to sum to `total` with no expert above `cap` (each token picks an
    expert at most once): experts that would exceed `cap` get exactly `cap` and the rest is
    scaled again over the others, by largest remainder (lower expert first on ties). Experts
    without counts share what the others cannot take evenly."""
    c = np.asarray(counts, dtype=np.float64)
    E = c.shape[0]
    if total > E * cap:
        raise ConfigError(f"{total} assignments do not fit {E} experts of {cap}", field="top_k")
    capped = np.zeros(E, dtype=bool)
    while True:
        out = np.where(capped, cap, 0)
        free = ~capped
        share = np.where(free, c, 0.0)
        if share.sum() <= 0:
            share = free.astype(np.float64)
        out = out + _largest_remainder(share / share.sum() * (total - cap * capped.sum()))
        over = out > cap
        if not over.any():
            return out
        capped |= over


def _largest_remainder(ideal: np.ndarray) -> np.ndarray:
    """Integers summing to round(sum(ideal)), each floor(ideal) or one more."""
    out = np.floor(ideal + 1e-9).astype(np.int64)
    order = np.argsort(-(ideal - out), kind="stable")
    out[order[: int(np.rint(ideal.sum())) - int(out.sum())]] += 1
    return out


def replay_experts(
    counts: np.ndarray, tokens: int, top_k: int, seed: int | list[int]
) -> np.ndarray:
    """`[T, k]` expert choices whose per-expert counts are exactly `counts [E]` (each at most
    `tokens`, summing to `tokens * top_k`), distinct per token, tokens shuffled by `seed`.

    The sorted expert list fills choice j of token t at position `j * T + t`: an expert's run is
    at most T long, so it never lands twice on one token."""
    flat = np.repeat(np.arange(counts.shape[0]), counts)
    choices = flat.reshape(top_k, tokens).T
    perm = np.random.default_rng(seed).permutation(tokens)
    return choices[perm]


class ReplayRouter(Router):
    """A `Router` whose choices follow a recorded `Trace`: at `self.step` (wrapping around the
    trace), tokens go to experts in proportion to `trace.counts[step, layer, rank]`, scaled to
    the batch's `T * top_k` assignments (each expert at most `T`). Weights, losses and capacity
    work as in `Router`. `set_step(step)` moves it; nothing advances inside `forward`."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        trace: Trace,
        *,
        layer: int = 0,
        rank: int = 0,
        seed: int = 0,
        **router_kwargs: object,
    ) -> None:
        super().__init__(d_model, num_experts, top_k, **router_kwargs)  # type: ignore[arg-type]
        if trace.experts != num_experts:
            raise TraceError(
                f"has {trace.experts} experts, the router {num_experts}",
                source=trace.name,
                field="experts",
            )
        if not 0 <= layer < trace.layers or not 0 <= rank < trace.devices:
            raise TraceError(
                f"layer {layer} / rank {rank} outside {trace.layers} layers x "
                f"{trace.devices} devices",
                source=trace.name,
                field="counts",
            )
        self.trace = trace
        self.layer = int(layer)
        self.rank = int(rank)
        self.seed = int(seed)
        self.step = 0

    def set_step(self, step: int) -> None:
        self.step = int(step)

    def target_counts(self, tokens: int) -> np.ndarray:
        """`[E]` assignments per expert this router produces for a batch of `tokens` tokens."""
        row = self.trace.counts[self.step % self.trace.steps, self.layer, self.rank]
        return scaled_counts(row, tokens * self.top_k, tokens)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        T = scores.shape[0]
        seed = [self.seed, self.step, self.layer, self.rank]
        choices = replay_experts(self.target_counts(T), T, self.top_k, seed)
        return torch.from_numpy(choices).to(scores.device)


__all__ = [
    "SCORES",
    "ReplayRouter",
    "Router",
    "Routing",
    "capacity_keep",
    "replay_experts",
    "scaled_counts",
]
