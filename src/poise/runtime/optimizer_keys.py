"""Per-expert keys for the optimizer state of expert-parallel weights, so that a generic
`torch.distributed.checkpoint` (DCP) save of the optimizer keeps every rank's moments.

Under expert parallelism each rank's `experts.<w>` is `[S, D, H]` (its own slots) under the one
name every rank shares, and so are its AdamW moments. `get_optimizer_state_dict` (torchtitan's
checkpointer calls it) keys them by that name, `state.<layer>.experts.<w>.exp_avg`, so DCP takes
the ranks' different tensors for replicas of one and writes one rank's: the others' moments are
lost, and a resumed run steps their experts with another expert's moments.

`register_expert_optimizer_keys(model, optimizer)` registers two hooks on each torch optimizer
inside `optimizer` (containers are looked through as the Balancer looks through them,
`poise.runtime.moves.optimizer_state.leaf_optimizers`):

- a state-dict post-hook that replaces, for each stacked expert weight, every per-slot state
  tensor (`[S, ...]`: `exp_avg`, `exp_avg_sq`) by a mapping with one entry per expert this rank
  is the home of, `expert_<e>` -> the row `t[slot]` (a view, no copy), the same ids the weights'
  keys use (`poise.nn.expert_keys`). Scalars (`step`) stay as they are. DCP flattens the mapping
  to `state.<layer>.experts.<w>.exp_avg.expert_<e>`: each expert once, from its home.
- a load pre-hook that turns such a mapping back into the stacked tensor: each held slot takes
  its expert's row; a slot whose expert is absent (a replica, an empty slot) keeps the moments it
  had (zeros for a fresh optimizer). A home whose expert is absent is a `KeyError` naming it.

Poise's own checkpoints (`poise.train.checkpoint`) key the moments per expert themselves and do
not need the hooks; call this for a checkpointer of your own or torchtitan's.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn

from poise.nn.expert_keys import EXPERT_KEY, home_slots
from poise.nn.moe import EXPERT_WEIGHTS, MoE, find_moe_layers
from poise.runtime.moves.optimizer_state import leaf_optimizers

_REGISTERED = "_poise_expert_optimizer_keys"


def _expert_weights(model: nn.Module) -> dict[int, MoE]:
    """`{id(stacked expert weight): its MoE layer}` of every `MoE` in `model`."""
    out: dict[int, MoE] = {}
    for moe in find_moe_layers(model):
        for name in EXPERT_WEIGHTS:
            w = getattr(moe.experts, name, None)
            if w is not None:
                out[id(w)] = moe
    return out


def _is_per_slot(value: Any, weight: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == weight.shape


def _by_expert(layers: dict[int, MoE]) -> Any:
    def post_hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
        state = state_dict["state"]
        for index, p in enumerate(params):
            moe = layers.get(id(p))
            if moe is None or index not in state:
                continue
            homes = home_slots(moe)
            entry = dict(state[index])
            for name, value in entry.items():
                if _is_per_slot(value, p):
                    entry[name] = {f"{EXPERT_KEY}{e}": value[slot] for e, slot in homes}
            state[index] = entry
        return state_dict

    return post_hook


def _stacked(layers: dict[int, MoE]) -> Any:
    def pre_hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
        state = dict(state_dict["state"])
        for key, p in zip(saved, params, strict=False):
            moe = layers.get(id(p))
            if moe is None or key not in state:
                continue
            entry = dict(state[key])
            for name, value in entry.items():
                if isinstance(value, Mapping) and all(str(k).startswith(EXPERT_KEY) for k in value):
                    entry[name] = _stack_rows(opt, p, name, value, moe, key)
            state[key] = entry
        return {**state_dict, "state": state}

    return pre_hook


def _stack_rows(
    opt: torch.optim.Optimizer,
    p: torch.Tensor,
    name: str,
    rows: Mapping[str, torch.Tensor],
    moe: MoE,
    key: Any,
) -> torch.Tensor:
    """`[S, ...]` the state `name` of the stacked weight `p`: each held slot its expert's row
    from `rows`, the others what the optimizer holds (zeros where it holds nothing)."""
    current = opt.state.get(p, {}).get(name)
    stacked = (
        current.detach().clone()
        if _is_per_slot(current, p)
        else torch.zeros_like(p, memory_format=torch.contiguous_format)
    )
    slots = moe.routing.slots
    with torch.no_grad():
        for slot, e in enumerate(slots.expert.tolist()):
            if e < 0:
                continue
            row = rows.get(f"{EXPERT_KEY}{e}")
            if row is not None:
                stacked[slot].copy_(row)
            elif slots.home[slot]:
                raise KeyError(f"optimizer state {key}.{name}: no {EXPERT_KEY}{e} (a home here)")
    return stacked


def register_expert_optimizer_keys(model: nn.Module, optimizer: Any) -> int:
    """Register the per-expert hooks (see the module docstring) on every torch optimizer inside
    `optimizer` that holds an expert weight of `model`'s `MoE` layers, once each; returns how
    many optimizers carry them."""
    layers = _expert_weights(model)
    count = 0
    for opt in leaf_optimizers(optimizer):
        held = any(id(p) in layers for g in opt.param_groups for p in g["params"])
        if not held:
            continue
        count += 1
        if getattr(opt, _REGISTERED, False):
            continue
        opt.register_state_dict_post_hook(_by_expert(layers))
        opt.register_load_state_dict_pre_hook(_stacked(layers))
        setattr(opt, _REGISTERED, True)
    return count


__all__ = ["register_expert_optimizer_keys"]
