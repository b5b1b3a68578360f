"""One digest for everything the ranks of a run must agree on (configurations, plans, routing).

    digest(placement.home, placement.copies, assignment.weights)  # -> int in [0, 2**62)

Arrays (numpy arrays or torch tensors) contribute their dtype, shape and bytes; any other value
(a number, a string, a tuple of options, None) contributes its `repr`. The result fits a signed
int64 together with its negation, so ranks can compare digests with one MAX all-reduce of
`[h, -h]` or gather them as int64.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def digest(*parts: Any) -> int:
    """A 62-bit digest of `parts` (arrays and tensors by dtype, shape and bytes; other values
    by `repr`). Floating tensors are hashed as float32 (bfloat16 has no numpy dtype)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if hasattr(part, "detach"):  # a torch tensor, without importing torch here
            t = part.detach()
            if t.is_floating_point():
                t = t.float()
            part = t.cpu().contiguous().numpy()
        if isinstance(part, np.ndarray):
            a = np.ascontiguousarray(part)
            h.update(f"array{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        else:
            h.update(f"value{part!r}".encode())
    return int.from_bytes(h.digest(), "little") >> 2


__all__ = ["digest"]
