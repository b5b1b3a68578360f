"""Expert slots: how a `Placement` maps onto the stacked expert weights of each rank.

Every rank's `Experts` module holds `S` slots (stacked weights `[S, ...]`). In one layer, slot
`i` of rank `r` holds expert `expert[i]` (or nothing: -1). `home[i]` says whether rank r is that
expert's home (the owner: its copy is the master weights and carries the optimizer state);
other held slots are replicas, refreshed from the home by Trans and reduced back by Agg.

The order is fixed so every rank derives the same map from the same plan: home experts first,
then replicas in expert order, then empty slots. Without a previous map the homes are in expert
order; with one (`previous`, the maps in force when a plan is applied) a home that stays on its
rank keeps its slot when it still fits in the home prefix, and the new homes fill the free
prefix slots in expert order, so a plan that moves one home re-lays a couple of rows, not every
row behind it. Several copies of one expert on one rank (`copies > 1`) are one slot: the tokens
are the same and so is the work.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def slot_maps(
    placement: Placement, layer: int, slots: int, previous: Sequence[SlotMap] | None = None
) -> list[SlotMap]:
    """`[D]` slot maps of `layer`, one per rank, each with `slots` slots; `previous` (`[D]`, the
    maps in force) keeps staying homes in their slots (see the module docstring).

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
        if previous is not None:
            owned = _keep_slots(owned, previous[rank])
        expert[: owned.size] = owned
        expert[owned.size : n] = replicas
        is_home = np.zeros(slots, dtype=bool)
        is_home[: owned.size] = True
        maps.append(SlotMap(expert=expert, home=is_home))
    return maps


def _keep_slots(owned: np.ndarray, previous: SlotMap) -> np.ndarray:
    """`[H]` the home prefix for the sorted home experts `owned`: each one that was a home in
    `previous` at a slot below `H` stays there; the others fill the free slots in order."""
    before, was_home = previous.expert[: owned.size], previous.home[: owned.size]
    stays = was_home & np.isin(before, owned)
    prefix = np.where(stays, before, -1)
    prefix[~stays] = owned[~np.isin(owned, before[stays])]
    return prefix
