"""Per-expert keys in an expert-parallel MoE layer's `state_dict`, so that any
`torch.distributed.checkpoint` (DCP) checkpointer saves every rank's experts.

Under expert parallelism each rank's `experts.w_in` is `[S, D, H]`: its own slots, under the one
name every rank shares. A checkpointer that saves `model.state_dict()` with DCP (torchtitan's
does) takes plain tensors of one name on several ranks for replicas of one tensor and writes one
rank's, losing the others' experts. `apply_expert_parallel` therefore registers two hooks on
each `MoE` it converts:

- a state-dict post-hook that replaces `<layer>.experts.<w>` by one entry per expert this rank
  is the home of, `<layer>.experts.<w>.expert_<e>` (`e` the global expert id, the row
  `w[slot]`, a view of the weight: no copy), in expert order. Every expert has one home, so over
  the ranks every key appears once; replicas are left out (Trans refreshes them from the home).
  Keys name logical experts, not slots: a placement the Balancer changed saves the same keys.
- a load pre-hook that turns those entries back into the stacked `<layer>.experts.<w>` before
  the weights load: each held slot takes its expert's entry (a replica slot keeps its rows where
  the entry is absent; a home whose entry is absent is a missing key `...expert_<e>`), empty
  slots keep theirs, and the other experts' entries are dropped (a full checkpoint loads on any
  rank). A stacked `<layer>.experts.<w>` of all `E` experts (a model without expert
  parallelism) is read by expert id too.

Each expert weight also carries an attribute `expert_<e>` (None) for every expert id, so that
tools resolving keys by attribute (`torch.distributed.checkpoint.state_dict.get_model_state_dict`
and `set_model_state_dict`, which torchtitan's checkpointer calls) find them.

So `dcp.save(model.state_dict())` writes each expert once, from its home, and `sd =
model.state_dict(); dcp.load(sd); model.load_state_dict(sd)` reads back this rank's homes,
whatever placement each side ran. The optimizer's moments get the same keys from
`poise.runtime.optimizer_keys.register_expert_optimizer_keys` (Poise's own
checkpoints, `poise.train.checkpoint`, key them per expert too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from poise.nn.moe import EXPERT_WEIGHTS, MoE

EXPERT_KEY = "expert_"


def expert_key(base: str, expert: int) -> str:
    """The state-dict key of expert `expert`'s row of the weight named `base`
    (`<layer>.experts.<w>`)."""
    return f"{base}.{EXPERT_KEY}{int(expert)}"


def split_expert_key(key: str) -> tuple[str, int] | None:
    """`(base, expert)` of a per-expert key, None for any other."""
    base, _, last = key.rpartition(".")
    if not base or not last.startswith(EXPERT_KEY) or not last[len(EXPERT_KEY) :].isdigit():
        return None
    return base, int(last[len(EXPERT_KEY) :])


def home_slots(moe: MoE) -> list[tuple[int, int]]:
    """`(expert, slot)` of this rank's home slots, in expert order."""
    slots = moe.routing.slots
    held = [(int(e), s) for s, e in enumerate(slots.expert.tolist()) if e >= 0 and slots.home[s]]
    return sorted(held)


def _state_dict_post_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    moe = module
    assert isinstance(moe, MoE)
    homes = home_slots(moe)
    for name in EXPERT_WEIGHTS:
        w = getattr(moe.experts, name)
        base = f"{prefix}experts.{name}"
        if w is None or base not in state_dict:
            continue
        del state_dict[base]
        rows = w.detach()
        for e, slot in homes:
            state_dict[expert_key(base, e)] = rows[slot]


def _load_state_dict_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    moe = module
    assert isinstance(moe, MoE)
    slots = moe.routing.slots
    E = moe.num_experts
    for name in EXPERT_WEIGHTS:
        w = getattr(moe.experts, name)
        if w is None:
            continue
        base = f"{prefix}experts.{name}"
        rows: dict[int, torch.Tensor] = {}
        for key in [k for k in state_dict if k.startswith(base + ".")]:
            parsed = split_expert_key(key)
            if parsed is not None and parsed[0] == base:
                rows[parsed[1]] = state_dict.pop(key)
        full = state_dict.get(base)
        if not rows and full is not None and tuple(full.shape) == (E, *w.shape[1:]):
            rows = {e: full[e] for e in range(E)}  # a layer without expert parallelism
        elif not rows:
            continue  # nothing for this weight: torch reports `base` missing where strict
        stacked = w.detach().clone()
        with torch.no_grad():
            for slot, e in enumerate(slots.expert.tolist()):
                if e < 0:
                    continue
                if e in rows:
                    stacked[slot].copy_(rows[e])
                elif slots.home[slot]:
                    missing_keys.append(expert_key(base, e))
        state_dict[base] = stacked


def register_expert_keys(moe: MoE) -> None:
    """Register the per-expert state-dict hooks on `moe` (once; see the module docstring), and
    give each expert weight an attribute `expert_<e>` (None) for every expert id: tools that
    resolve state-dict keys by walking attributes (`torch.distributed.checkpoint.state_dict`'s
    `get_model_state_dict`, which torchtitan's checkpointer calls) then find the keys."""
    for w in moe.experts.weights():
        for e in range(moe.num_experts):
            setattr(w, f"{EXPERT_KEY}{e}", None)
    if getattr(moe, "_poise_expert_keys", False):
        return
    moe.register_state_dict_post_hook(_state_dict_post_hook)
    moe.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    moe._poise_expert_keys = True


__all__ = ["EXPERT_KEY", "expert_key", "home_slots", "register_expert_keys", "split_expert_key"]
