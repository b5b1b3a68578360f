"""The process group that Trans, Agg and migration run on, separate from the tokens' group.

A process group runs its collectives in the order they were issued. Gloo pops them from one
work queue, served by 2 worker threads by default; NCCL runs one communicator's operations on
one stream. On the tokens' group, the layers' Trans would queue ahead of the forward's
dispatches. An Agg launched from a gradient hook would queue ahead of the next layer's
backward all-to-all. The all-to-all would then wait for the bulk transfer it was meant to
hide. FasterMoE and Pro-Prophet run their shadow transfers on a stream of their own for this
reason. A second group over the same ranks gives the transfers a queue of their own, and
with NCCL a communicator and stream of their own.

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
    """A new group over the ranks of `group`, for Trans, Agg and migration.

    A new group is made only where `group` (None: the default group) spans the world. This is
    collective: every rank calls it once, in the same order as its other `new_group` calls.
    Otherwise `group` itself is returned. For a subgroup, every rank of the world would have
    to make every such group in one order; `poise.runtime.layouts.create_groups` does that
    for the layouts it makes (`LayoutGroups.ep_transfer`). Without an initialised default
    group, `group` is returned as it is."""
    if not (dist.is_available() and dist.is_initialized()) or not spans_world(group):
        return group
    if dist.get_world_size() == 1:
        return group
    return dist.new_group(list(range(dist.get_world_size())))
