"""The process group that Trans, Agg and migration run on, separate from the tokens' group.

A group runs its collectives in issue order (gloo: one work queue; NCCL: one stream per
communicator), so on the tokens' group a Trans or Agg would queue ahead of the dispatch
all-to-all it was meant to hide under. As FasterMoE and Pro-Prophet give their shadow transfers
a stream of their own, a second group over the same ranks gives them their own queue.

    transfers = transfer_group(group)   # collective where `group` is the world
"""

from __future__ import annotations

import torch.distributed as dist


def spans_world(group: dist.ProcessGroup | None) -> bool:
    """Whether `group` (None: the default group) holds every rank of the world."""
    if group is None or group is dist.group.WORLD:
        return True
    return dist.get_world_size(group) == dist.get_world_size()


def transfer_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A new group over the ranks of `group` (None: the default group) for Trans, Agg and
    migration, where `group` spans the world: collective, every rank once, in the same order
    as its other `new_group` calls. Otherwise, or without an initialised default group,
    `group` itself (a subgroup's would need every rank of the world to make it:
    `poise.runtime.smartmoe.create_groups` does, `LayoutGroups.ep_transfer`)."""
    if not (dist.is_available() and dist.is_initialized()) or not spans_world(group):
        return group
    world = dist.get_world_size()
    return group if world == 1 else dist.new_group(list(range(world)))
