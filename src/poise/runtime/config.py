"""`BalancerConfig`: every setting of the live Balancer and its default, once.

    balancer = Balancer(model, opt, "auto", replan_every=10,
                        config=BalancerConfig(total_steps=1000, probe_every=0))

`poise.train.config.TrainConfig` takes its balancing defaults from here. Groups:

- planning: `plan_lag` (a plan requested at step s is decided at s + lag, the lag then following
  the planner's measured time; 0: planned and decided at once), `predictor` (`ema`, `last`,
  `window:N`), `history` (steps of loads kept), `horizon` (steps a plan is credited over at
  least; None: the re-plan interval), `total_steps` (the run's last step, so that no plan is
  priced past it; None: not known), `options` (per-policy settings), `cluster` (the prior: a
  `Cluster`, a preset's name or a YAML path; None: this host's CPU ranks), `spec` (None: read
  from the layers), `plan_process` (plan in a worker process; off: on a thread),
  `check_plans` (every rank also plans and compares its plan with the leader's);
- guard: `guard` (the controller adopts only what pays and reverts what the evidence refutes;
  off: every plan that differs is adopted), `margin` (a switch is paid `1 + margin` times),
  `probe_every` (while a plan with replicas is in force, one step in that many runs on its
  homes alone, for the paired clock; 0: off);
- transfers: `overlap` (Agg from gradient hooks, Trans awaited in each layer's forward; off:
  both at the boundary), `split_tokens` (a replicated expert's tokens split among its holders
  by each step's counts), `retarget` (each boundary re-chooses the plan's replicas from the
  step just run), `host_link` (CPU ranks of one host move rows through shared memory),
  `separate_transfers` (Trans, Agg and migration on a process group of their own),
  `compression` (None, or HybridEP's share of each replica's residual sent), `optimizer_hooks`
  (run `reduce_replicas` and `step` from optimizer step hooks, for loops that cannot call them);
- calibration: `calibrate` (fit the cost model's constants to the run), `probe_transfers` (time
  the bulk-transfer rate and a synthetic switch at start-up).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.spec import ModelSpec


@dataclass(frozen=True)
class BalancerConfig:
    """The Balancer's settings (module docstring); checked when made."""

    # planning
    plan_lag: int = 1
    predictor: str = "ema"
    history: int = 100
    horizon: int | None = None
    total_steps: int | None = None
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    cluster: Cluster | str | None = None
    spec: ModelSpec | None = None
    plan_process: bool = True
    check_plans: bool = False
    # guard
    guard: bool = True
    margin: float = 0.2
    probe_every: int = 5
    # transfers
    overlap: bool = True
    split_tokens: bool = True
    retarget: bool = True
    host_link: bool = False
    separate_transfers: bool = True
    compression: float | None = None
    optimizer_hooks: bool = False
    # calibration
    calibrate: bool = True
    probe_transfers: bool = True

    def __post_init__(self) -> None:
        probe = self.probe_every
        checks = (
            ("plan_lag", self.plan_lag >= 0, "must be >= 0"),
            ("history", self.history >= 1, "must be >= 1"),
            ("horizon", self.horizon is None or self.horizon >= 1, "must be >= 1"),
            ("total_steps", self.total_steps is None or self.total_steps >= 0, "must be >= 0"),
            ("margin", self.margin >= 0, "must be >= 0"),
            ("probe_every", probe == 0 or probe >= 2, "must be 0 (off) or >= 2"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{rule}, got {getattr(self, name)!r}", field=name)

    def check(self, replan_every: int) -> None:
        """The settings that depend on the re-plan interval: one `ConfigError` naming the field."""
        if replan_every < 1:
            raise ConfigError(f"must be >= 1, got {replan_every}", field="replan_every")
        if self.plan_lag > replan_every:
            raise ConfigError(
                f"must be in [0, replan_every = {replan_every}], got {self.plan_lag}",
                field="plan_lag",
            )
