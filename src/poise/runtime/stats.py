"""What the Balancer records per step, for `metrics.jsonl` and for checking the simulator:
the loads under the plan that ran (`layer_loads`), the bytes moved, the seconds by phase, and
what the controller decided and why (`StepStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from poise.core.placement import Assignment, Placement


@dataclass(frozen=True)
class LayerLoads:
    """`device_tokens[L, D]` tokens (token-expert pairs) each rank computes per layer;
    `max_over_mean[L]` their max over mean (1.0: perfectly balanced; 1.0 for an idle layer);
    `tokens_moved[L]` tokens the dispatcher sends to another rank (all sources together)."""

    device_tokens: np.ndarray
    max_over_mean: np.ndarray
    tokens_moved: np.ndarray

    def measured(self, device_tokens: np.ndarray) -> LayerLoads:
        """These loads with `device_tokens[L, D]` as the ranks measured them (rows their slots
        computed) in place of the routed prediction; `tokens_moved` kept."""
        device = np.asarray(device_tokens, dtype=np.float64)
        return LayerLoads(device, max_over_mean(device), self.tokens_moved)


def max_over_mean(device: np.ndarray) -> np.ndarray:
    """`[L]` max over mean of `device[L, D]` (1.0 for an idle layer)."""
    mean = device.mean(axis=1)
    return np.where(mean > 0, device.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def layer_loads(placement: Placement, assignment: Assignment, counts: np.ndarray) -> LayerLoads:
    """Loads of `counts[L, D, E]` routed by `assignment` onto `placement` (integer routes, as
    the dispatcher sends them)."""
    routes = assignment.split(placement, counts)  # [L, W_src, E, W_dst]
    device = routes.sum(axis=(1, 2)).astype(np.float64)  # [L, D]
    off_rank = ~np.eye(counts.shape[1], dtype=bool)[None, :, None, :]  # source != destination
    moved = np.where(off_rank, routes, 0).sum(axis=(1, 2, 3))
    return LayerLoads(device, max_over_mean(device), moved.astype(np.int64))


@dataclass
class StepStats:
    """One training step as the Balancer saw it (this rank's view of the timings).

    Loads under the plan that ran (`LayerLoads`): `max_over_mean[L]`, `device_tokens[L][D]`,
    `tokens_moved[L]`. Bytes moved at this step's boundary, all ranks together: `trans_bytes`,
    `agg_bytes`, `migrate_bytes`; `moved_homes` experts changing rank and `relaid_rows` slots
    rewritten on this rank by a switch. `seconds`: this rank's time per phase (`gate`,
    `dispatch`, `experts`, `combine`; `transfers`; `plan`, the planner's wall seconds for the
    plan decided here, `plan_wait` what the boundary waited of it, `plan_cpu` its CPU seconds
    charged where the ranks share cores; `boundary`: the whole `Balancer.step`); `rank_seconds`:
    every rank's seconds of the step per `MEASURED` name; `measured_period_s`: the step's period
    at the slowest rank.

    At a decision (`replanned`): `decision` (`adopt`, `keep`, `revert`) and its `reason` in
    words (`poise.runtime.control.controller`), `gain_s` the candidate's credited saving over
    its horizon, `switch_cost_s` its switch's price, `doubt_s` what its noise took off the gain,
    `predicted_step_s` the fitted model's step of the candidate weighed, `fit` the
    self-calibration (`Fit.as_dict`), `evidence` on the plan in force (`Evidence.as_dict`);
    `switched`: a plan took effect after this step. `probe`: this step ran the plan's homes
    alone; `retargeted`: layers whose replicas the boundary after it re-chose; `layout`: what
    it ran (`static`, `replicas`, `homes`, `probe`)."""

    step: int
    policy: str
    # the fields below in the order of `as_record`, the metrics line's
    max_over_mean: list[float] = field(default_factory=list)
    device_tokens: list[list[float]] = field(default_factory=list)
    tokens_moved: list[int] = field(default_factory=list)
    replanned: bool = False
    moved_homes: int = 0
    relaid_rows: int = 0
    trans_bytes: int = 0
    agg_bytes: int = 0
    migrate_bytes: int = 0
    decision: str = ""
    reason: str = ""
    probe: bool = False
    retargeted: int = 0
    layout: str = ""
    switched: bool = False
    gain_s: float = 0.0
    switch_cost_s: float = 0.0
    doubt_s: float = 0.0
    predicted_step_s: float = 0.0
    measured_period_s: float = 0.0
    fit: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    rank_seconds: dict[str, list[float]] = field(default_factory=dict)

    def add_seconds(self, phase: str, s: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + s

    def set_loads(self, loads: LayerLoads) -> None:
        self.max_over_mean = [float(x) for x in loads.max_over_mean]
        self.device_tokens = loads.device_tokens.tolist()
        self.tokens_moved = [int(x) for x in loads.tokens_moved]

    def as_record(self) -> dict[str, Any]:
        """The fields of a training run's `metrics.jsonl` line that come from the Balancer
        (`poise.train.loop`; `poise.report.runs.MeasuredRun` reads them): the dataclass's,
        `seconds` as `moe_s` and `rank_seconds` as `rank_s`, without `step` and `policy`."""
        record = asdict(self)
        del record["step"], record["policy"]
        record["moe_s"] = record.pop("seconds")
        record["rank_s"] = record.pop("rank_seconds")
        return record
