"""Megatron-Core router traces, read and written.

The format is that of Megatron-Core's router tracer (`megatron-core` 0.19.2,
`megatron/core/transformer/moe/router_trace.py`; enabled in training with
`--moe-routing-trace-path DIR`): a folder with one JSON-lines file per rank,
`router_trace_rank{rank}.jsonl`, one record per (step, block, layer):

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 2, "top_indices": [[5, 1], [0, 7], ...]}

`step` is the training iteration (0-based), `layer` the decoder layer number the router
belongs to (from its module name, `decoder.layers.<layer>.`; only MoE layers have records),
`top_indices [num_tokens, topk]` the experts each of this rank's tokens chose, before dispatch
and drops. Records of the multi-token-prediction block (`"block": "mtp"`, with `mtp_idx`) and
optional sidecar fields (`hs_offset`, `logit_offset`, ...) are ignored here.

`import_megatron(folder, experts=None)` turns such a folder into a `Trace`: counts
`[S, L, D, E]` with steps, MoE layers and ranks in increasing order and
`counts[s, l, d, e]` the tokens of rank d that chose expert e in layer l at step s; `experts`
defaults to the largest index seen plus one. `MegatronTraceWriter` writes Poise's own routing in
the same format (`poise train --set trace_format=megatron`), one file per rank.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import IO, Any

import numpy as np

from poise.core.budget import check_fits
from poise.core.errors import TraceError
from poise.core.spec import SIZE_BOUNDS
from poise.trace.trace import Trace

FILE_RE = re.compile(r"^router_trace_rank(\d+)\.jsonl$")
SOURCE = "megatron-core 0.19.2 router_trace.py (--moe-routing-trace-path)"


def trace_file(folder: str | Path, rank: int) -> Path:
    """The file rank `rank` writes in `folder`."""
    return Path(folder) / f"router_trace_rank{rank}.jsonl"


def _int_field(rec: dict[str, Any], key: str, src: str, where: str, low: int = 0) -> int:
    v = rec.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise TraceError(f"must be an integer >= {low}, got {v!r}", source=src, field=where)
    return v


def _records(path: Path) -> list[dict[str, Any]]:
    """The decoder records of one rank's file (`TraceError` naming the line for bad ones)."""
    src = str(path)
    out = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"line {n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"not JSON ({exc.msg})", source=src, field=where) from None
            if not isinstance(rec, dict):
                raise TraceError("must be a JSON object", source=src, field=where)
            if rec.get("block", "decoder") != "decoder":
                continue
            for key in ("step", "layer", "rank"):
                _int_field(rec, key, src, f"{where}.{key}")
            topk = _int_field(rec, "topk", src, f"{where}.topk", low=1)
            idx = rec.get("top_indices")
            try:
                arr = np.asarray(idx, dtype=np.int64)
            except (TypeError, ValueError):
                raise TraceError(
                    "must be a list of lists of integers", source=src, field=f"{where}.top_indices"
                ) from None
            if arr.size == 0:
                arr = arr.reshape(0, topk)
            if arr.ndim != 2 or arr.shape[1] != topk:
                raise TraceError(
                    f"must be [num_tokens, topk={topk}], got shape {list(arr.shape)}",
                    source=src,
                    field=f"{where}.top_indices",
                )
            if arr.size and arr.min() < 0:
                raise TraceError(
                    "expert indices must be >= 0", source=src, field=f"{where}.top_indices"
                )
            if arr.size and arr.max() >= SIZE_BOUNDS["experts"]:
                raise TraceError(
                    f"expert index {int(arr.max())} is beyond any model (at most "
                    f"{SIZE_BOUNDS['experts']} experts; a corrupt value?)",
                    source=src,
                    field=f"{where}.top_indices",
                )
            if "num_tokens" in rec and rec["num_tokens"] != arr.shape[0]:
                raise TraceError(
                    f"is {rec['num_tokens']!r}, but top_indices has {arr.shape[0]} rows",
                    source=src,
                    field=f"{where}.num_tokens",
                )
            out.append({"step": rec["step"], "layer": rec["layer"], "rank": rec["rank"],
                        "topk": topk, "idx": arr, "where": where, "src": src})  # fmt: skip
    return out


def import_megatron(
    folder: str | Path,
    experts: int | None = None,
    top_k: int | None = None,
    tokens_per_device: int | None = None,
    name: str | None = None,
) -> Trace:
    """A `Trace` `[S, L, D, E]` from a Megatron-Core router-trace folder (or one of its files).
    `experts`: E (default: the largest expert index seen + 1); `top_k`: checked against the
    records' `topk` (default: theirs); `tokens_per_device`: default the most tokens one rank
    routed in one layer and step."""
    path = Path(folder)
    files = [path] if path.is_file() else sorted(
        (p for p in path.glob("router_trace_rank*.jsonl") if FILE_RE.match(p.name)),
        key=lambda p: int(FILE_RE.match(p.name).group(1)),  # type: ignore[union-attr]
    )  # fmt: skip
    if not files:
        raise TraceError("no router_trace_rank<N>.jsonl files", source=str(path))
    per_file = [_records(f) for f in files]
    for f, got in zip(files, per_file, strict=True):
        if not got and len(files) > 1:  # one rank's devices would silently be left out
            raise TraceError(
                "no decoder records: every rank's file must hold its routing", source=str(f)
            )
    recs = [r for got in per_file for r in got]
    if not recs:
        raise TraceError("no decoder records", source=str(path))
    ks = {r["topk"] for r in recs}
    if len(ks) != 1:
        raise TraceError(f"records disagree on topk: {sorted(ks)}", source=str(path), field="topk")
    k = ks.pop()
    if top_k is not None and top_k != k:
        raise TraceError(f"is {top_k}, the records say {k}", source=str(path), field="top_k")
    seen = 1 + max((int(r["idx"].max()) for r in recs if r["idx"].size), default=0)
    E = seen if experts is None else int(experts)
    if E < seen:  # noqa: SIM300
        raise TraceError(
            f"is {E}, but expert index {seen - 1} occurs", source=str(path), field="experts"
        )
    steps = sorted({r["step"] for r in recs})
    layers = sorted({r["layer"] for r in recs})
    ranks = sorted({r["rank"] for r in recs})
    si = {s: i for i, s in enumerate(steps)}
    li = {v: i for i, v in enumerate(layers)}
    ri = {v: i for i, v in enumerate(ranks)}
    check_fits(
        8.0 * len(steps) * len(layers) * len(ranks) * E,
        f"a trace of {len(steps)} steps x {len(layers)} layers x {len(ranks)} ranks x {E} experts",
        source=str(path),
        field="experts",
    )
    counts = np.zeros((len(steps), len(layers), len(ranks), E), dtype=np.int64)
    filled = np.zeros(counts.shape[:3], dtype=bool)
    for r in recs:
        at = (si[r["step"]], li[r["layer"]], ri[r["rank"]])
        if filled[at]:
            raise TraceError(
                f"a second record for step {r['step']}, layer {r['layer']}, rank {r['rank']}",
                source=r["src"],
                field=r["where"],
            )
        filled[at] = True
        counts[at] = np.bincount(r["idx"].ravel(), minlength=E)
    if tokens_per_device is None:
        tokens_per_device = max(1, max(int(r["idx"].shape[0]) for r in recs))
    try:
        trace = Trace(
            counts=counts,
            step_ids=np.asarray(steps, dtype=np.int64),
            top_k=k,
            tokens_per_device=int(tokens_per_device),
            name=name or f"megatron-{path.stem}",
            meta={"source": SOURCE, "layers": layers, "ranks": ranks, "path": str(path)},
        )
    except TraceError as exc:
        raise TraceError(str(exc), source=str(path)) from None
    return trace


class MegatronTraceWriter:
    """Appends one rank's routing to `router_trace_rank{rank}.jsonl` in `folder`, as
    Megatron-Core's tracer writes it: `record(step, layer, top_indices [T, k])` per MoE layer,
    `flush()` at the end of a step. `start`: on resume, lines of steps >= `start` are dropped
    first (the file is rewritten atomically)."""

    def __init__(self, folder: str | Path, rank: int, start: int = 0) -> None:
        from poise.util.atomic import atomic_write_text

        self.rank = rank
        self.path = trace_file(folder, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if start > 0 and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) < start:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue
        atomic_write_text(self.path, "".join(x + "\n" for x in kept))
        self.fh: IO[str] | None = self.path.open("a", encoding="utf-8")

    def record(self, step: int, layer: int, top_indices: np.ndarray) -> None:
        """One layer's routing of this rank's tokens at `step` (0-based): `top_indices [T, k]`."""
        assert self.fh is not None
        idx = np.asarray(top_indices, dtype=np.int64)
        rec = {"step": int(step), "stage": "pre_dispatch", "block": "decoder",
               "layer": int(layer), "rank": self.rank, "num_tokens": int(idx.shape[0]),
               "topk": int(idx.shape[1]), "top_indices": idx.tolist()}  # fmt: skip
        self.fh.write(json.dumps(rec) + "\n")

    def flush(self) -> None:
        if self.fh is not None:
            self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


__all__ = ["SOURCE", "MegatronTraceWriter", "import_megatron", "trace_file"]
