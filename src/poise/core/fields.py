"""Typed reads of fields from user-supplied mappings (YAML, JSON), with errors naming the field.

Every loader of user files goes through these helpers so that bad input always becomes one
`ConfigError` that says which file and which field is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from poise.core.errors import ConfigError, PoiseError
from poise.util.yaml_load import DuplicateKeyError, load_yaml

_MISSING = object()


class _DuplicateJSONKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateJSONKeyError(key)
        out[key] = value
    return out


def parse_yaml(text: str, source: str, error: type[PoiseError] = ConfigError) -> Any:
    """`text` read by the one YAML loader (`poise.util.yaml_load`: every `float()` spelling a
    number, a repeated key refused); any failure is one `error` naming `source`."""
    try:
        return load_yaml(text)
    except DuplicateKeyError as exc:
        raise error(
            f"duplicate key (line {exc.line}; first at line {exc.first_line}): a key may be "
            "given once",
            source=source,
            field=str(exc.key),
        ) from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(f"not valid YAML: {first}", source=source) from None


def read_set_value(raw: str, item: str, option: str) -> Any:
    """The VALUE of a command line's `KEY=VALUE` (`--set`, `--option`) read as YAML by the one
    loader (`3`, `1e-3`, `null`, `{d_model: 64}`); text that is no YAML stays the text itself,
    and a mapping that repeats a key is one `ConfigError` naming `option` and the key."""
    try:
        return load_yaml(raw)
    except DuplicateKeyError as exc:
        raise ConfigError(
            "duplicate key: a key may be given once", source=f"{option} {item}", field=str(exc.key)
        ) from None
    except (yaml.YAMLError, ValueError, RecursionError):
        return raw


def read_mapping_file(path: str | Path, error: type[PoiseError] = ConfigError) -> dict[str, Any]:
    """Read a YAML or JSON file whose top level must be a mapping (YAML by `parse_yaml`; JSON
    with a repeated key refused too)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error("file not found", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read: {exc}", source=str(path)) from None
    if path.suffix != ".json":
        data = parse_yaml(text, str(path), error)
    else:
        try:
            data = json.loads(text, object_pairs_hook=_json_pairs)
        except _DuplicateJSONKeyError as exc:
            raise error(
                "duplicate key: a key may be given once", source=str(path), field=exc.key
            ) from None
        except (json.JSONDecodeError, ValueError, RecursionError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise error(f"not valid JSON: {first}", source=str(path)) from None
    if not isinstance(data, dict):
        raise error(f"top level must be a mapping, got {type(data).__name__}", source=str(path))
    return data


def get_number(
    m: Mapping[str, Any],
    key: str,
    source: str,
    *,
    default: Any = _MISSING,
    positive: bool = False,
    non_negative: bool = False,
    within: tuple[float, float] | None = None,
    prefix: str = "",
) -> float:
    """A finite real number; `positive` / `non_negative` add range checks, and `within` =
    `(low, high)` bounds it to what the quantity can mean (a value outside passes the other
    checks but overflows later: a bandwidth of 1e-300 B/s makes every step time infinite)."""
    field = f"{prefix}{key}"
    if key not in m:
        if default is _MISSING:
            raise ConfigError("missing required field", source=source, field=field)
        return default
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"must be a number, got {value!r}", source=source, field=field)
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"must be finite, got {value!r}", source=source, field=field)
    if positive and value <= 0:
        raise ConfigError(f"must be > 0, got {value!r}", source=source, field=field)
    if non_negative and value < 0:
        raise ConfigError(f"must be >= 0, got {value!r}", source=source, field=field)
    if within is not None and not within[0] <= value <= within[1]:
        low, high = within
        raise ConfigError(
            f"must be within [{low:g}, {high:g}], got {value!r}", source=source, field=field
        )
    return value


def get_int(
    m: Mapping[str, Any],
    key: str,
    source: str,
    *,
    default: Any = _MISSING,
    minimum: int | None = None,
    maximum: int | None = None,
    prefix: str = "",
) -> int:
    """An integer (floats with an integral value are refused: they usually hide a typo)."""
    field = f"{prefix}{key}"
    if key not in m:
        if default is _MISSING:
            raise ConfigError("missing required field", source=source, field=field)
        return default
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"must be an integer, got {value!r}", source=source, field=field)
    if minimum is not None and value < minimum:
        raise ConfigError(f"must be >= {minimum}, got {value}", source=source, field=field)
    if maximum is not None and value > maximum:
        raise ConfigError(f"must be <= {maximum}, got {value}", source=source, field=field)
    return value


def get_str(
    m: Mapping[str, Any],
    key: str,
    source: str,
    *,
    default: Any = _MISSING,
    choices: tuple[str, ...] | None = None,
    prefix: str = "",
) -> str:
    field = f"{prefix}{key}"
    if key not in m:
        if default is _MISSING:
            raise ConfigError("missing required field", source=source, field=field)
        return default
    value = m[key]
    if not isinstance(value, str):
        raise ConfigError(f"must be a string, got {value!r}", source=source, field=field)
    if choices is not None and value not in choices:
        raise ConfigError(
            f"must be one of {', '.join(choices)}; got {value!r}", source=source, field=field
        )
    return value


def get_mapping(
    m: Mapping[str, Any], key: str, source: str, *, prefix: str = "", default: Any = _MISSING
) -> Mapping[str, Any]:
    field = f"{prefix}{key}"
    if key not in m:
        if default is _MISSING:
            raise ConfigError("missing required section", source=source, field=field)
        return default
    value = m[key]
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"must be a mapping, got {type(value).__name__}", source=source, field=field
        )
    return value


def reject_unknown(m: Mapping[str, Any], allowed: set[str], source: str, prefix: str = "") -> None:
    """Unknown keys are almost always typos; refuse them by name."""
    for key in m:
        if key not in allowed:
            raise ConfigError(
                f"unknown field (expected one of {', '.join(sorted(allowed))})",
                source=source,
                field=f"{prefix}{key}",
            )
