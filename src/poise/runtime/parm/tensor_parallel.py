"""Collectives with autograd for MP + EP + ESP, and model-parallel attention (Megatron style).

Tokens that leave attention are *duplicated* on the M ranks of an MP group (same tensor, and in
backward the same full gradient, on every rank); these keep that convention (Megatron-LM's
conjugate pairs, Shoeybi et al. 2019):

| function | forward | backward | used for |
| --- | --- | --- | --- |
| `copy_to_group` (f) | identity | all-reduce | input of a column-parallel linear |
| `reduce_from_group` (g) | all-reduce | identity | output of a row-parallel linear |
| `split_rows` | keep my rows | all-gather | Parm's MP-Split (pause MP) |
| `gather_rows` | all-gather | keep my rows | Parm's MP-AllGather (resume MP) |
| `all_gather_rows` | all-gather | reduce-scatter | ESP-AllGather before the experts |
| `reduce_scatter_rows` | reduce-scatter | all-gather | ESP-ReduceScatter after them |

The first four map duplicated tensors to duplicated gradients; the last two are exact adjoints
for distinct rows. With `dup=True` (DeepSpeed-MoE's schedule: the M gathered copies of a row are
the same row) the all-gather's backward is scaled by M and the reduce-scatter's by 1/M, so the
expert weights get the row's gradient once and the duplicated input its full gradient. Row
counts may differ between ranks (`sizes`, one per rank, known on every rank): buffers are padded
to the largest and cut back.

`ParallelAttention` is `poise.models.gpt.Attention` with its heads split over the MP group:
`qkv` column-parallel, `proj` row-parallel, f before and g after (output duplicated again).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

from poise.core.errors import ConfigError
from poise.models.gpt import Attention, apply_rotary
from poise.nn import comm
from poise.runtime.parm.groups import ParallelGroups


# ----------------------------------------------------------------------------- buffers
def _pad_blocks(x: torch.Tensor, sizes: Sequence[int], width: int) -> torch.Tensor:
    """`x [sum(sizes), ...]` -> `[len(sizes), width, ...]`: block i the rows of rank i, padded."""
    if all(n == width for n in sizes):
        return x.reshape(len(sizes), width, *x.shape[1:])
    out = x.new_zeros(len(sizes), width, *x.shape[1:])
    start = 0
    for i, n in enumerate(sizes):
        out[i, :n] = x[start : start + n]
        start += n
    return out


def _unpad_blocks(buf: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """`[len(sizes), width, ...]` -> `[sum(sizes), ...]`: the first `sizes[i]` rows of block i."""
    width = buf.shape[1]
    if all(n == width for n in sizes):
        return buf.reshape(-1, *buf.shape[2:])
    return torch.cat([buf[i, :n] for i, n in enumerate(sizes)])


def _all_gather(x: torch.Tensor, sizes: Sequence[int], group: Any) -> torch.Tensor:
    """Rows of every rank of `group` (`sizes[i]` from rank i), in rank order."""
    width = max(sizes)
    if width == 0:
        return x.new_empty(0, *x.shape[1:])
    if x.shape[0] != width:
        x = torch.cat([x, x.new_zeros(width - x.shape[0], *x.shape[1:])])
    buf = x.new_empty(len(sizes) * x.numel())
    comm.all_gather_single(buf, x.contiguous().view(-1), group=group)
    return _unpad_blocks(buf.view(len(sizes), width, *x.shape[1:]), sizes)


def _reduce_scatter(x: torch.Tensor, sizes: Sequence[int], rank: int, group: Any) -> torch.Tensor:
    """`x [sum(sizes), ...]` summed over `group`; rank i keeps its block of `sizes[i]` rows."""
    width = max(sizes)
    if width == 0:
        return x.new_empty(0, *x.shape[1:])
    buf = _pad_blocks(x.contiguous(), sizes, width).contiguous()
    out = x.new_empty(width, *x.shape[1:])
    comm.reduce_scatter_single(out.view(-1), buf.view(-1), group=group)
    return out[: sizes[rank]]


def even_sizes(rows: int, parts: int) -> list[int]:
    """`rows` cut into `parts` near-equal counts, earlier parts taking the remainder."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def value_or_grad(p: torch.Tensor, grads: bool) -> torch.Tensor:
    """`p` detached, or (`grads`) its gradient, None read as zero."""
    if not grads:
        return p.detach()
    return p.grad if p.grad is not None else torch.zeros_like(p)


# ----------------------------------------------------------------------------- autograd ops
_Op = Literal["identity", "all_reduce", "keep", "all_gather", "reduce_scatter"]


def _run(op: _Op, x: torch.Tensor, sizes: Sequence[int], rank: int, group: Any) -> torch.Tensor:
    """`op` on the rows of `x` over `group` (`keep`: this rank's `sizes[rank]` rows)."""
    if op == "identity":
        return x.view_as(x)
    if op == "all_reduce":
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group)
        return out
    if op == "keep":
        start = sum(sizes[:rank])
        return x[start : start + sizes[rank]].clone()
    if op == "all_gather":
        return _all_gather(x.contiguous(), sizes, group)
    return _reduce_scatter(x, sizes, rank, group)


class _Collective(torch.autograd.Function):
    """A row of the module docstring's table: `fwd` forward, `bwd` backward (times `scale`)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sizes: list[int], group: Any, fwd: _Op, bwd: _Op, scale: float
    ) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.bwd, ctx.sizes, ctx.rank, ctx.group, ctx.scale = bwd, sizes, rank, group, scale
        return _run(fwd, x, sizes, rank, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = _run(ctx.bwd, grad, ctx.sizes, ctx.rank, ctx.group)
        return (out * ctx.scale if ctx.scale != 1.0 else out), None, None, None, None, None


def _collective(
    x: torch.Tensor, sizes: list[int], group: Any, fwd: _Op, bwd: _Op, scale: float = 1.0
) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return _Collective.apply(x, sizes, group, fwd, bwd, scale)


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's f: `x` as is; its gradient is summed over `group`."""
    return _collective(x, [], group, "identity", "all_reduce")


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's g: `x` summed over `group`; its gradient as is."""
    return _collective(x, [], group, "all_reduce", "identity")


def split_rows(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """Parm's MP-Split of duplicated `x [sum(sizes), ...]`: rank i keeps `sizes[i]` rows."""
    return _collective(x, sizes, group, "keep", "all_gather")


def gather_rows(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """Parm's MP-AllGather: `x [sizes[i], ...]` of every rank -> duplicated `[sum(sizes), ...]`."""
    return _collective(x, sizes, group, "all_gather", "keep")


def all_gather_rows(
    x: torch.Tensor, sizes: list[int], group: Any, dup: bool = False
) -> torch.Tensor:
    """ESP-AllGather: `[sizes[i], ...]` of every rank -> `[sum(sizes), ...]` on each."""
    scale = float(len(sizes)) if dup else 1.0
    return _collective(x, sizes, group, "all_gather", "reduce_scatter", scale)


def reduce_scatter_rows(
    x: torch.Tensor, sizes: list[int], group: Any, dup: bool = False
) -> torch.Tensor:
    """ESP-ReduceScatter: `[sum(sizes), ...]` summed over the group, rank i keeps block i."""
    scale = 1.0 / len(sizes) if dup else 1.0
    return _collective(x, sizes, group, "reduce_scatter", "all_gather", scale)


def all_gather_stack(t: torch.Tensor, group: Any) -> torch.Tensor:
    """`[G, *t.shape]`: `t` of every rank of `group` (same shape everywhere), no autograd."""
    g = dist.get_world_size(group)
    if g == 1:
        return t.detach().unsqueeze(0).clone()
    buf = t.new_empty(g * t.numel())
    comm.all_gather_single(buf, t.detach().contiguous().view(-1), group=group)
    return buf.view(g, *t.shape)


def all_gather_cat(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """`t` of every rank of `group` (same shape everywhere) concatenated along `dim`."""
    return torch.cat(all_gather_stack(t, group).unbind(0), dim=dim)


# ----------------------------------------------------------------------------- attention
class ParallelAttention(nn.Module):
    """Causal self-attention with `heads / M` heads per rank of the MP group: `x [B, T, D]`
    (duplicated) -> `[B, T, D]` (duplicated). Parameters: `qkv.weight [3 D / M, D]` (this
    rank's heads' rows of q, then k, then v), `proj.weight [D, D / M]` (their columns);
    `load_full_state_dict` / `full_state_dict` use the full `Attention` keys."""

    def __init__(self, d_model: int, heads: int, groups: ParallelGroups) -> None:
        super().__init__()
        groups.check_model(heads=heads)
        if d_model % heads:
            raise ConfigError(f"must divide d_model={d_model}, got {heads}", field="heads")
        self.groups = groups
        self.d_model = int(d_model)
        self.heads = int(heads)
        self.local_heads = self.heads // groups.mp
        self.head_dim = self.d_model // self.heads
        width = self.local_heads * self.head_dim
        self.qkv = nn.Linear(d_model, 3 * width, bias=False)
        self.proj = nn.Linear(width, d_model, bias=False)

    @classmethod
    def from_attention(cls, attn: Attention, groups: ParallelGroups) -> ParallelAttention:
        """This rank's shard of a full `Attention`."""
        d_model = attn.proj.weight.shape[0]
        out = cls(d_model, attn.heads, groups).to(attn.proj.weight)
        out.load_full_state_dict(attn.state_dict())
        return out

    @torch.no_grad()
    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Fill this rank's shard from full `qkv.weight [3 D, D]`, `proj.weight [D, D]`."""
        D, w = self.d_model, self.local_heads * self.head_dim
        lo = self.groups.local * w
        qkv, proj = sd["qkv.weight"], sd["proj.weight"]
        if qkv.shape != (3 * D, D) or proj.shape != (D, D):
            raise ConfigError(
                f"expected qkv [{3 * D}, {D}] and proj [{D}, {D}], got {list(qkv.shape)} and "
                f"{list(proj.shape)}",
                field="attn",
            )
        self.qkv.weight.copy_(qkv.view(3, D, D)[:, lo : lo + w].reshape(3 * w, D))
        self.proj.weight.copy_(proj[:, lo : lo + w])

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The full `Attention` weights (or gradients; None reads as zero): a collective over
        the MP group."""
        D, w, group = self.d_model, self.local_heads * self.head_dim, self.groups.mp_group
        qkv = all_gather_cat(value_or_grad(self.qkv.weight, grads).view(3, w, D), group, 1)
        proj = all_gather_cat(value_or_grad(self.proj.weight, grads), group, 1)
        return {"qkv.weight": qkv.reshape(3 * D, D), "proj.weight": proj}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        group = self.groups.mp_group
        x = copy_to_group(x, group)
        h, hd = self.local_heads, self.head_dim
        q, k, v = self.qkv(x).view(B, T, 3, h, hd).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, h, T, hd]
        return reduce_from_group(self.proj(y.transpose(1, 2).reshape(B, T, h * hd)), group)

    def extra_repr(self) -> str:
        return f"heads={self.local_heads}/{self.heads}, mp={self.groups.mp}"
