"""Cheap keys of array content, for caches that look plans up by what they hold.

    key = fingerprint(a)      # equal arrays -> equal keys; unequal ones rarely share one
    same_content(a, b)        # the exact test a cache makes on a key's match

`fingerprint` is the dtype, the shape, the order of the axes in memory (which sets NumPy's
summation order) and a position-weighted sum of the content's 64-bit words, wrapping modulo
2^64, every weight nonzero (`_weighted_sum`). It reads the array once, about 2.5x faster than
hashing its bytes; as a sum it is no hash, so a match is confirmed with `same_content`, bit
for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_ODD = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio; odd, so no weight wraps to 0
_BLOCK = 2**14  # words weighted by one kept ramp; longer arrays go block by block


@functools.lru_cache(maxsize=1)
def _ramp() -> np.ndarray:
    """`[_BLOCK]` uint64: (k + 1) * _ODD, wrapping (read-only)."""
    ramp = np.arange(1, _BLOCK + 1, dtype=np.uint64) * _ODD
    ramp.setflags(write=False)
    return ramp


def _weighted_sum(words: np.ndarray) -> int:
    """sum_i words[i] * w(i) modulo 2^64 with w(b * K + k) = (k + 1) * _ODD * (2 b + 1), K =
    `_BLOCK`: one ramp-weighted pass over the whole blocks, one over the rest, then the blocks'
    sums times their odd multipliers."""
    full = words.size // _BLOCK
    ramp = _ramp()
    rest = words[full * _BLOCK :]
    total = int(np.dot(rest, ramp[: rest.size])) * (2 * full + 1)
    if full:
        per_block = np.einsum("bk,k->b", words[: full * _BLOCK].reshape(full, _BLOCK), ramp)
        odd = np.arange(1, 2 * full, 2, dtype=np.uint64)
        total += int(np.dot(per_block, odd))
    return total % 2**64


def _raw(a: np.ndarray) -> np.ndarray:
    """`a`'s content as bytes in C order, `[nbytes]` uint8 (a view where `a` is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def fingerprint(a: np.ndarray | None) -> tuple[Any, ...] | None:
    """A key of `a`'s content (module docstring); None for None."""
    if a is None:
        return None
    raw = _raw(a)
    if raw.size % 8:
        raw = np.concatenate([raw, np.zeros(8 - raw.size % 8, dtype=np.uint8)])
    total = _weighted_sum(raw.view(np.uint64))
    order = tuple(sorted(range(a.ndim), key=a.strides.__getitem__))  # axes, densest first
    return (a.dtype.str, a.shape, order, total)


def same_content(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether `a` and `b` hold the same values bit for bit (dtype and shape included; -0.0 is
    not 0.0); two Nones are the same."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_raw(a), _raw(b))


__all__ = ["fingerprint", "same_content"]
