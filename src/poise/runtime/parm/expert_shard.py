"""Expert-sharding parallelism (ESP): every expert's hidden dimension split over the MP group.

Expert e (`E_loc = E / EP` per node) lives on node `e // E_loc`, slot `e % E_loc` of each of the
node's `M` ranks; rank `local` holds hidden units `[local H / M, (local + 1) H / M)` of it
(`H = d_expert`): `w_in`, `w_gate [E_loc, D, H / M]` (columns of W1), `w_out [E_loc, H / M, D]`
(rows of W2). Then `y_e(x) = sum_j y_e^(j)(x)` over the M shards' partial outputs (GELU and
SwiGLU act on each hidden unit alone). A token reaches all M shards of its expert by:

- `EspExpertFn` ("baseline", "s1"): the EP all-to-all delivers it to one rank of the node;
  ESP-AllGather gives every rank the node's tokens, each runs its shard, ESP-ReduceScatter sums
  the partial outputs and hands each rank back its rows.
- `virtual_experts` ("s2"): shard j of expert e is virtual expert `(node(e) M + j) E_loc +
  e % E_loc` on rank `node(e) M + j`; choosing e chooses its M virtual experts with the same
  weight, so one all-to-all over the world reaches every shard and the combine sums them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from poise.core.errors import ConfigError
from poise.nn.dispatch import PermuteRows, gather_index, inverse
from poise.nn.experts import Experts
from poise.runtime.parm.groups import ParallelGroups
from poise.runtime.parm.tensor_parallel import (
    all_gather_cat,
    all_gather_rows,
    all_gather_stack,
    reduce_scatter_rows,
    value_or_grad,
)

EXPERT_KEYS: tuple[str, ...] = ("w_in", "w_gate", "w_out")


def hidden_dim(name: str) -> int:
    """The axis of `[E, ...]` stacked weight `name` that ESP splits (W1 columns, W2 rows)."""
    return 1 if name == "w_out" else 2


def shard_experts(
    full: Mapping[str, torch.Tensor], groups: ParallelGroups
) -> dict[str, torch.Tensor]:
    """This rank's rows and hidden slice of full stacked weights `full[name] [E, ...]`."""
    out = {}
    for name, w in full.items():
        E, H = w.shape[0], w.shape[hidden_dim(name)]
        e_loc, h_loc = E // groups.ep, H // groups.esp
        rows = w[groups.node * e_loc : (groups.node + 1) * e_loc]
        out[name] = rows.narrow(hidden_dim(name), groups.local * h_loc, h_loc)
    return out


def gather_experts(
    experts: Experts, groups: ParallelGroups, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Full stacked weights (or gradients; None reads as zero) `[E, ...]`: all-gather over the
    MP group (hidden slices), then over the EP group (experts)."""
    out = {}
    for name in EXPERT_KEYS:
        p = getattr(experts, name)
        if p is None:
            continue
        node = all_gather_cat(value_or_grad(p, grads), groups.mp_group, hidden_dim(name))
        out[name] = all_gather_cat(node, groups.ep_group, 0)  # [E_loc, full H, ...] -> [E, ...]
    return out


def check_full_experts(
    full: Mapping[str, torch.Tensor], num_experts: int, d_model: int, d_expert: int, swiglu: bool
) -> None:
    """Refuse full expert weights of the wrong shape (`ConfigError` naming the key)."""
    shapes = {"w_in": (num_experts, d_model, d_expert), "w_out": (num_experts, d_expert, d_model)}
    if swiglu:
        shapes["w_gate"] = (num_experts, d_model, d_expert)
    for name, shape in shapes.items():
        if name not in full:
            raise ConfigError("missing from the full expert weights", field=name)
        if tuple(full[name].shape) != shape:
            raise ConfigError(f"must be {list(shape)}, got {list(full[name].shape)}", field=name)


class EspExpertFn:
    """The EP dispatcher's expert function under ESP: `(rows [R, D] grouped by slot,
    tokens_per_slot [S]) -> [R, D]`. All-gathers the MP group's `[M, S]` counts and its rows
    (blocks (rank, slot), regrouped to (slot, rank)), runs this rank's shards, then back to
    (rank, slot) and ESP-ReduceScatter: each rank gets its rows summed over the M shards.
    `dup=True`: DeepSpeed-MoE's schedule, the M ranks hold the same rows (`tensor_parallel`).
    Every rank of the MP group calls it equally often, in the same order."""

    def __init__(self, experts: Experts, groups: ParallelGroups, dup: bool) -> None:
        self.experts = experts
        self.groups = groups
        self.dup = dup

    def __call__(
        self, rows: torch.Tensor, tokens_per_slot: torch.Tensor | list[int]
    ) -> torch.Tensor:
        group = self.groups.mp_group
        tps = torch.as_tensor(tokens_per_slot, dtype=torch.long).reshape(-1).to(rows.device)
        every = all_gather_stack(tps, group).cpu().numpy()  # [M, S]
        M, S = every.shape
        sizes = every.sum(axis=1).tolist()
        x = all_gather_rows(rows, sizes, group, dup=self.dup)
        # gathered blocks (rank, slot); wanted (slot, rank)
        blocks = (np.arange(M)[None, :] * S + np.arange(S)[:, None]).ravel()
        perm = gather_index(every, blocks)
        identity = np.array_equal(perm, np.arange(perm.shape[0]))
        if not identity:
            p = torch.from_numpy(perm).to(rows.device)
            inv = torch.from_numpy(inverse(perm)).to(rows.device)
            x = PermuteRows.apply(x, p, inv)
        out = self.experts(x, every.sum(axis=0).tolist())
        if not identity:
            out = PermuteRows.apply(out, inv, p)
        return reduce_scatter_rows(out, sizes, group, dup=self.dup)


def virtual_experts(experts: torch.Tensor, experts_per_node: int, mp: int) -> torch.Tensor:
    """`experts [T, k]` -> `[T, k M]`: each choice e replaced by its M shards' virtual experts
    `(e // E_loc * M + j) * E_loc + e % E_loc`, j = 0..M-1 (choice-major, shard-minor)."""
    node = experts // experts_per_node
    slot = experts % experts_per_node
    base = node * (mp * experts_per_node) + slot  # [T, k]
    shards = torch.arange(mp, device=experts.device) * experts_per_node  # [M]
    return (base.unsqueeze(-1) + shards).reshape(experts.shape[0], -1)
