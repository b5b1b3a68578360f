"""Lazy package exports: names resolved from their submodule on first use, so importing a
package (e.g. `poise.runtime.launch`, `poise.train.config`) does not import torch-heavy
siblings."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `package.<exports[name]>` on demand."""

    def resolve(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return resolve
