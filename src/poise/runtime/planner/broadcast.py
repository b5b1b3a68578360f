"""One planner for all ranks: the leader plans and decides, every rank takes its decision.

The planning job is deterministic on identical inputs, so only the leader (rank 0 of the group
that must take the same decisions) runs it; at the decision boundary it broadcasts an
`Outcome` (the controller's action and its learned state after it, the fitted cluster) and
every rank acts on that. `check_plans` makes every rank plan as well and compare its plan's
digest with the leader's (`plans_agree`): a check of determinism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.nn import comm
from poise.nn.comm import comm_device
from poise.runtime.control.controller import Action
from poise.runtime.control.evidence import Evidence
from poise.runtime.selfcal.fit import Fit


@dataclass(frozen=True)
class Outcome:
    """The leader's decision at one boundary: `action` (`Adopt`, `Keep`, `Revert`), the
    `evidence` it weighed, the fitted `cluster` and `fit`, `control` (the controller's state
    after deciding), `next_lag` (the steps from the next request to its decision),
    `modelled_switch_s` (the chosen plan's modelled migration, what `SwitchPrice` scales),
    `wait_s` (the leader's wait for its planner) and `forecast_digest` (the policy's plan)."""

    action: Action
    evidence: Evidence | None
    cluster: Cluster
    fit: Fit
    control: dict[str, Any] = field(default_factory=dict)
    next_lag: int = 0
    modelled_switch_s: float = 0.0
    wait_s: float = 0.0
    forecast_digest: int = 0


def is_leader(group: dist.ProcessGroup | None) -> bool:
    """Whether this process is rank 0 of `group` (True without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def _alone(group: dist.ProcessGroup | None) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1


def share_outcome(
    outcome: Outcome | None, group: dist.ProcessGroup | None, *, leader: bool
) -> Outcome:
    """The leader's `outcome` on every rank of `group` (one `broadcast_object_list` from its
    rank 0; none without a process group). Collective."""
    if _alone(group):
        if outcome is None:
            raise ValueError("a single rank must bring its own outcome")
        return outcome
    box: list[Outcome | None] = [outcome if leader else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    comm.broadcast_object_list(box, src=src, group=group)
    shared = box[0]
    assert isinstance(shared, Outcome)
    return shared


def plans_agree(digest: int | None, leader_digest: int, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank's own plan digest (None: this rank did not plan) is the leader's (one
    all-reduce of a flag, MAX: any disagreement is seen by every rank). Collective."""
    differs = digest is not None and digest != leader_digest
    if _alone(group):
        return not differs
    t = torch.tensor([int(differs)], dtype=torch.long, device=comm_device(group, "cpu"))
    comm.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return not bool(t[0])
