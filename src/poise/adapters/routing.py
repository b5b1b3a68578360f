"""What the adapters share: a `Router` that routes with another library's own gate module, and
`Experts` that compute in the dtype that library computes in.

`SourceRouter` keeps the converted model's gate (its class, its weight, its forward): routing
is that library's mathematics to the bit (softmax or sigmoid, top-k order, normalisation,
scaling, group limits), and hooks that another library put on its gate (Hugging Face's output
recorder of router logits) still fire. Its `weight` is the gate's own parameter (tied, as
tied embeddings are), so `sync_router_grads` and the EP check of equal routers see it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from poise.nn.counts import count_values
from poise.nn.experts import Activation, Experts, ExpertsImpl
from poise.nn.router import Router, Routing

# The gate's call: `x [T, M]` -> (logits or scores `[T, E]`, weights `[T, k]`, experts `[T, k]`)
RouteFn = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class SourceRouter(Router):
    """A `Router` whose decision is made by `source`, a gate module of another library called
    through `route(source, x [T, M]) -> (logits [T, E], weights [T, k], experts [T, k])`.

    `weight` (`[E, M]`) is `weight_of(source)`, the same parameter. Balance and z losses are
    zero (the source model adds its own auxiliary loss from the logits, as before); dropless.
    `expert_bias` (`[E]` float32), when given, is this router's buffer, passed by `route`."""

    def __init__(
        self,
        source: nn.Module,
        weight: nn.Parameter,
        top_k: int,
        route: RouteFn,
        *,
        score: str = "softmax",
        renormalize: bool = True,
        expert_bias: torch.Tensor | None = None,
    ) -> None:
        E, M = weight.shape
        super().__init__(
            M, E, top_k, score=score, renormalize=renormalize,  # type: ignore[arg-type]
            expert_bias=expert_bias is not None, device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        self.weight = weight  # the gate's own parameter, tied
        self.source = source
        self._route = route
        if expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.copy_(expert_bias)

    def reset_parameters(self) -> None:
        """The weights are the source gate's: nothing to draw."""

    def forward(self, x: torch.Tensor) -> Routing:
        """`x [T, M]` -> `Routing`: the source gate's experts and weights, the step's counts."""
        logits, weights, experts = self._route(self, x)
        counts = count_values(experts, self.num_experts)
        zero = logits.new_zeros((), dtype=torch.float32)
        return Routing(experts, weights, counts, None, logits, zero, zero, zero)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, source={type(self.source).__name__}"


class CastExperts(Experts):
    """`Experts` whose FFNs compute in `compute_dtype` (None: the weights' own dtype): rows and
    weights cast to it for the GEMMs (gradients flow back to the weights' dtype), the output
    cast back to the input's dtype, as torchtitan's `GroupedExperts` computes in bfloat16 with
    float32 weights."""

    def __init__(
        self,
        num_slots: int,
        d_model: int,
        d_expert: int,
        activation: Activation = "swiglu",
        *,
        compute_dtype: torch.dtype | None = None,
        impl: ExpertsImpl = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_slots, d_model, d_expert, activation, impl=impl, device=device, dtype=dtype
        )
        self.compute_dtype = compute_dtype

    def forward(
        self, x: torch.Tensor, tokens_per_slot: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """`x [T, M]` rows grouped by slot in slot order; `tokens_per_slot [P]` -> `[T, M]`."""
        dtype = self.compute_dtype
        if dtype is None or (x.dtype == dtype and self.w_in.dtype == dtype):
            return super().forward(x, tokens_per_slot)
        w_gate = None if self.w_gate is None else self.w_gate.to(dtype)
        y = self._run(
            x.contiguous().to(dtype), tokens_per_slot, self.w_in.to(dtype), w_gate,
            self.w_out.to(dtype),
        )  # fmt: skip
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute_dtype={self.compute_dtype}"


__all__ = ["CastExperts", "RouteFn", "SourceRouter"]
