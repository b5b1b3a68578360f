"""Routing traces: how many token-to-expert assignments each source device sent to each expert.

`Trace.counts` is an integer array `[S, L, D, E]` (steps, MoE layers, source devices, experts).
Traces are stored as `.npz` with a schema version; generators live in `poise.trace.generate`,
importers in `poise.trace.importers`, statistics in `poise.trace.stats`.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from poise.core.errors import TraceError
from poise.trace.array_headers import LOAD_ERRORS, check_npz_sizes
from poise.util.atomic import atomic_write_bytes

SCHEMA_VERSION = 1


# Bounds on token counts. The largest public MoE runs route about 6e7 tokens a step
# (DeepSeek-V3: 15,360 sequences of 4,096 tokens), so 2^40 per cell leaves 10^4x headroom; the
# cost model prices loads in float64, exact for integers up to 2^53, so no total may pass it
# (counts near 2^61 overflowed the statistics into "-").
MAX_CELL_TOKENS = 2**40
MAX_TOTAL_TOKENS = float(2**53)


@dataclass
class Trace:
    """`counts[s, l, d, e]`: assignments from source device d to expert e in layer l at step s.
    `step_ids[s]`: the training iteration of row s. `top_k`: experts per token, so each source's
    row sums to at most `top_k * tokens_per_device` (less if tokens were dropped)."""

    counts: np.ndarray
    step_ids: np.ndarray
    top_k: int
    tokens_per_device: int
    name: str = "trace"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def steps(self) -> int:
        return int(self.counts.shape[0])

    @property
    def layers(self) -> int:
        return int(self.counts.shape[1])

    @property
    def devices(self) -> int:
        return int(self.counts.shape[2])

    @property
    def experts(self) -> int:
        return int(self.counts.shape[3])

    def validate(self, source: str | None = None) -> None:
        src = source or self.name
        c = self.counts
        if not isinstance(c, np.ndarray) or c.ndim != 4:
            raise TraceError(
                f"must be a 4-d array [steps, layers, devices, experts], got shape "
                f"{getattr(c, 'shape', None)}",
                source=src,
                field="counts",
            )
        if min(c.shape) < 1:
            raise TraceError(
                f"every dimension must be >= 1, got shape {c.shape}", source=src, field="counts"
            )
        if not np.issubdtype(c.dtype, np.integer):
            raise TraceError(f"must hold integers, got {c.dtype}", source=src, field="counts")
        if c.size and int(c.min()) < 0:
            raise TraceError("counts must be non-negative", source=src, field="counts")
        total = float(c.sum(dtype=np.float64))
        if c.size and (int(c.max()) > MAX_CELL_TOKENS or total > MAX_TOTAL_TOKENS):
            raise TraceError(
                f"a count of {int(c.max())} (total {total:.3g}) is beyond any routing trace: at "
                f"most {MAX_CELL_TOKENS} tokens per cell and 2^53 in all (a corrupt value?)",
                source=src,
                field="counts",
            )
        if self.counts.dtype != np.int64:
            self.counts = c.astype(np.int64)
        ids = np.asarray(self.step_ids)
        if ids.shape != (c.shape[0],) or not np.issubdtype(ids.dtype, np.integer):
            raise TraceError(
                f"must be {c.shape[0]} integers, one per step", source=src, field="step_ids"
            )
        if ids.size > 1 and np.any(np.diff(ids) <= 0):
            raise TraceError("must be strictly increasing", source=src, field="step_ids")
        self.step_ids = ids.astype(np.int64)
        if not (1 <= self.top_k <= c.shape[3]):
            raise TraceError(
                f"must be in [1, experts={c.shape[3]}], got {self.top_k}", source=src, field="top_k"
            )
        if self.tokens_per_device < 1:
            raise TraceError(
                f"must be >= 1, got {self.tokens_per_device}", source=src, field="tokens_per_device"
            )
        row_max = int(c.sum(axis=3).max())
        if row_max > self.top_k * self.tokens_per_device:
            raise TraceError(
                f"a source sends {row_max} assignments in one step and layer, more than "
                f"top_k * tokens_per_device = {self.top_k * self.tokens_per_device}",
                source=src,
                field="counts",
            )

    # ------------------------------------------------------------------ views
    def expert_load(self) -> np.ndarray:
        """`[S, L, E]` total assignments per expert."""
        return self.counts.sum(axis=2)

    def slice_steps(self, start: int, stop: int | None = None) -> Trace:
        return Trace(
            self.counts[start:stop],
            self.step_ids[start:stop],
            self.top_k,
            self.tokens_per_device,
            self.name,
            dict(self.meta),
        )

    # ------------------------------------------------------------------ storage
    def save(self, path: str | Path) -> None:
        buf = io.BytesIO()
        np.savez_compressed(
            buf,
            schema_version=np.array(SCHEMA_VERSION),
            counts=self.counts,
            step_ids=self.step_ids,
            top_k=np.array(self.top_k),
            tokens_per_device=np.array(self.tokens_per_device),
            name=np.array(self.name),
            meta=np.array(json.dumps(self.meta, sort_keys=True)),
        )
        atomic_write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        src = str(path)
        data: dict[str, np.ndarray] = {}
        key: str | None = None
        check_npz_sizes(path)  # headers only: a lying shape is refused before np.load allocates
        try:
            with np.load(path, allow_pickle=False) as z:
                for key in z.files:  # each array read (and decompressed, CRC checked) here
                    data[key] = z[key]
        except FileNotFoundError:
            raise TraceError("file not found", source=src) from None
        except LOAD_ERRORS as exc:
            raise TraceError(
                f"not a Poise trace (.npz): {load_failure(exc)}", source=src, field=key
            ) from None
        for key in ("schema_version", "counts", "step_ids", "top_k", "tokens_per_device"):
            if key not in data:
                raise TraceError("missing array", source=src, field=key)
        version = _scalar_int(data["schema_version"], src, "schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(
                f"unsupported schema version {version} (this Poise reads {SCHEMA_VERSION})",
                source=src,
                field="schema_version",
            )
        meta: dict[str, Any] = {}
        if "meta" in data:
            try:
                meta = json.loads(str(data["meta"]))
            except (json.JSONDecodeError, TypeError):
                raise TraceError("not valid JSON", source=src, field="meta") from None
            if not isinstance(meta, dict):
                raise TraceError("must be a JSON object", source=src, field="meta")
        trace = cls.__new__(cls)
        trace.counts = data["counts"]
        trace.step_ids = data["step_ids"]
        trace.top_k = _scalar_int(data["top_k"], src, "top_k")
        trace.tokens_per_device = _scalar_int(data["tokens_per_device"], src, "tokens_per_device")
        trace.name = str(data["name"]) if "name" in data else path.stem
        trace.meta = meta
        trace.validate(source=src)
        return trace


def load_failure(exc: BaseException) -> str:
    """Why NumPy could not read a file, in words that never advise loading it with pickle: an
    array of Python objects is refused outright (unpickling runs arbitrary code); damaged
    compressed data is said to be so."""
    text = str(exc)
    if "pickle" in text.lower() or "object arrays" in text.lower():
        return "it holds Python objects, not numbers (Poise never unpickles files)"
    if isinstance(exc, zlib.error):
        return f"corrupt compressed data ({text})"
    if isinstance(exc, zipfile.BadZipFile):
        return f"corrupt archive ({text})"
    return text or type(exc).__name__


def _scalar_int(value: np.ndarray, source: str, field_name: str) -> int:
    if value.shape != () or not np.issubdtype(value.dtype, np.integer):
        got = f"{value!r}" if value.size == 1 else f"an array of shape {list(value.shape)}"
        raise TraceError(
            f"must be one integer, got {got} ({value.dtype})", source=source, field=field_name
        )
    return int(value)
