"""Free balancing: a timing oracle that measures what balance alone is worth on this machine.

The ideal a balancing run is judged against is "perfect balance, free transfers". Modelled as
`c x` the pairs the slowest ranks shed (`poise.report.ideal`), it assumes every shed pair saves
the expert clock's `c`, which measured runs do not bear out (the shed pairs' premise,
docs/benchmarks.md). `Balancer(free_balancing=True)` runs that ideal for real: a policy's plans
(re-planned as often as wanted, adopted without a cost check) with everything balancing pays
for done at the step boundary and left out of the step's time:

- Agg (the replicas' gradients summed into their homes) at `reduce_replicas`;
- planning (decided at its request's step, `plan_lag` 0: the leader waits for its planner),
  migration and Trans (awaited at once, `overlap` off) at `step`.

Each such interval starts after a barrier over the Balancer's group, so a rank's wait for a
slower one (imbalance, which the oracle must still pay) stays in the step's time; the interval
from the barrier's end to the transfers' end goes to the step's `UNTIMED` seconds, which the
training loop takes out of the step (`Balancer.untimed_s`). The mathematics is static EP's, as
for any plan: the transfers all run, only their seconds are not counted. What stays counted is
what balance itself costs: the per-step token split, the busy neighbours, the dearer smaller
GEMMs and the all-to-all's other routes, and one barrier's latency per interval (against the
oracle).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from poise.core.errors import ConfigError
from poise.runtime.stats import StepStats

UNTIMED = "untimed"  # a step's seconds left out of its time under free balancing


def free_settings(free: bool, guard: bool, overlap: bool, plan_lag: int) -> tuple[bool, int]:
    """The Balancer's `(overlap, plan_lag)` under free balancing (`free`): everything at the
    boundary (`(False, 0)`); otherwise as given. Free balancing with the guard on is one
    `ConfigError` naming `free_balancing`: the guard would price transfers nobody pays."""
    if not free:
        return overlap, plan_lag
    if guard:
        raise ConfigError(
            "free balancing leaves the transfers unpaid, so the guard's prices would be "
            "wrong: turn the guard off",
            field="free_balancing",
        )
    return False, 0


class UntimedWindows:
    """The intervals of one rank's step that free balancing leaves out (module docstring).

    `enabled` False: `start` returns None and `end` records nothing, so a normal run pays no
    barrier."""

    def __init__(self, enabled: bool, group: dist.ProcessGroup | None) -> None:
        self.enabled = enabled
        self.group = group

    def start(self) -> float | None:
        """Wait for every rank of the group, then the interval's start (None when disabled)."""
        if not self.enabled:
            return None
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)
        return time.perf_counter()

    def end(self, stats: StepStats, started: float | None) -> None:
        """Add the seconds since `started` to `stats`' `UNTIMED` (nothing when None)."""
        if started is not None:
            stats.add_seconds(UNTIMED, time.perf_counter() - started)


__all__ = ["UNTIMED", "UntimedWindows", "free_settings"]
