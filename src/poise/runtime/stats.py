"""What the Balancer records per step, for logs and for checking the simulator.

- Loads under the plan in force: from the gathered routing counts `counts[L, D, E]` (tokens each
  source rank routed to each expert) and the plan's `Placement`/`Assignment`, the tokens each
  rank computes per layer, `[L, D]`, their max/mean per layer, and the tokens the dispatcher
  moves to another rank.
- Bytes moved at the step boundary: Trans (weights to replicas), Agg (replica gradients to
  homes), migration (weights and optimizer state of experts whose home changed); all ranks
  together.
- Seconds this rank spent per phase: the layer's own phases where it reports them (gate,
  dispatch, experts, combine), transfers (launching and waiting for Trans/Agg/migration),
  planning (on the planner's thread, and what of it delayed the step boundary).
- What the guard decided at a re-plan and on which figures (`poise.runtime.guard`).
"""

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
    ratio = max_over_mean(device)
    D = counts.shape[1]
    off_rank = ~np.eye(D, dtype=bool)[None, :, None, :]
    moved = np.where(off_rank, routes, 0).sum(axis=(1, 2, 3))
    return LayerLoads(device, ratio, moved.astype(np.int64))


@dataclass
class StepStats:
    """One training step as the Balancer saw it (this rank's view of the timings).

    `max_over_mean[L]`, `device_tokens[L][D]`, `tokens_moved[L]`: loads under the plan in force
    (see `LayerLoads`); `trans_bytes`, `agg_bytes`, `migrate_bytes`: all ranks together, moved
    at this step's boundary; `seconds`: this rank's time per phase (`gate`, `dispatch`,
    `experts`, `combine` when the layers report them; `transfers`; `plan`: the planner thread's
    seconds for the plan decided here, `plan_wait`: how much of it this boundary waited,
    `plan_cpu`: its CPU seconds charged to the step (CPU devices; 0 on accelerators);
    `boundary`: the whole `Balancer.step`).

    Decisions: `replanned`: a plan was decided after this step; `decision`: what the guard
    decided (`adopt`, `same`, `no-gain`, `off`; the plan in force did not pay and `replace`:
    the fresh candidate replaced it, `fallback`: an exit did (`guard.exit_plans`); `idle`:
    refused, and the candidate's gain did not cover the planning, so re-plans back off;
    `unsettled`: refused on the static layout, the last candidate would not have paid on the
    steps since (`poise.runtime.leader`); empty: nothing decided);
    `switched`: a new plan took effect after this step, with `moved_homes` experts changing
    rank and `relaid_rows` expert slots rewritten in place on this rank (weights and moments);
    `gain_s`, `switch_cost_s`, `doubt_s`: the guard's predicted saving over the horizon, the
    switch's cost and what the recent steps' spread took off the saving (`guard.Decision`);
    `predicted_step_s`: the fitted cost model's step seconds of the plan kept;
    `measured_period_s`: the slowest rank's wall seconds from the previous step's Agg landing
    to this step's (the boundary before this step, its forward, backward and Agg); `fit`:
    the self-calibration's figures (`selfcal.Fit.as_dict`) when planned;
    `verdict`: the guard's figures on whether the plan in force paid (`verdict.Verdict.as_dict`:
    the model's `saving_s` against the measured `cost_s` over `steps`, the wall clock's
    `wall_saving_s` per step and its standard error `wall_se_s`, from `probes` probe steps when
    > 0), when a plan other than the static layout was judged here; `probe`: this step was a
    probe step (the plan's homes without its replicas, `Balancer(probe_every=)`); `retargeted`:
    the layers whose replicas the boundary after this step re-chose (`Balancer(retarget=)`,
    `poise.plan.retarget`); `layout`:
    what the step ran under (`records.LAYOUT_NAMES`: `static`, the static layout; `replicas`, a
    plan with replicas; `homes`, a plan that moved homes and holds none; `probe`, a probe step);
    `rank_seconds`: every rank's own seconds of the step, one list `[D]` per
    `selfcal.MEASURED` name (period, boundary, gate, all-to-all, experts, transfers), as the
    Balancer gathers them (the phases above are this rank's alone)."""

    step: int
    policy: str
    max_over_mean: list[float] = field(default_factory=list)
    device_tokens: list[list[float]] = field(default_factory=list)
    tokens_moved: list[int] = field(default_factory=list)
    trans_bytes: int = 0
    agg_bytes: int = 0
    migrate_bytes: int = 0
    moved_homes: int = 0
    relaid_rows: int = 0
    replanned: bool = False
    decision: str = ""
    switched: bool = False
    gain_s: float = 0.0
    switch_cost_s: float = 0.0
    doubt_s: float = 0.0
    predicted_step_s: float = 0.0
    measured_period_s: float = 0.0
    fit: dict[str, Any] = field(default_factory=dict)
    verdict: dict[str, Any] = field(default_factory=dict)
    probe: bool = False
    retargeted: int = 0
    layout: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    rank_seconds: dict[str, list[float]] = field(default_factory=dict)

    def add_seconds(self, phase: str, s: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + s

    def set_loads(self, loads: LayerLoads) -> None:
        self.max_over_mean = [float(x) for x in loads.max_over_mean]
        self.device_tokens = loads.device_tokens.tolist()
        self.tokens_moved = [int(x) for x in loads.tokens_moved]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (for a log line)."""
        return asdict(self)

    def as_record(self) -> dict[str, Any]:
        """The fields of a training run's `metrics.jsonl` line that come from the Balancer
        (`poise.train.loop`; `poise.report.runs.MeasuredRun` reads them): the dataclass's,
        `seconds` as `moe_s` and `rank_seconds` as `rank_s`, without `step` and `policy`."""
        return {
            "max_over_mean": list(self.max_over_mean),
            "device_tokens": self.device_tokens,
            "tokens_moved": self.tokens_moved,
            "replanned": bool(self.replanned),
            "moved_homes": self.moved_homes,
            "relaid_rows": self.relaid_rows,
            "trans_bytes": self.trans_bytes,
            "agg_bytes": self.agg_bytes,
            "migrate_bytes": self.migrate_bytes,
            "decision": self.decision,
            "probe": bool(self.probe),
            "retargeted": self.retargeted,
            "layout": self.layout,
            "switched": bool(self.switched),
            "gain_s": self.gain_s,
            "switch_cost_s": self.switch_cost_s,
            "doubt_s": self.doubt_s,
            "predicted_step_s": self.predicted_step_s,
            "measured_period_s": self.measured_period_s,
            "fit": dict(self.fit),
            "verdict": dict(self.verdict),
            "moe_s": dict(self.seconds),
            "rank_s": dict(self.rank_seconds),
        }
