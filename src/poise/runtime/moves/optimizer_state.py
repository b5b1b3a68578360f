"""Where the optimizer state of each expert tensor lives, inside an optimizer container.

Migration moves a home's weights with its optimizer moments (`transfers.migrate` reads
`optimizer.state[p]`). Training loops often hand over a container instead of one
`torch.optim.Optimizer`: torchtitan's `OptimizersContainer` (an `Optimizer` itself, whose own
`state` stays empty: its `optimizers` hold the moments), or a wrapper such as torch's
`ZeroRedundancyOptimizer` (`optim`). Reading the container's `state` would leave the moments
behind when experts move, silently; `ExpertStates` finds, for each expert tensor, the inner
optimizer that holds it, or refuses with one `ConfigError` naming what it could not see.

The search: the object given and, recursively, its inner optimizers (`optimizers`, an iterable,
then `optimizer`, `optim`, `base_optimizer`, `_optimizer`); among those, a torch `Optimizer`
without inner ones (a leaf) holds a tensor when the tensor is in one of its `param_groups`. A
tensor held by no leaf is refused, as is one held by two.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from poise.core.errors import ConfigError

INNER = ("optimizers", "optimizer", "optim", "base_optimizer", "_optimizer")
MAX_DEPTH = 8


def inner_optimizers(obj: Any) -> list[Any]:
    """The optimizers `obj` wraps, in `INNER`'s order (none for a plain optimizer)."""
    out: list[Any] = []
    for name in INNER:
        value = getattr(obj, name, None)
        if value is None or value is obj:
            continue
        if name == "optimizers":
            if isinstance(value, Mapping):
                value = list(value.values())
            if isinstance(value, Sequence) or hasattr(value, "__iter__"):
                out.extend(v for v in value if v is not None)
            continue
        if isinstance(value, torch.optim.Optimizer) or any(hasattr(value, n) for n in INNER):
            out.append(value)
    return out


def leaf_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """Every torch `Optimizer` inside `optimizer` (itself included) that wraps no other."""
    leaves: list[torch.optim.Optimizer] = []
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > MAX_DEPTH:
            return
        seen.add(id(obj))
        inner = inner_optimizers(obj)
        for o in inner:
            walk(o, depth + 1)
        if not inner and isinstance(obj, torch.optim.Optimizer):
            leaves.append(obj)

    walk(optimizer, 0)
    return leaves


class _StateLookup(Mapping[torch.Tensor, dict]):
    """`state[p]` of the leaf optimizer that holds `p` (empty before its first step)."""

    def __init__(self, owners: dict[int, torch.optim.Optimizer], params: list[torch.Tensor]):
        self._owners = owners
        self._params = params

    def __getitem__(self, p: torch.Tensor) -> dict:
        owner = self._owners.get(id(p))
        if owner is None:
            raise KeyError(p)
        return owner.state[p]

    def get(self, p: torch.Tensor, default: Any = None) -> Any:  # type: ignore[override]
        owner = self._owners.get(id(p))
        return default if owner is None else owner.state.get(p, default)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p in self._params if p in self._owners[id(p)].state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ExpertStates:
    """The optimizer state of `params` (a model's stacked expert tensors) wherever in
    `optimizer` (an optimizer or a container of them) it lives: `state[p]` as a torch
    optimizer's. Raises `ConfigError` (field `optimizer`) where a tensor is held by no inner
    optimizer, or by two, or the object holds no torch optimizer at all."""

    def __init__(self, optimizer: Any, params: Sequence[torch.Tensor]) -> None:
        leaves = leaf_optimizers(optimizer)
        kind = type(optimizer).__name__
        if not leaves:
            raise ConfigError(
                f"cannot see the optimizer state inside {kind}: pass a torch.optim.Optimizer "
                f"or a container of them (an `optimizers` list, or an `optimizer` / `optim` "
                f"attribute), or the experts' moments would stay behind when they move",
                field="optimizer",
            )
        held: dict[int, list[torch.optim.Optimizer]] = {}
        for leaf in leaves:
            for group in leaf.param_groups:
                for q in group["params"]:
                    held.setdefault(id(q), []).append(leaf)
        owners: dict[int, torch.optim.Optimizer] = {}
        for i, p in enumerate(params):
            found = held.get(id(p), [])
            if len(found) != 1:
                what = "no" if not found else f"{len(found)}"
                raise ConfigError(
                    f"{what} optimizer(s) inside {kind} hold expert tensor {i} "
                    f"({list(p.shape)}); build the optimizer after apply_expert_parallel, over "
                    f"the model's parameters, each in one optimizer",
                    field="optimizer",
                )
            owners[id(p)] = found[0]
        self.owners = owners
        self.leaves = leaves
        self.state: Mapping[torch.Tensor, dict] = _StateLookup(owners, list(params))


__all__ = ["ExpertStates", "inner_optimizers", "leaf_optimizers"]
