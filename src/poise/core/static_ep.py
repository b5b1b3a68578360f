"""The static expert-parallel baseline (GShard, DeepSpeed-MoE): where experts live, where tokens go.

Shapes: homes `[L, E]`, copies `[L, D, E]`, assignment weights `[L, E, D]`.

- D <= E: contiguous blocks of experts, expert e on device floor(e D / E) (DeepSpeed-MoE with
  ep_size = D: each rank holds E / D local experts); remote tokens go to that one copy.
- D > E and E divides D: DeepSpeed-MoE's expert-parallel groups (deepspeed/utils/groups.py,
  `_get_expert_parallel_ranks`, with ep_size = E): EP group g is the E consecutive devices
  [g E, (g + 1) E), so device d holds expert d mod E; the devices with the same d mod E form an
  expert-data-parallel (EDP) group whose gradients are all-reduced. A token is dispatched only
  inside its own EP group (the all-to-all runs over the EP group): source d sends expert e's
  tokens to device (d // E) E + e (`Assignment.group_local` with group size E; every group
  holds one copy of every expert, so no source routes outside its group). The home of e is its
  copy in group 0, device e; the other copies are replicas, whose per-step weight broadcast and
  gradient reduce (`Transfers` Trans and Agg) stand for the EDP all-reduce.
- D > E and E does not divide D: no DeepSpeed configuration (groups.py asserts that ep_size
  divides the world, and the live runtime refuses such worlds, `poise.nn.moe.check_world`). So
  that the simulator still has a baseline on any device count, device d then holds expert
  floor(d E / D) (a contiguous block of floor(D / E) or ceil(D / E) devices per expert, the
  first one its home) and each expert's remote tokens are split evenly over all its copies
  (`Assignment.even`); `ep_group_size` is 0 there.
"""

from __future__ import annotations

import numpy as np

from poise.core.placement import Assignment, Placement


def ep_group_size(experts: int, devices: int) -> int:
    """DeepSpeed-MoE's expert-parallel group size with more devices than experts: E when E
    divides D (> E), else 0 (no groups: D <= E, or the block fallback of the module docstring)."""
    if experts < 1 or devices <= experts or devices % experts:
        return 0
    return experts


def static_homes(layers: int, experts: int, devices: int) -> np.ndarray:
    """Static homes `[L, E]`: expert e on device floor(e D / E) with D <= E (contiguous blocks);
    with D > E, e itself when E divides D (its copy in the first EP group), else the first device
    of its block, ceil(e D / E)."""
    e = np.arange(experts)
    if devices <= experts:
        homes = (e * devices) // experts
    elif ep_group_size(experts, devices):
        homes = e
    else:
        homes = -(-(e * devices) // experts)
    return np.tile(homes, (layers, 1)).astype(np.int64)


def static_copies(experts: int, devices: int) -> np.ndarray:
    """`[D]` the expert each device holds with D > E: d mod E in DeepSpeed's EP groups (E divides
    D), else its block's floor(d E / D)."""
    d = np.arange(devices)
    if ep_group_size(experts, devices):
        return d % experts
    return (d * experts) // devices


def static_placement(layers: int, experts: int, devices: int, slots: int) -> Placement:
    """The static placement `[L, D, E]` copies: the homes alone with D <= E; with D > E every
    device holds one expert (`static_copies`), the copies off the home as replicas."""
    placement = Placement.from_homes(static_homes(layers, experts, devices), devices, slots)
    if devices > experts:
        placement.copies[:, np.arange(devices), static_copies(experts, devices)] = 1
    return placement


def static_assignment(placement: Placement) -> Assignment:
    """The static baseline's routing on `placement` (the static placement, or one that adds
    copies to it): with DeepSpeed's EP groups (`ep_group_size`), every source sends each
    expert's tokens to the copies inside its own EP group (`Assignment.group_local`, group size
    E, split by copies where a group holds several); otherwise each expert's remote tokens are
    split over all its copies in proportion to their counts (`Assignment.even`: to the home
    where it is the only copy)."""
    even = Assignment.even(placement)
    size = ep_group_size(placement.experts, placement.devices)
    if not size:
        return even
    return Assignment.group_local(placement, size, base=even)
