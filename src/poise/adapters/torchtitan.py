"""torchtitan's MoE module made balanceable.

    model = ...                                   # a torchtitan model with `moe` modules
    convert_torchtitan_moe(model)                 # in place: every torchtitan.models.common.moe.MoE
    apply_expert_parallel(model, group, num_slots=E // D + 1)   # then as the README's snippet

Each `torchtitan.models.common.moe.MoE` (torchtitan 0.3) is replaced in its parent by a
`PoiseTorchtitanMoE` of the same forward, `x [B, L, M] -> [B, L, M]`. Weights (`M` = dim,
`F` = hidden_dim, `E` experts):

- `router` (`TokenChoiceTopKRouter`): kept, module and `gate.weight [E, M]`, and called for the
  routing (`adapters.routing.SourceRouter`): its score function, top-k, `route_norm`,
  `route_scale`, node-limited groups as torchtitan computes them;
- `routed_experts.inner_experts.w1_EFD [E, F, M]` -> `w_gate [E, M, F]`, `w3_EFD [E, F, M]` ->
  `w_in [E, M, F]`, `w2_EDF [E, M, F]` -> `w_out [E, F, M]` (each transposed): torchtitan's
  `w2(silu(w1 x) * w3 x)` is Poise's SwiGLU;
- `shared_experts` (a `FeedForward`), kept as it is and added to the routed output;
- `expert_bias_E [E]` (auxiliary-loss-free balancing): the Poise router's `expert_bias`
  buffer, reachable under its torchtitan name, with `tokens_per_expert_E [E]` (float32, counted
  in training forwards) and `load_balance_coeff`: torchtitan's optimizer pre-step hook that
  updates the bias keeps working on the converted module (or use `poise.nn.install_bias_update`).

torchtitan's grouped experts compute in bfloat16 from float32 weights; the converted experts
do the same by default (`compute_dtype=torch.bfloat16`; None computes in the weights' dtype),
so the converted layer gives torchtitan's outputs (`tests/test_adapters_torchtitan.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from poise.adapters.routing import CastExperts, SourceRouter
from poise.core.errors import ConfigError
from poise.nn.config import MoEConfig
from poise.nn.experts import ExpertsImpl
from poise.nn.moe import MoE

SOURCE = "torchtitan.models.common.moe"


def _moe_class() -> type[nn.Module]:
    try:
        from torchtitan.models.common.moe import MoE as TitanMoE
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "the torchtitan adapter needs torchtitan 0.3: pip install 'poise[bench]'",
            field="torchtitan",
        ) from exc
    return TitanMoE


def _route_titan(router: SourceRouter, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """torchtitan's router on `x [T, M]` (as one sequence): `(scores [T, E], top-k scores
    [T, k], experts [T, k])`, the expert bias added for the choice as torchtitan adds it."""
    top_scores, experts, scores = router.source(x.unsqueeze(0), router.expert_bias)
    return scores.squeeze(0), top_scores.squeeze(0), experts.squeeze(0)


class PoiseTorchtitanMoE(nn.Module):
    """A torchtitan MoE whose routed experts are a `poise.nn.MoE` (`moe`), which the Balancer
    balances; `forward(x [B, L, M]) -> [B, L, M]` as torchtitan's.

    `moe.router.source` is torchtitan's router; `shared_experts` torchtitan's, or None;
    `expert_bias_E` (a view of `moe.router.expert_bias`, or None), `tokens_per_expert_E [E]`
    and `load_balance_coeff` as torchtitan's MoE has them."""

    tokens_per_expert_E: torch.Tensor

    def __init__(
        self,
        source: nn.Module,
        *,
        compute_dtype: torch.dtype | None = torch.bfloat16,
        experts_impl: ExpertsImpl = "auto",
    ) -> None:
        super().__init__()
        router, inner = source.router, source.routed_experts.inner_experts
        w1, w2, w3 = inner.w1_EFD, inner.w2_EDF, inner.w3_EFD
        from torch.distributed.tensor import DTensor

        if any(isinstance(w, DTensor) for w in (w1, w2, w3)):
            raise ConfigError(
                "convert torchtitan's MoE before parallelising it (its expert weights are "
                "DTensors)",
                field="experts",
            )
        E, Fh, M = w1.shape
        top_k = int(router.top_k)
        bias = getattr(source, "expert_bias_E", None)
        config = MoEConfig(
            d_model=M, d_expert=Fh, num_experts=E, top_k=top_k, score=router.score_func,
            renormalize=bool(router.route_norm), expert_bias=bias is not None,
            experts_impl=experts_impl, init_seed=0,
        )  # fmt: skip
        poise_router = SourceRouter(
            router, router.gate.weight, top_k, _route_titan, score=router.score_func,
            renormalize=bool(router.route_norm), expert_bias=bias,
        )  # fmt: skip
        kw: dict[str, Any] = {"device": w1.device, "dtype": w1.dtype}
        self.moe = MoE(config, router=poise_router, **kw)
        self.moe.experts = CastExperts(
            E, M, Fh, "swiglu", compute_dtype=compute_dtype, impl=experts_impl, **kw
        )
        with torch.no_grad():
            self.moe.load_expert_weights(
                {
                    "w_gate": w1.transpose(1, 2).contiguous(),
                    "w_in": w3.transpose(1, 2).contiguous(),
                    "w_out": w2.transpose(1, 2).contiguous(),
                }
            )
        self.shared_experts: nn.Module | None = source.shared_experts
        self.load_balance_coeff = source.load_balance_coeff
        counted = getattr(source, "tokens_per_expert_E", None)
        start = counted.detach().clone() if counted is not None else torch.zeros(E)
        self.register_buffer("tokens_per_expert_E", start.float(), persistent=False)

    @property
    def expert_bias_E(self) -> torch.Tensor | None:
        """torchtitan's name for the router's expert bias `[E]` (the same tensor)."""
        return self.moe.router.expert_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [B, L, M]` -> `[B, L, M]`: routed experts plus the shared experts."""
        y = self.moe(x)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(self.moe.last_counts.to(torch.float32))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def convert_torchtitan_moe(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype | None = torch.bfloat16,
    experts_impl: ExpertsImpl = "auto",
) -> list[str]:
    """Replace, in place, every torchtitan MoE of `model` by a `PoiseTorchtitanMoE` holding its
    weights; returns the replaced modules' names (`model` itself may not be one: wrap it).
    Call it before parallelising, `apply_expert_parallel` and building the optimizer (the
    expert weights are new parameters). `ConfigError` where there is none."""
    titan_moe = _moe_class()
    names = [n for n, m in model.named_modules() if isinstance(m, titan_moe) and n]
    if not names:
        raise ConfigError(f"the model has no {SOURCE}.MoE below its root", field="model")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = PoiseTorchtitanMoE(
            getattr(parent, child), compute_dtype=compute_dtype, experts_impl=experts_impl
        )
        setattr(parent, child, new)  # a ModuleList's or ModuleDict's entry too
    return names


__all__ = ["PoiseTorchtitanMoE", "convert_torchtitan_moe"]
