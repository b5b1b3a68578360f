"""Every figure Poise writes or prints is finite: the one check at the output boundary.

Inputs are bounded where they are read (`poise.core.fields.get_number`'s `within`), but a
combination of valid inputs can still overflow a figure (a huge model on a slow link), and JSON
would then carry `Infinity` or `NaN`, which strict readers refuse. `json_text` is what every
JSON output goes through: it writes no non-finite number, and refuses with one `PoiseError`
naming the output and the first non-finite entry's path (`summary.runs.static.mean_step_s`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from poise.core.errors import PoiseError


class NonFiniteError(PoiseError):
    """A figure to be written or printed is infinite or not a number."""


def first_non_finite(value: Any, path: str = "") -> str | None:
    """The path (`a.b[2]`) of the first infinite or NaN number in a JSON-like `value` (mappings,
    sequences, NumPy arrays and scalars), None when every number is finite."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, (int, np.integer)):
        return None
    if isinstance(value, (float, np.floating)):
        return None if math.isfinite(float(value)) else path or "value"
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "fc" or np.isfinite(value).all():
            return None
        index = np.argwhere(~np.isfinite(value))[0]
        return f"{path}[{', '.join(str(int(i)) for i in index)}]"
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = first_non_finite(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = first_non_finite(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def require_finite(value: Any, source: str) -> None:
    """Refuse (`NonFiniteError`, naming `source` and the entry) a JSON-like `value` holding an
    infinite or NaN number: the check before anything of an output is written."""
    where = first_non_finite(value)
    if where is not None:
        raise _refusal(where, source)


def _refusal(where: str, source: str) -> NonFiniteError:
    return NonFiniteError(
        f"{where} is not finite (inf or nan): the inputs overflow the model; check the sizes, "
        "rates and bandwidths given",
        source=source,
        field="output",
    )


def json_text(
    value: Any, source: str, *, indent: int = 1, default: Callable[[Any], Any] | None = None
) -> str:
    """`json.dumps(value)` plus a newline, refusing (`NonFiniteError`, naming `source` and the
    entry) where a number is infinite or NaN instead of writing `Infinity`/`NaN`."""
    where = first_non_finite(value)
    if where is None:
        try:
            return json.dumps(value, indent=indent, default=default, allow_nan=False) + "\n"
        except ValueError:  # a non-finite number reached through `default`
            where = "an entry"
    raise _refusal(where, source)


__all__ = ["NonFiniteError", "first_non_finite", "json_text", "require_finite"]
