"""Placements in DeepSeek EPLB's format: `phy2log`, `log2phy`, `logcnt`.

EPLB describes a layer's expert placement by physical slots: the cluster's D*P slots (D
devices, P slots per device) are numbered device-major, so slot i lives on device i // P.

- `phy2log[L, D*P]`: the logical expert held in slot i, or -1 for an empty slot (EPLB itself
  always fills every slot; Poise placements may leave slots free, and -1 marks them);
- `log2phy[L, E, maxcnt]`: the slot of copy k of expert e, -1 past its copies; copy 0 (EPLB's
  rank 0) is the home;
- `logcnt[L, E]`: copies of each expert.

Export order inside a device: first the experts it is home to (by expert id), then its replicas
(by expert id, repeated when it holds several copies of one expert), then the empty slots. Copy
numbers: the home copy is 0, the replicas follow in slot order.

Example: one layer, 2 devices x 2 slots, expert 0 at home on device 1 with a replica on device
0, expert 1 at home on device 0:

    >>> p = Placement(np.array([[1, 0]]), np.array([[[1, 1], [1, 0]]]), 2)
    >>> phy2log, log2phy, logcnt = placement_to_eplb(p)
    >>> phy2log.tolist(), log2phy.tolist(), logcnt.tolist()
    ([[1, 0, 0, -1]], [[[2, 1], [0, -1]]], [[2, 1]])
"""

from __future__ import annotations

import numpy as np

from poise.core.errors import PlanError
from poise.core.placement import Placement


def placement_to_eplb(placement: Placement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`Placement` -> `(phy2log[L, D*P], log2phy[L, E, maxcnt], logcnt[L, E])`, see the module
    docstring for the slot order and the -1 padding."""
    placement.validate()
    L, D, E = placement.copies.shape
    P = placement.slots_per_device
    copies = placement.copies.astype(np.int64)
    is_home = (np.arange(D)[None, :, None] == placement.home[:, None, :]).astype(np.int64)
    # Per (layer, device): home section then replica section, each by expert id.
    counts = np.stack([is_home, copies - is_home], axis=2).reshape(L, D, 2 * E)
    items = np.tile(np.arange(2 * E), L * D)
    flat_counts = counts.reshape(-1)
    seq = np.repeat(items, flat_counts)  # concatenated per-(layer, device) slot contents
    used = counts.sum(axis=2).reshape(-1)  # [L*D]
    row = np.repeat(np.arange(L * D), used)
    starts = np.cumsum(used) - used
    pos = np.arange(seq.size) - starts[row]
    layer, device = row // D, row % D
    phy2log = np.full((L, D * P), -1, dtype=np.int64)
    home_slot = np.zeros((L, D * P), dtype=bool)
    phy2log[layer, device * P + pos] = seq % E
    home_slot[layer, device * P + pos] = seq < E

    # Copy numbers: 0 for the home slot; replicas 1, 2, ... in slot order.
    rank = np.zeros((L, D * P), dtype=np.int64)
    rep_l, rep_p = np.nonzero((phy2log >= 0) & ~home_slot)
    if rep_l.size:
        key = rep_l * E + phy2log[rep_l, rep_p]
        order = np.argsort(key, kind="stable")  # within a key, slots stay in increasing order
        sorted_key = key[order]
        first = np.r_[True, sorted_key[1:] != sorted_key[:-1]]
        group_start = np.maximum.accumulate(np.where(first, np.arange(order.size), 0))
        rank[rep_l[order], rep_p[order]] = np.arange(order.size) - group_start + 1

    logcnt = copies.sum(axis=1)
    maxcnt = max(int(logcnt.max()) if logcnt.size else 1, 1)
    log2phy = np.full((L, E, maxcnt), -1, dtype=np.int64)
    held_l, held_p = np.nonzero(phy2log >= 0)
    log2phy[held_l, phy2log[held_l, held_p], rank[held_l, held_p]] = held_p
    return phy2log, log2phy, logcnt


def placement_from_eplb(
    phy2log: np.ndarray,
    devices: int,
    *,
    log2phy: np.ndarray | None = None,
    experts: int | None = None,
) -> Placement:
    """`phy2log[L, D*P]` (-1: empty slot) on D = `devices` devices -> `Placement` with P =
    (`phy2log`'s width) / D slots per device.

    The home of expert e is the device of its copy 0 (`log2phy[l, e, 0]`) when `log2phy` is
    given, else the device of its lowest-numbered slot. `experts` defaults to `log2phy`'s width,
    else to the largest expert id + 1. Every expert must have a copy."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    if phy2log.ndim != 2:
        raise PlanError(
            f"phy2log must be [layers, slots], got shape {phy2log.shape}", field="phy2log"
        )
    L, n_slots = phy2log.shape
    if devices < 1 or n_slots % devices:
        raise PlanError(
            f"{n_slots} physical slots do not split over {devices} devices", field="phy2log"
        )
    P = n_slots // devices
    if experts is None:
        if log2phy is not None:
            experts = int(np.asarray(log2phy).shape[1])
        else:
            experts = int(phy2log.max()) + 1 if phy2log.size else 0
    E = experts
    if phy2log.size and (phy2log.min() < -1 or phy2log.max() >= E):
        raise PlanError(f"expert ids must lie in [0, {E}) or be -1 (empty)", field="phy2log")
    held_l, held_p = np.nonzero(phy2log >= 0)
    copies = np.zeros((L, devices, E), dtype=np.int32)
    np.add.at(copies, (held_l, held_p // P, phy2log[held_l, held_p]), 1)
    missing = np.argwhere(copies.sum(axis=1) == 0)
    if missing.size:
        layer, expert = missing[0]
        raise PlanError(f"layer {layer} expert {expert} has no physical slot", field="phy2log")
    if log2phy is not None:
        log2phy = np.asarray(log2phy, dtype=np.int64)
        if log2phy.ndim != 3 or log2phy.shape[:2] != (L, E):
            raise PlanError(
                f"log2phy must be [{L}, {E}, maxcnt], got {log2phy.shape}", field="log2phy"
            )
        first = log2phy[:, :, 0]
        if (
            first.min(initial=0) < 0
            or first.max(initial=0) >= n_slots
            or np.any(np.take_along_axis(phy2log, first, axis=1) != np.arange(E))
        ):
            raise PlanError(
                "log2phy copy 0 does not point at a slot of its expert", field="log2phy"
            )
    else:
        # Lowest slot of each expert.
        first = np.full((L, E), n_slots, dtype=np.int64)
        np.minimum.at(first, (held_l, phy2log[held_l, held_p]), held_p)
    placement = Placement(home=first // P, copies=copies, slots_per_device=P)
    placement.validate()
    return placement
