"""The tensors of a Poise checkpoint as a `torch.distributed.checkpoint` (DCP) state dict.

Keys (flat; each tensor stored once, by the rank that owns it):

- `model.dense.<name>`: every non-expert tensor of the model's state dict (replicated on all
  ranks; global rank 0 saves it);
- `model.experts.<layer>.<w>.<e>`: expert `e`'s weight `w` (`w_in`, `w_gate`, `w_out`) of MoE
  layer `<layer>` (a module name such as `blocks.0.ffn`), shape `w.shape[1:]`, saved by the
  rank holding e's home slot (in a layout, the home in the EP group that holds global rank 0);
- `optim.dense.<name>.<k>`: AdamW state `k` (`exp_avg`, `exp_avg_sq`, `step`) of a dense
  parameter (global rank 0);
- `optim.experts.<layer>.<w>.<e>.<k>`: expert e's moments (tensors of the weight's row shape),
  from its home; `optim.experts.<layer>.<w>.<k>`: the weight's other state (`step`), global
  rank 0.

Because experts are keyed by global id, a rank of any world that fits reads exactly the rows
its slots hold: DCP's resharding is by key, Poise's placement decides which keys a rank asks for.

Under FSDP2 (`fsdp: true`) the dense tensors and their moments are `DTensor`s: every rank saves
its shard under the same keys (DCP writes the shards, one global tensor per key), so the files
are those of the all-reduce path, and either path resumes from the other's checkpoints. The
model's own per-expert state-dict entries (`poise.nn.expert_keys`) are not saved twice: the
experts are the `model.experts.` keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from poise.nn.expert_keys import split_expert_key
from poise.nn.fsdp import is_dtensor
from poise.nn.moe import EXPERT_WEIGHTS, MoE, find_moe_layers


def expert_layer_names(model: nn.Module) -> dict[int, str]:
    """`{id(moe): module name}` of the model's MoE layers."""
    return {id(m): name for name, m in model.named_modules() if isinstance(m, MoE)}


def expert_param_names(model: nn.Module) -> set[str]:
    """State-dict names of the expert weights (`<layer>.experts.<w>`)."""
    names = set()
    layers = expert_layer_names(model)
    for m in find_moe_layers(model):
        for w_name in EXPERT_WEIGHTS:
            if getattr(m.experts, w_name) is not None:
                names.add(f"{layers[id(m)]}.experts.{w_name}")
    return names


def is_expert_entry(key: str, expert_names: set[str]) -> bool:
    """Whether the state-dict key `key` is an expert weight (`expert_param_names`) or one
    expert's row of one (`<layer>.experts.<w>.expert_<e>`, `poise.nn.expert_keys`)."""
    if key in expert_names:
        return True
    parsed = split_expert_key(key)
    return parsed is not None and parsed[0] in expert_names


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without its experts (DTensors under FSDP)."""
    names = expert_param_names(model)
    return {k: v for k, v in model.state_dict().items() if not is_expert_entry(k, names)}


def expert_weights(model: nn.Module) -> list[tuple[str, MoE, str, torch.Tensor]]:
    """`(layer name, layer, weight name, weight [S, ...])` for every expert weight."""
    layers = expert_layer_names(model)
    out = []
    for moe in find_moe_layers(model):
        for w_name in EXPERT_WEIGHTS:
            w = getattr(moe.experts, w_name)
            if w is not None:
                out.append((layers[id(moe)], moe, w_name, w))
    return out


def home_slots(moe: MoE) -> list[tuple[int, int]]:
    """`(slot, expert)` of this rank's home slots in `moe`."""
    slots = moe.routing.slots
    return [(s, e) for s, e in enumerate(slots.expert.tolist()) if e >= 0 and slots.home[s]]


def held_slots(moe: MoE) -> list[tuple[int, int]]:
    """`(slot, expert)` of every slot holding an expert (homes and replicas)."""
    return [(s, e) for s, e in enumerate(moe.routing.slots.expert.tolist()) if e >= 0]


def _cpu(v: torch.Tensor) -> torch.Tensor:
    if is_dtensor(v):  # a shard, where its mesh is (DCP stages it)
        return v.detach().clone()
    return v.detach().cpu().clone()


def state_to_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, dense: bool, experts: bool
) -> dict[str, torch.Tensor]:
    """This rank's share of the checkpoint's tensors (CPU copies): the dense tensors and the
    replicated optimizer scalars when `dense` (DTensor ones, FSDP's shards, on every rank), its
    home experts' rows and moments when `experts`."""
    out: dict[str, torch.Tensor] = {}
    expert_names = expert_param_names(model)
    # DTensors (FSDP's shards) from every rank; plain tensors from the rank that saves `dense`
    for k, v in dense_state(model).items():
        if dense or is_dtensor(v):
            out[f"model.dense.{k}"] = _cpu(v)
    for name, p in model.named_parameters():
        if name in expert_names:
            continue
        for k, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and (dense or is_dtensor(v)):
                out[f"optim.dense.{name}.{k}"] = _cpu(v)
    for lname, moe, w_name, w in expert_weights(model):
        state = optimizer.state.get(w, {})
        base = f"{lname}.{w_name}"
        if dense:
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape != w.shape:
                    out[f"optim.experts.{base}.{k}"] = _cpu(v)
        if not experts:
            continue
        for slot, e in home_slots(moe):
            out[f"model.experts.{base}.{e}"] = _cpu(w[slot])
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape == w.shape:
                    out[f"optim.experts.{base}.{e}.{k}"] = _cpu(v[slot])
    return out


def optimizer_state_names(
    saved: dict[str, Any], model: nn.Module
) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[str]]]:
    """From the checkpoint's keys `saved`: per dense parameter its saved state names; per
    expert weight (`<layer>.<w>`) its per-expert state names (moments) and its other ones."""
    expert_names = expert_param_names(model)
    dense: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if name in expert_names:
            continue
        prefix = f"optim.dense.{name}."
        dense[name] = [k[len(prefix) :] for k in saved if k.startswith(prefix)]
        dense[name] = [k for k in dense[name] if "." not in k]
    rows: dict[str, list[str]] = {}
    other: dict[str, list[str]] = {}
    for lname, _, w_name, _ in expert_weights(model):
        base = f"{lname}.{w_name}"
        prefix = f"optim.experts.{base}."
        rest = [k[len(prefix) :] for k in saved if k.startswith(prefix)]
        other[base] = [k for k in rest if "." not in k]
        rows[base] = sorted({k.split(".", 1)[1] for k in rest if k.split(".", 1)[0].isdigit()})
    return dense, rows, other


__all__ = [
    "dense_state",
    "expert_layer_names",
    "expert_param_names",
    "expert_weights",
    "held_slots",
    "home_slots",
    "is_expert_entry",
    "optimizer_state_names",
    "state_to_save",
]
