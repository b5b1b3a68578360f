"""Importers: routing data recorded by other systems, turned into `Trace` objects.

Every importer returns a `Trace` with counts `[S, L, D, E]` and raises `TraceError` naming the
file (`source`) and the offending field or line (`field`) for any input it cannot trust.

- `import_smartmoe(folder)`: SmartMoE-AE `moe_trace` logs, `table_iter{N}_rank{R}.log`.
- `import_eplb(path)`: an EPLB-style `weight[L, E]` load matrix (`.npy` or `.json`), one step.
- `import_expert_counts(path)`: per-layer expert counts JSON, `data[model][kind][domain]`.
- `import_megatron(folder)`: Megatron-Core router traces, `router_trace_rank{R}.jsonl`
  (`poise.trace.megatron`).
- `load_any(path, format="auto", **opts)`: dispatch on the path and its content.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from poise.core.budget import check_fits
from poise.core.errors import ConfigError, TraceError
from poise.trace.array_headers import check_npy_size
from poise.trace.megatron import FILE_RE as MEGATRON_FILE
from poise.trace.megatron import import_megatron
from poise.trace.trace import LOAD_ERRORS, Trace, load_failure

FORMATS = ("auto", "npz", "smartmoe", "eplb", "expert-counts", "megatron")

# --------------------------------------------------------------------------- shared helpers


def _is_int(v: Any) -> bool:
    """An integer >= 1 (bools refused)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1


def _finish(
    counts: np.ndarray,
    step_ids: np.ndarray,
    top_k: int,
    tokens_per_device: int | None,
    name: str,
    meta: dict[str, Any],
    source: str,
) -> Trace:
    """Build and validate a `Trace`; `tokens_per_device=None` infers the smallest value that
    holds every row: `ceil(max row sum / top_k)` (at least 1)."""
    if not _is_int(top_k):
        raise TraceError(f"must be an integer >= 1, got {top_k!r}", source=source, field="top_k")
    if top_k > counts.shape[-1]:
        raise TraceError(
            f"must be <= experts = {counts.shape[-1]}, got {top_k}", source=source, field="top_k"
        )
    if tokens_per_device is None:
        row_max = int(counts.sum(axis=-1).max()) if counts.size else 0
        tokens_per_device = max(1, -(-row_max // int(top_k)))
    elif not _is_int(tokens_per_device):
        raise TraceError(
            f"must be an integer >= 1, got {tokens_per_device!r}",
            source=source,
            field="tokens_per_device",
        )
    try:
        return Trace(
            counts.astype(np.int64),
            np.asarray(step_ids, dtype=np.int64),
            int(top_k),
            int(tokens_per_device),
            name,
            meta,
        )
    except TraceError as exc:
        raise TraceError(exc.message, source=source, field=exc.field) from None


def _to_counts(values: Any, source: str, field: str, ndim: int) -> np.ndarray:
    """Nested lists / an array of non-negative integral numbers -> int64 array of `ndim` dims.
    Integral floats (`177.0`) are accepted; fractions, NaN, strings and ragged rows are not."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        _check_nesting(values, source, field, ndim)
        try:
            arr = np.array(values)  # numbers only: a float or int array; else object or str
        except (ValueError, OverflowError):
            arr = np.array(values, dtype=object)
    if arr.ndim != ndim:
        raise TraceError(
            f"must be a {ndim}-d array, got shape {arr.shape}", source=source, field=field
        )
    if min(arr.shape, default=0) < 1:
        raise TraceError(f"must not be empty, got shape {arr.shape}", source=source, field=field)
    if arr.dtype.kind not in "iuf":
        flat = arr.ravel()
        for i, v in enumerate(flat):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                where = np.unravel_index(i, arr.shape)
                raise TraceError(
                    f"non-numeric value {v!r} at index {list(map(int, where))}",
                    source=source,
                    field=field,
                )
        arr = arr.astype(np.float64)
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            where = [int(i) for i in np.argwhere(bad)[0]]
            raise TraceError(
                f"value {arr[tuple(where)]!r} at index {where} is not a whole number",
                source=source,
                field=field,
            )
        if np.abs(arr).max() >= 2**62:
            raise TraceError("values too large", source=source, field=field)
    if (arr < 0).any():
        where = [int(i) for i in np.argwhere(arr < 0)[0]]
        raise TraceError(
            f"negative value {arr[tuple(where)]!r} at index {where}", source=source, field=field
        )
    return arr.astype(np.int64)


def _check_nesting(values: Any, source: str, field: str, ndim: int) -> None:
    """Lists nested exactly `ndim` deep with equal lengths at every level."""
    level: list[Any] = [values]
    for depth in range(ndim):
        lengths = set()
        nxt: list[Any] = []
        for v in level:
            if not isinstance(v, (list, tuple)):
                raise TraceError(
                    f"expected a list at depth {depth} (a {ndim}-d array), got {type(v).__name__}",
                    source=source,
                    field=field,
                )
            lengths.add(len(v))
            nxt.extend(v)
        if len(lengths) > 1:
            raise TraceError(
                f"ragged: rows at depth {depth} have lengths {sorted(lengths)}",
                source=source,
                field=field,
            )
        level = nxt


def _check_spread(steps: int, shape: tuple[int, ...], devices: int, source: str) -> None:
    """Refuse spreading loads `[L, E]` over more devices than memory allows (int64 counts plus
    `spread_evenly`'s work arrays), before allocating."""
    layers, experts = (int(n) for n in shape[-2:])
    check_fits(
        steps * layers * devices * experts * 8 * 4,
        f"spreading {steps} step(s) x {layers} layers x {experts} experts over {devices} devices",
        source=source,
        field="devices",
        hint="use fewer --devices",
    )


def spread_evenly(totals: np.ndarray, devices: int) -> np.ndarray:
    """Split integer loads `[L, E]` over `devices` sources: `[L, D, E]` with
    `out.sum(axis=1) == totals` exactly.

    Each device gets `totals // D`; the remainders (largest-remainder apportionment, whose
    fractional parts are all equal here) go round-robin across the experts of a layer, so the
    per-device row sums differ by at most one."""
    base, rem = np.divmod(totals.astype(np.int64), devices)
    out = np.repeat(base[:, None, :], devices, axis=1)
    start = np.cumsum(rem, axis=1) - rem  # [L, E] first device that gets a remainder unit
    d = np.arange(devices)[None, :, None]  # [1, D, 1]
    offset = (d - start[:, None, :] % devices) % devices  # [L, D, E]
    out += offset < rem[:, None, :]
    return out


# --------------------------------------------------------------------------- SmartMoE-AE

_SMARTMOE_FILE = re.compile(r"^table_iter(\d+)_rank(\d+)\.log$")
_SMARTMOE_LINE = re.compile(r"^\s*(-?\d+)\s*:\s*(.*?)\s*$")


def _parse_smartmoe_file(path: Path) -> np.ndarray:
    """One `table_iter{N}_rank{R}.log` -> counts `[L, M, E]` (layers, micro-batches, experts)."""
    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read: {exc}", source=src) from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise TraceError("empty file: expected one line per MoE layer", source=src)
    rows: list[np.ndarray] = []
    for n, line in enumerate(lines, start=1):
        field = f"line {n}"
        m = _SMARTMOE_LINE.match(line)
        if not m:
            raise TraceError("expected 'LAYER:[[counts...], ...]'", source=src, field=field)
        layer = int(m.group(1))
        if layer != n - 1:
            raise TraceError(
                f"layer number {layer} out of order (expected {n - 1})", source=src, field=field
            )
        try:
            values = json.loads(m.group(2))
        except (json.JSONDecodeError, RecursionError) as exc:
            msg = getattr(exc, "msg", "nested too deeply")
            raise TraceError(
                f"not a list of lists of numbers: {msg}", source=src, field=field
            ) from None
        block = _to_counts(values, src, field, 2)  # [M, E]
        if rows and block.shape != rows[0].shape:
            raise TraceError(
                f"{block.shape[0]} micro-batches x {block.shape[1]} experts, but "
                f"line 1 has {rows[0].shape[0]} x {rows[0].shape[1]}",
                source=src,
                field=field,
            )
        rows.append(block)
    return np.stack(rows)


def import_smartmoe(
    folder: str | Path,
    *,
    top_k: int = 2,
    tokens_per_device: int | None = None,
    name: str | None = None,
    micro_batches: str = "sum",
) -> Trace:
    """Read a SmartMoE-AE `moe_trace` folder of `table_iter{N}_rank{R}.log` files.

    Each file has one line per MoE layer, `L:[[c_0, ..., c_{E-1}], ...]`: for each micro-batch
    the assignments rank R sent to each expert at iteration N. Steps are the sorted iterations
    N (`step_ids`), devices the ranks 0..R-1 (every iteration must have every rank); the
    micro-batches of a step are summed. Counts `[S, L, D, E]`. `tokens_per_device` defaults to
    `ceil(max row sum / top_k)`. `meta`: micro-batch count and tokens per micro-batch.

    `micro_batches="steps"` makes each micro-batch a step of its own instead (M steps per
    iteration, `step_ids` = N * M + m, `meta["iterations"]` the iterations): real routing of
    consecutive batches, where the summed form has one step per snapshot."""
    folder = Path(folder)
    src = str(folder)
    if micro_batches not in ("sum", "steps"):
        raise TraceError(
            f"must be 'sum' or 'steps', got {micro_batches!r}", source=src, field="micro_batches"
        )
    if not folder.is_dir():
        raise TraceError("not a folder (expected a SmartMoE-AE moe_trace folder)", source=src)
    found: dict[int, dict[int, Path]] = {}
    for p in folder.iterdir():
        m = _SMARTMOE_FILE.match(p.name)
        if m and p.is_file():
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    if not found:
        raise TraceError("no table_iter{N}_rank{R}.log files", source=src)
    ranks = sorted(set().union(*(r.keys() for r in found.values())))
    D = ranks[-1] + 1
    iters = sorted(found)
    for it in iters:
        missing = [r for r in range(D) if r not in found[it]]
        if missing:
            names = ", ".join(f"table_iter{it}_rank{r}.log" for r in missing[:4])
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise TraceError(
                f"missing rank file(s) {names}{more} (ranks 0..{D - 1} expected)",
                source=src,
                field=f"iteration {it}",
            )
    first: tuple[int, ...] | None = None
    first_file = ""
    steps: list[np.ndarray] = []
    for it in iters:
        per_rank = []
        for r in range(D):
            path = found[it][r]
            block = _parse_smartmoe_file(path)  # [L, M, E]
            if first is None:
                first, first_file = block.shape, path.name
            elif block.shape != first:
                raise TraceError(
                    f"{block.shape[0]} layers x {block.shape[1]} micro-batches x "
                    f"{block.shape[2]} experts, but {first_file} has "
                    f"{first[0]} x {first[1]} x {first[2]}",
                    source=str(path),
                )
            per_rank.append(block)
        steps.append(np.stack(per_rank, axis=1))  # [L, D, M, E]
    raw = np.stack(steps)  # [S, L, D, M, E]
    assert first is not None
    micro = int(first[1])
    mb_max = int(raw.sum(axis=-1).max())
    meta = {
        "format": "smartmoe-ae",
        "source": src,
        "micro_batches": micro,
        "tokens_per_micro_batch": max(1, -(-mb_max // top_k)) if _is_int(top_k) else None,
        "ranks": D,
    }
    if micro_batches == "steps":
        S, L, _, M, E = raw.shape
        counts = raw.transpose(0, 3, 1, 2, 4).reshape(S * M, L, D, E)
        ids = np.array([it * M + m for it in iters for m in range(M)])
        meta["iterations"] = iters
        return _finish(counts, ids, top_k, tokens_per_device, name or folder.name, meta, src)
    return _finish(
        raw.sum(axis=3), np.array(iters), top_k, tokens_per_device, name or folder.name, meta, src
    )


# --------------------------------------------------------------------------- EPLB weight


def _read_json(path: Path) -> Any:
    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError("file not found", source=src) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read: {exc}", source=src) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(
            f"not valid JSON: {exc.msg}", source=src, field=f"line {exc.lineno}"
        ) from None
    except RecursionError:
        raise TraceError("not valid JSON: nested too deeply", source=src) from None


def _read_npy(path: Path) -> np.ndarray:
    src = str(path)
    check_npy_size(path)  # header only: a lying shape is refused before np.load allocates
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise TraceError("file not found", source=src) from None
    except LOAD_ERRORS as exc:
        raise TraceError(f"not a readable .npy array: {load_failure(exc)}", source=src) from None
    if not isinstance(arr, np.ndarray):
        raise TraceError("expected a single .npy array (not an .npz archive)", source=src)
    if arr.dtype.kind not in "iuf":
        raise TraceError(f"must hold numbers, got dtype {arr.dtype}", source=src, field="weight")
    return arr


def _eplb_weight(path: Path) -> np.ndarray:
    """The `weight [L, E]` integer matrix from `.npy` or `.json`."""
    src = str(path)
    if path.suffix == ".npy":
        return _to_counts(_read_npy(path), src, "weight", 2)
    data = _read_json(path)
    if isinstance(data, dict):
        if "weight" not in data:
            raise TraceError(
                "expected a list of lists or an object with a 'weight' entry",
                source=src,
                field="weight",
            )
        data = data["weight"]
    if not isinstance(data, list):
        raise TraceError(
            f"must be a list of per-layer lists, got {type(data).__name__}",
            source=src,
            field="weight",
        )
    return _to_counts(data, src, "weight", 2)


def import_eplb(
    path: str | Path,
    *,
    devices: int = 1,
    top_k: int = 1,
    tokens_per_device: int | None = None,
    name: str | None = None,
) -> Trace:
    """An EPLB-style load matrix `weight[L, E]` (`.npy`, or `.json` holding a list of lists or
    `{"weight": [[...]]}`) as a one-step trace `[1, L, D, E]`.

    There are no per-source counts, so each expert's load is spread evenly over `devices`
    sources with exact integer conservation (`spread_evenly`). `top_k` is not recorded in the
    matrix (default 1); `tokens_per_device` defaults to `ceil(max row sum / top_k)`."""
    path = Path(path)
    src = str(path)
    if not _is_int(devices):
        raise TraceError(f"must be an integer >= 1, got {devices!r}", source=src, field="devices")
    if not path.exists():
        raise TraceError("file not found", source=src)
    weight = _eplb_weight(path)
    _check_spread(1, weight.shape, int(devices), src)
    counts = spread_evenly(weight, int(devices))[None]
    meta = {"format": "eplb", "source": src, "spread_over_devices": int(devices)}
    return _finish(counts, np.array([0]), top_k, tokens_per_device, name or path.stem, meta, src)


# --------------------------------------------------------------------------- expert counts JSON

TOP_K_BY_MODEL = {"olmoe": 8, "mistral": 2, "mixtral": 2}


def default_top_k(model: str, kind: str) -> int | None:
    """top-k implied by a model name (`olmoe*` 8, `mistral`/`mixtral*` 2); 1 for a `*top1` kind."""
    if kind.endswith("top1"):
        return 1
    low = model.lower()
    for prefix, k in TOP_K_BY_MODEL.items():
        if low.startswith(prefix):
            return k
    return None


def import_expert_counts(
    path: str | Path,
    *,
    model: str = "olmoe",
    kind: str = "expert_counts",
    domain: str | Sequence[str] | None = None,
    top_k: int | None = None,
    devices: int = 1,
    tokens_per_device: int | None = None,
    name: str | None = None,
) -> Trace:
    """Per-layer expert counts JSON: `{"data": {model: {kind: {domain: [[c_e...] per layer]}}}}`
    (the file format of OLMoE's routing analysis; a top level without `"data"` is read as the
    `data` mapping itself).

    Choice of steps: each selected domain becomes one step, in the file's order
    (`domain=None`: every domain of `model`/`kind`; a name or a list of names picks some), and
    `meta["domains"]` names the steps. Each step's per-expert counts are spread evenly over
    `devices` sources (`spread_evenly`). Counts `[S, L, D, E]`. `top_k` defaults by model name
    (OLMoE 8, Mistral/Mixtral 2; 1 for `*_top1` kinds); `tokens_per_device` to
    `ceil(max row sum / top_k)`."""
    path = Path(path)
    src = str(path)
    if not _is_int(devices):
        raise TraceError(f"must be an integer >= 1, got {devices!r}", source=src, field="devices")
    doc = _read_json(path)
    if not isinstance(doc, dict):
        raise TraceError(f"top level must be an object, got {type(doc).__name__}", source=src)
    data = doc.get("data", {k: v for k, v in doc.items() if not k.startswith("_")})
    if not isinstance(data, dict):
        raise TraceError(
            f"must be an object keyed by model, got {type(data).__name__}", source=src, field="data"
        )
    kinds = _pick(data, model, src, "data", "model")
    domains_map = _pick(kinds, kind, src, f"data.{model}", "kind")
    if not domains_map:
        raise TraceError("no domains", source=src, field=f"data.{model}.{kind}")
    if domain is None:
        chosen = list(domains_map)
    elif isinstance(domain, str):
        chosen = [d.strip() for d in domain.split(",") if d.strip()]
    else:
        chosen = list(domain)
    if not chosen:
        raise TraceError("no domain selected", source=src, field="domain")
    steps = []
    for dom in chosen:
        values = _pick(domains_map, dom, src, f"data.{model}.{kind}", "domain", want=list)
        steps.append(_to_counts(values, src, f"data.{model}.{kind}.{dom}", 2))  # [L, E]
    for dom, arr in zip(chosen[1:], steps[1:], strict=True):
        if arr.shape != steps[0].shape:
            raise TraceError(
                f"shape {list(arr.shape)} differs from {chosen[0]!r} {list(steps[0].shape)}",
                source=src,
                field=f"data.{model}.{kind}.{dom}",
            )
    k = top_k if top_k is not None else default_top_k(model, kind)
    if k is None:
        raise TraceError(
            f"cannot infer top_k for model {model!r}; pass top_k", source=src, field="top_k"
        )
    _check_spread(len(steps), steps[0].shape, int(devices), src)
    counts = np.stack([spread_evenly(a, int(devices)) for a in steps])
    meta: dict[str, Any] = {
        "format": "expert-counts",
        "source": src,
        "model": model,
        "kind": kind,
        "domains": chosen,
        "spread_over_devices": int(devices),
    }
    if isinstance(doc.get("_doc"), str):
        meta["doc"] = doc["_doc"]
    return _finish(
        counts, np.arange(len(chosen)), k, tokens_per_device, name or f"{model}-{kind}", meta, src
    )


def _pick(
    mapping: dict[str, Any], key: str, src: str, where: str, what: str, want: type = dict
) -> Any:
    if key not in mapping:
        names = ", ".join(str(k) for k in mapping) or "none"
        raise TraceError(f"no {what} {key!r} (available: {names})", source=src, field=where)
    value = mapping[key]
    if not isinstance(value, want):
        raise TraceError(
            f"must be a{'n object' if want is dict else ' list'}, got {type(value).__name__}",
            source=src,
            field=f"{where}.{key}",
        )
    return value


# --------------------------------------------------------------------------- dispatch

IMPORTERS: dict[str, Callable[..., Trace]] = {
    "smartmoe": import_smartmoe,
    "eplb": import_eplb,
    "expert-counts": import_expert_counts,
    "megatron": import_megatron,
}


def detect_format(path: str | Path) -> str:
    """`npz`, `smartmoe`, `eplb`, `expert-counts` or `megatron`, from the path and (for JSON)
    its content."""
    path = Path(path)
    src = str(path)
    if MEGATRON_FILE.match(path.name):
        return "megatron"
    if path.is_dir():
        if any(MEGATRON_FILE.match(p.name) for p in path.glob("router_trace_rank*.jsonl")):
            return "megatron"
        return "smartmoe"
    if not path.exists():
        raise TraceError("file not found", source=src)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return "npz"
    if suffix == ".npy":
        return "eplb"
    if suffix == ".json":
        data = _read_json(path)
        if isinstance(data, list) or (isinstance(data, dict) and "weight" in data):
            return "eplb"
        if isinstance(data, dict):
            return "expert-counts"
        raise TraceError(
            f"JSON top level must be a list or an object, got {type(data).__name__}", source=src
        )
    raise TraceError(
        f"unknown trace format {suffix or '(no suffix)'!r} (expected .npz, "
        f".npy, .json, a SmartMoE-AE folder or Megatron-Core router_trace_rank<N>.jsonl)",
        source=src,
    )


def load_any(path: str | Path, format: str = "auto", **opts: Any) -> Trace:
    """Load a trace from any supported source: `.npz` (`Trace.load`), a folder (SmartMoE-AE),
    `.npy` (EPLB weight) or `.json` (EPLB weight if a list or has `weight`, else expert counts).

    `opts` are passed to the importer; `None` values are dropped, and an option the chosen
    importer does not take raises `ConfigError`."""
    if format not in FORMATS:
        raise ConfigError(f"must be one of {', '.join(FORMATS)}; got {format!r}", field="format")
    fmt = detect_format(path) if format == "auto" else format
    given = {k: v for k, v in opts.items() if v is not None}
    if fmt == "npz":
        if given:
            raise ConfigError(
                "does not apply to a .npz trace", source=str(path), field=", ".join(sorted(given))
            )
        return Trace.load(path)
    fn = IMPORTERS[fmt]
    accepted = set(inspect.signature(fn).parameters) - {"path", "folder"}
    extra = sorted(set(given) - accepted)
    if extra:
        raise ConfigError(
            f"option(s) not used by the {fmt} importer (it takes {', '.join(sorted(accepted))})",
            source=str(path),
            field=", ".join(extra),
        )
    if fmt not in ("smartmoe", "megatron") and Path(path).is_dir():
        raise TraceError(f"is a folder, not a {fmt} file", source=str(path))
    return fn(path, **given)
