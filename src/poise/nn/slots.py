"""Expert slots: how a `Placement` maps onto the stacked expert weights of each rank.

Every rank's `Experts` module holds `S` slots (stacked weights `[S, ...]`). In one layer, slot
`i` of rank `r` holds expert `expert[i]` (or nothing: -1). `home[i]` says whether rank r is that
expert's home (the owner: its copy is the master weights and carries the optimizer state);
other held slots are replicas, refreshed from the home by Trans and reduced back by Agg.

The order is fixed so every rank derives the same map from the same plan: home experts first in
expert order, then replicas in expert order, then empty slots. Several copies of one expert on
one rank (`copies > 1`) are one slot: the tokens are the same and so is the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.errors import PlanError
from poise.core.placement import Placement


@dataclass(frozen=True)
class SlotMap:
    """One rank's slots in one layer: `expert[S]` int (-1: empty) and `home[S]` bool."""

    expert: np.ndarray
    home: np.ndarray

    @property
    def slots(self) -> int:
        return int(self.expert.shape[0])

    def slot_of(self, num_experts: int) -> np.ndarray:
        """`[E]` int: the slot holding each expert on this rank, -1 where none does."""
        out = np.full(num_experts, -1, dtype=np.int64)
        held = self.expert >= 0
        out[self.expert[held]] = np.nonzero(held)[0]
        return out


def slot_maps(placement: Placement, layer: int, slots: int) -> list[SlotMap]:
    """`[D]` slot maps of `layer`, one per rank, each with `slots` slots.

    Raises `PlanError` (field `placement.slots`) when a rank holds more distinct experts than it
    has slots."""
    home = placement.home[layer]  # [E]
    held = placement.copies[layer] > 0  # [D, E]
    maps = []
    for rank in range(placement.devices):
        owned = np.nonzero(held[rank] & (home == rank))[0]
        replicas = np.nonzero(held[rank] & (home != rank))[0]
        n = owned.size + replicas.size
        if n > slots:
            raise PlanError(
                f"layer {layer} rank {rank} holds {n} experts but has {slots} slots",
                field="placement.slots",
            )
        expert = np.full(slots, -1, dtype=np.int64)
        expert[:n] = np.concatenate([owned, replicas])
        is_home = np.zeros(slots, dtype=bool)
        is_home[: owned.size] = True
        maps.append(SlotMap(expert=expert, home=is_home))
    return maps
