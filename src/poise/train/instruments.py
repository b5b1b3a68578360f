"""Benchmark instruments that plug into the training loop's step callbacks, off the hot path.

    instruments = make_instruments(cfg, balancer, rank)   # [] unless the config asks for one
    ... the loop calls start(), before_step(k), after_step(k), untimed_s, finish(), close()

- `FreeBalancing` (`free_balancing: true`): a timing oracle for what balance alone is worth on
  this machine. The policy's plans run (re-planned as often as asked, adopted without a cost
  check: the guard must be off), with everything balancing pays for done at the Balancer's step
  boundary (Agg at `reduce_replicas`; planning, migration and Trans at `step`: `plan_lag` 0,
  `overlap` off) and left out of the step's time. Each interval starts after a barrier over the
  Balancer's group, so a rank's wait for a slower one (imbalance, which the oracle must still
  pay) stays in the step; the mathematics stays static EP's. What stays counted is what balance
  itself costs: the per-step split, the busy neighbours, the smaller GEMMs, one barrier.
- `Turns` (`turns: FILE`): steps in turns with other runs on this host (`poise.train.turns`),
  the Balancer's background work paused while another run holds the turn.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch.distributed as dist

from poise.core.errors import ConfigError
from poise.nn import comm
from poise.runtime.config import BalancerConfig
from poise.runtime.stats import StepStats
from poise.train.turns import StepTurns

UNTIMED = "untimed"  # the seconds of a step an instrument leaves out of its time


class Instrument:
    """The loop's callbacks, each a no-op here: `start` before the first step, `before_step(k)`
    (fields for the step's `metrics.jsonl` line, or None), `after_step(k)`, `untimed_s` (seconds
    of the last step to leave out of its time), `finish(steps)` after the last, `abandon()` on
    an error, `close()` always."""

    untimed_s = 0.0

    def start(self) -> None:
        pass

    def before_step(self, step: int) -> dict[str, Any] | None:
        return None

    def after_step(self, step: int) -> None:
        pass

    def finish(self, steps: int) -> None:
        pass

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass


class FreeBalancing(Instrument):
    """Free balancing (module docstring): the Balancer's boundary work left out of the step's
    time, as one of its `callbacks`."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._t0 = 0.0

    @staticmethod
    def settings(config: BalancerConfig) -> BalancerConfig:
        """`config` with everything at the boundary; one `ConfigError` with the guard on (it
        would price transfers nobody pays)."""
        if config.guard:
            raise ConfigError(
                "free balancing leaves the transfers unpaid, so the guard's prices would be "
                "wrong: turn the guard off",
                field="free_balancing",
            )
        return dataclasses.replace(config, overlap=False, plan_lag=0)

    def before_step(self, step: int) -> dict[str, Any] | None:
        self.untimed_s = 0.0
        return None

    def enter(self, point: str) -> None:
        """Before the Balancer's work at `point`: wait for every rank, then start the clock."""
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            comm.barrier(group=self.group)
        self._t0 = time.perf_counter()

    def leave(self, point: str, stats: StepStats) -> None:
        """After it: its seconds go to the step's `UNTIMED`."""
        seconds = time.perf_counter() - self._t0
        stats.add_seconds(UNTIMED, seconds)
        self.untimed_s += seconds


class Turns(Instrument):
    """Steps in turns with other runs (`poise.train.turns.StepTurns`); the Balancer pauses its
    background work while it does not hold the turn."""

    def __init__(self, turns: StepTurns, balancer: Any) -> None:
        self.turns, self.balancer = turns, balancer

    def start(self) -> None:
        self.turns.arrive()

    def before_step(self, step: int) -> dict[str, Any] | None:
        waited = self.turns.wait(step)
        self.balancer.resume()
        return {"turn": {"waited_s": waited, "began": time.time()}}

    def after_step(self, step: int) -> None:
        self.balancer.pause()
        self.turns.hand_over(step)

    def finish(self, steps: int) -> None:
        self.turns.finish(steps)

    def abandon(self) -> None:
        self.turns.abandon()

    def close(self) -> None:
        self.turns.close()


def make_instruments(cfg: Any, balancer: Any, rank: int) -> list[Instrument]:
    """The instruments `cfg` (a `TrainConfig`) asks for, plugged into `balancer`."""
    out: list[Instrument] = []
    if cfg.free_balancing and balancer.balancing:
        free = FreeBalancing(balancer.group)
        balancer.callbacks.append(free)
        out.append(free)
    if cfg.turns is not None:
        turns = StepTurns.open(
            cfg.turns, cfg.turns_slot, cfg.turns_of, rank, timeout_s=cfg.collective_timeout_s
        )
        out.append(Turns(turns, balancer))
    return out


__all__ = ["UNTIMED", "FreeBalancing", "Instrument", "Turns", "make_instruments"]
