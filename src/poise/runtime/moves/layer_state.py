"""What the Balancer keeps per MoE layer (`LayerState`), and the small helpers on a layer's
stacked expert tensors it shares with its transfers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from poise.nn.slots import SlotMap
from poise.runtime.moves.exchange import Pending, Routes, trans_routes


def same_homes(a: Sequence[SlotMap], b: Sequence[SlotMap]) -> bool:
    """Every rank's home slots hold the same experts in the same slots (homes come first, so a
    plan that only adds, drops or swaps replicas keeps them): nothing to migrate, the replica
    slots are filled by Trans before they are read."""
    return all(
        np.array_equal(x.expert[x.home], y.expert[y.home]) and np.array_equal(x.home, y.home)
        for x, y in zip(a, b, strict=True)
    )


class LayerState:
    """One layer's slot maps of every rank, cached Trans/Agg routes, transfers in flight, the
    step's counts and its stacked per-slot expert tensors `params`, each `[P, ...]`:
    `w_in [P, M, H]`, `w_gate [P, M, H]` (SwiGLU only), `w_out [P, H, M]`."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        self.layer = layer
        self.index = index
        self.params: list[nn.Parameter] = list(layer.experts.weights())
        self.maps: list[SlotMap] = []
        self.trans_routes = Routes.build([])
        self.agg_routes = Routes.build([])
        self.trans: Pending | None = None
        self.aggs: list[Pending] = []
        self.counts = torch.zeros(0, dtype=torch.long)
        self.rows = 0  # token-expert rows this rank computed in the layer this step
        self.grads_ready: set[int] = set()

    @property
    def has_replicas(self) -> bool:
        return len(self.trans_routes) > 0

    def set_maps(self, maps: list[SlotMap]) -> None:
        self.maps = maps
        self.trans_routes = trans_routes(maps)
        self.agg_routes = self.trans_routes.swapped()


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """`p.grad`, a zero tensor first where it has none (Agg adds into it)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


__all__ = ["LayerState", "grad_of", "same_homes"]
