"""HybridEP's parameter-efficient migration: expert rows sent as a shared expert plus a sparse
residual (Yang et al., arXiv 2510.19470, §IV-B "SR-based expert compression").

Every rank keeps a layer's *shared expert*, the mean of its E experts (`shared_expert`), in
sync. A replica row is sent as the top-k entries (by magnitude) of the *residual*
`expert - shared` in value-index form and rebuilt as `shared + residual`, other entries zero.
`ratio` is the fraction of residual entries kept (HybridEP's compression ratio CR = `1 / ratio`;
its Fig. 14 keeps the loss at CR = 50, `ratio = 0.02`).

One row of `n` entries (one tensor of one expert, e.g. `w_in [D, H]`), values of `b_v` bytes
(the parameters' dtype), indices int32 (`b_i` = 4; int64 beside 8-byte values):

    k = clamp(ceil(ratio * n), 1, n)                 (entries kept)
    bytes = min(k (b_v + b_i), n b_v)                (sparse, or dense when that is smaller)

Dense rows (`ratio >= 0.5` for fp32, `>= 1/3` for bf16, always at 1) carry the expert: exact.

Compression changes training's mathematics (a replica computes with approximate weights; its
gradient is still summed into the exact home by Agg), so it is off unless asked
(`Balancer(..., compression=ratio)`). Pure tensor functions; the collective part is
`poise.runtime.moves.compressed_trans`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from poise.core.errors import ConfigError


@dataclass(frozen=True)
class Compression:
    """The compressed-migration setting: `ratio` in (0, 1], the fraction of each row's residual
    entries sent (1 keeps everything: exact)."""

    ratio: float

    def __post_init__(self) -> None:
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 < float(r) <= 1.0:
            raise ConfigError(f"must be a number in (0, 1], got {r!r}", field="compression.ratio")

    @classmethod
    def parse(cls, value: Compression | float | None) -> Compression | None:
        """`None` (off), a ratio, or a `Compression`."""
        return value if value is None or isinstance(value, Compression) else cls(value)


def kept(numel: int, ratio: float) -> int:
    """`k = clamp(ceil(ratio * n), 1, n)`: entries of an `n`-entry row that a ratio keeps."""
    return max(1, min(int(numel), math.ceil(ratio * numel - 1e-9)))


def index_dtype(value_dtype: torch.dtype) -> torch.dtype:
    """int32 indices (int64 beside 8-byte values, so every row packs to whole values)."""
    return torch.int64 if value_dtype.itemsize == 8 else torch.int32


def row_wire_bytes(numel: int, ratio: float, dtype: torch.dtype) -> int:
    """Bytes one row of `numel` entries takes on the wire: `min(k (b_v + b_i), n b_v)`."""
    sparse = kept(numel, ratio) * (dtype.itemsize + index_dtype(dtype).itemsize)
    return min(sparse, int(numel) * dtype.itemsize)


def is_dense(numel: int, ratio: float, dtype: torch.dtype) -> bool:
    """Whether a row is cheaper sent whole: `k (b_v + b_i) >= n b_v`."""
    return row_wire_bytes(numel, ratio, dtype) == numel * dtype.itemsize


@dataclass
class Encoded:
    """Rows of one tensor in value-index form: `values [n, k]` (the residual's kept entries;
    dense rows: `[n, numel]`, the rows), `indices [n, k]` sorted flat positions (None when
    dense), `shape` one row's."""

    values: torch.Tensor
    indices: torch.Tensor | None
    shape: tuple[int, ...]


def shared_expert(rows: torch.Tensor) -> torch.Tensor:
    """`rows [E, *shape]` (every expert of a layer, one tensor) -> their mean `[*shape]`."""
    return rows.mean(dim=0)


def encode(rows: torch.Tensor, shared: torch.Tensor, ratio: float) -> Encoded:
    """`rows [n, *shape]`, `shared [*shape]` (or `[n, *shape]`) -> the rows' top-k residuals:
    `kept(numel, ratio)` entries per row by |rows - shared|, sorted by position (dense rows:
    the rows themselves)."""
    shape = tuple(rows.shape[1:])
    numel = math.prod(shape)
    if is_dense(numel, ratio, rows.dtype):
        return Encoded(rows.detach().reshape(rows.shape[0], numel).clone(), None, shape)
    residual = (rows.detach() - shared).reshape(rows.shape[0], numel)
    idx = residual.abs().topk(kept(numel, ratio), dim=1, sorted=False).indices.sort(dim=1).values
    return Encoded(residual.gather(1, idx), idx.to(index_dtype(rows.dtype)), shape)


def decode(enc: Encoded, shared: torch.Tensor) -> torch.Tensor:
    """`shared + residual` rows `[n, *shape]` (dense rows: the rows as sent)."""
    n = enc.values.shape[0]
    if enc.indices is None:
        return enc.values.reshape(n, *enc.shape)
    numel = math.prod(enc.shape)
    residual = torch.zeros(n, numel, dtype=enc.values.dtype, device=enc.values.device)
    residual.scatter_(1, enc.indices.long(), enc.values)
    return residual.reshape(n, *enc.shape) + shared


def packed_bytes(shape: tuple[int, ...], ratio: float, dtype: torch.dtype) -> int:
    """Bytes of one packed row (`pack`): `row_wire_bytes` of its `prod(shape)` entries."""
    return row_wire_bytes(math.prod(shape), ratio, dtype)


def pack(enc: Encoded) -> torch.Tensor:
    """`Encoded` -> `uint8 [n, packed_bytes]`: each row's values, then its indices, as bytes."""
    n = enc.values.shape[0]
    parts = [t for t in (enc.values, enc.indices) if t is not None]
    return torch.cat([t.contiguous().view(torch.uint8).reshape(n, -1) for t in parts], dim=1)


def unpack(buf: torch.Tensor, shape: tuple[int, ...], ratio: float, dtype: torch.dtype) -> Encoded:
    """`uint8 [n, packed_bytes]` (rows `pack` wrote for `shape`, `ratio`, `dtype`) -> `Encoded`."""
    numel = math.prod(shape)
    n = buf.shape[0]
    if is_dense(numel, ratio, dtype):
        return Encoded(buf.contiguous().view(dtype).reshape(n, numel), None, tuple(shape))
    split = kept(numel, ratio) * dtype.itemsize
    values = buf[:, :split].contiguous().view(dtype)
    indices = buf[:, split:].contiguous().view(index_dtype(dtype))
    return Encoded(values, indices, tuple(shape))


def roundtrip(rows: torch.Tensor, shared: torch.Tensor, ratio: float) -> torch.Tensor:
    """What a replica computes with: `decode(encode(rows, shared, ratio), shared)`."""
    return decode(encode(rows, shared, ratio), shared)


def relative_error(original: torch.Tensor, approx: torch.Tensor) -> float:
    """`||original - approx||_F / ||original||_F` in float64 (0 for an all-zero original)."""
    a = original.detach().double()
    norm = float(a.norm())
    return float((a - approx.detach().double()).norm()) / norm if norm > 0 else 0.0
