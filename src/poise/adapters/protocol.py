"""What the Balancer needs from an MoE layer: the `BalanceableMoE` protocol.

The Balancer (`poise.runtime.balancer`) and its moves read and call exactly these members of a
layer, and nothing else (`M = d_model`, `H = d_expert`, `E` experts, `P` expert slots on this
rank, `D` ranks of the expert-parallel group, `T` tokens of this rank):

- shape: `num_experts` (E), `top_k`;
- the group: `group` (a process group, or None for one process), `world` (D), `rank`;
- loads: `last_counts [E]` (long), the assignments this rank's router made in the last forward,
  before any drop; `last_forward.rows` (token-expert rows this rank's slots computed) and
  `last_forward.seconds` (wall seconds per phase: `gate`, `dispatch`, `experts`, `combine`);
  `take_nonfinite()`, a `[]` bool flag of NaN or infinity seen since the last call (reset);
- weights: `experts.weights()`, the stacked per-slot expert tensors in a fixed order, each
  `[P, ...]` with slot `i` in row `i` (`w_in [P, M, H]`, `w_gate [P, M, H]` for SwiGLU,
  `w_out [P, H, M]`), plain `nn.Parameter`s that the optimizer steps: the runtime copies whole
  rows of them, of their gradients and of their optimizer state between ranks;
  `experts.w_in` and `experts.activation` ("swiglu" | "gelu") price the experts;
- routing: `routing`, the `poise.nn.RankRouting` in force (static EP's before any plan), and
  `set_routing(placement, assignment, slot_map, layer)`, which from the next forward on must
  send this rank's tokens for expert e to the ranks `assignment` gives (weights `[E, D]`) and
  compute slot `i`'s rows with expert `slot_map.expert[i]` (homes first, then replicas);
- a torch module: `training`, forward hooks and forward pre-hooks (the Balancer counts loads
  after each forward and waits for a layer's replicas before it), and gradient hooks on the
  expert tensors (Agg starts when a layer's expert gradients are in).

`poise.nn.MoE` implements it; so does any layer `poise.adapters` converts, since the converted
module holds a `poise.nn.MoE` (`convert_torchtitan_moe`, `convert_hf_moe`). A layer of one's
own can implement the members itself (routing by `set_routing` is the hard part: a token
dispatcher that sends tokens by an `Assignment`); the Balancer finds every module of a model
that has them (`find_balanceable`), the outermost where one is nested in another.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from poise.core.placement import Assignment, Placement
from poise.nn.dispatch import RankRouting
from poise.nn.slots import SlotMap


@runtime_checkable
class StackedExperts(Protocol):
    """A layer's expert slots: stacked tensors `[P, ...]`, one row per slot."""

    activation: str
    w_in: torch.Tensor  # [P, M, H]

    def weights(self) -> list[nn.Parameter]: ...


@runtime_checkable
class BalanceableMoE(Protocol):
    """An MoE layer the Balancer can balance (module docstring: what each member means)."""

    num_experts: int
    top_k: int
    group: Any
    world: int
    rank: int
    training: bool
    experts: StackedExperts
    routing: RankRouting
    last_counts: torch.Tensor  # [E] long
    last_forward: Any  # `.rows` (int), `.seconds` (dict of phase -> seconds)

    def set_routing(
        self, placement: Placement, assignment: Assignment, slot_map: SlotMap, layer: int = 0
    ) -> None: ...

    def take_nonfinite(self) -> torch.Tensor: ...

    def register_forward_hook(self, hook: Any) -> Any: ...

    def register_forward_pre_hook(self, hook: Any) -> Any: ...


def find_balanceable(model: nn.Module) -> list[BalanceableMoE]:
    """The modules of `model` (which may itself be one) that implement `BalanceableMoE`, in
    module order; inside one that does, its submodules are not looked at."""
    found: list[BalanceableMoE] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, BalanceableMoE):
            found.append(module)
            inside.append(name)
            if name == "":
                break
    return found


__all__ = ["BalanceableMoE", "StackedExperts", "find_balanceable"]
