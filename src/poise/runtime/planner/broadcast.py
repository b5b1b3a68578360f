"""One planner for all ranks: the leader plans and decides, every rank takes its decision.

The Balancer's planning job (fit the cost model, forecast, run the policy, price the candidate)
is deterministic on identical inputs, so every rank would compute the same plan. Only the
leader (rank 0 of the group that must take the same decisions) runs it; at the decision
boundary it broadcasts an `Outcome` (the plan, what the guard decided, the figures behind it and
the fitted cluster), and every rank acts on that. On CPU ranks that share the cores this takes
the planning's CPU time from D ranks' planner threads down to one; on accelerators it frees
every host but one. `check_plans` makes every rank plan as well and compare its plan's digest
with the leader's (`PlanMismatchError` on every rank if any differs): a check of determinism,
at the old cost.

    outcome = mine if leader else None
    outcome = share_outcome(outcome, group, leader=leader)  # collective: the leader's, everywhere
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.core.placement import Plan
from poise.nn.comm import comm_device
from poise.runtime.selfcal.fit import Fit
from poise.runtime.verdict import Verdict

# decisions that apply the leader's plan (`fallback` applies it too: the exit chosen)
ADOPTING = ("adopt", "off", "replace")


@dataclass(frozen=True)
class Outcome:
    """The leader's decision at one boundary. `decision`: the guard's (`adopt`, `off`: apply
    `plan`; the plan in force did not pay and `replace`: the fresh candidate `plan` replaces
    it, `fallback`: `plan` is the exit chosen (`guard.exit_plans`), and re-plans back off;
    `same`, `no-gain`: keep the plan in force; `idle`: keep it and back off, the candidate's
    gain did not cover its planning; `unsettled`: keep the static layout, the last candidate
    would not have paid on the steps since, `poise.runtime.leader`); `gain_s`, `switch_s`,
    `doubt_s`: the guard's figures for `plan` (`guard.Decision`);
    `predicted_step_s`: the fitted model's step of the plan that will run;
    `modelled_switch_s`: the candidate's switch on the prior cluster (what `k_switch` scales);
    `wait_s`: how long the leader's boundary waited for its planner; `cluster`, `fit`: the
    fitted cluster and its constants; `verdict`: the guard's figures on whether the plan in
    force paid (`verdict.Verdict`; None while the static layout is in force); `next_lag`: the
    steps from the next request to its decision (`planner.adoption_lag` of this job's wall
    time; 0: keep the Balancer's `plan_lag`); `step_gain_s`: where `plan` takes effect as
    adopted or as a replacement, its credited saving a step over the plan in force
    (`SwitchGuard.promised`)."""

    plan: Plan
    decision: str
    gain_s: float
    switch_s: float
    predicted_step_s: float
    modelled_switch_s: float
    wait_s: float
    cluster: Cluster
    fit: Fit
    doubt_s: float = 0.0
    verdict: Verdict | None = None
    next_lag: int = 0
    step_gain_s: float = 0.0

    @property
    def adopts(self) -> bool:
        return self.decision in ADOPTING


def is_leader(group: dist.ProcessGroup | None) -> bool:
    """Whether this process is rank 0 of `group` (True without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def share_outcome(
    outcome: Outcome | None, group: dist.ProcessGroup | None, *, leader: bool
) -> Outcome:
    """The leader's `outcome` on every rank of `group` (one `broadcast_object_list` from its
    rank 0; none without a process group). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if outcome is None:
            raise ValueError("a single rank must bring its own outcome")
        return outcome
    box: list[Outcome | None] = [outcome if leader else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group, device=comm_device(group, "cpu"))
    shared = box[0]
    assert isinstance(shared, Outcome)
    return shared


def plans_agree(plan: Plan | None, leader_plan: Plan, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank's own `plan` (None: this rank did not plan) has the leader's digest
    (one all-reduce of a flag, MAX: any disagreement is seen by every rank). Collective."""
    differs = plan is not None and plan.digest() != leader_plan.digest()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return not differs
    t = torch.tensor([int(differs)], dtype=torch.long, device=comm_device(group, "cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return not bool(t[0])


__all__ = ["ADOPTING", "Outcome", "is_leader", "plans_agree", "share_outcome"]
