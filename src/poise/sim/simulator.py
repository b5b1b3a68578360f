"""Trace replay: for each step, plan from predicted loads, price on the step's actual loads.

`replay(trace_counts, ctx, policies, replan_every, predictor)`:

- every `replan_every` steps each policy plans from the predictor's forecast made from the steps
  before (step 0 has no history: policies see uniform loads), with its own previous plan;
- each step is priced on its *actual* loads, so stale plans cost what they cost; the step where a
  new plan takes effect pays its migration;
- planning wall time is measured per call.

Result per policy: step time `[S]`, phase totals `[S, phases]`, device max/mean `[S]`, bytes
moved `[S]` and planner milliseconds per re-plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from poise.placement import Plan
from poise.policies.base import PlanContext, make_plan
from poise.predict import Predictor


@dataclass
class PolicyRun:
    """What one policy did over a replay. Arrays are per step `[S]` unless noted."""

    policy: str
    step_s: np.ndarray
    max_over_mean: np.ndarray
    bytes_moved: np.ndarray
    phases: dict[str, np.ndarray]
    plan_ms: list[float] = field(default_factory=list)
    device_load: np.ndarray | None = None  # [S, D] tokens per device summed over layers
    last_plan: Plan | None = None

    @property
    def mean_step_s(self) -> float:
        return float(self.step_s.mean())

    @property
    def plan_ms_per_layer(self) -> float:
        return float(np.mean(self.plan_ms)) if self.plan_ms else 0.0


def replay(
    counts: np.ndarray,
    ctx: PlanContext,
    policies: Sequence[str],
    *,
    replan_every: int = 10,
    predictor: Predictor | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, PolicyRun]:
    """Replay `counts[S, L, D, E]` (D = ctx devices) under each policy."""
    predictor = predictor or Predictor("ema", alpha=0.5)
    counts = np.asarray(counts, dtype=np.float64)
    S, L, D, E = counts.shape
    forecasts = predictor.predict_all(counts)  # row t: forecast for step t + 1
    uniform = np.broadcast_to(counts[0].sum(axis=(1, 2), keepdims=True) / (D * E), (L, D, E))
    # `auto` weighs a move against the steps until the next re-plan unless told otherwise.
    options = {k: dict(v) for k, v in ctx.options.items()}
    options.setdefault("auto", {}).setdefault("horizon", replan_every)
    runs: dict[str, PolicyRun] = {}
    for name in policies:
        plan: Plan | None = None
        step_s = np.zeros(S)
        ratio = np.zeros(S)
        moved = np.zeros(S)
        phase_rows: list[dict[str, float]] = []
        plan_ms: list[float] = []
        device_load = np.zeros((S, D))
        for s in range(S):
            migrations = None
            if s % replan_every == 0:
                loads = uniform if s == 0 else forecasts[s - 1]
                window = counts[max(0, s - replan_every) : s]
                step_ctx = PlanContext(
                    ctx.cluster,
                    ctx.spec,
                    ctx.cost,
                    ctx.slots_per_device,
                    history=window,
                    options=options,
                )
                t0 = time.perf_counter()
                plan = make_plan(name, np.array(loads), plan, step_ctx)
                plan_ms.append((time.perf_counter() - t0) * 1e3 / L)
                migrations = plan.transfers.migrations
                moved[s] += plan.transfers.migrate_bytes.sum()
            assert plan is not None
            cost = ctx.cost.price(plan.placement, plan.assignment, counts[s], migrations)
            step_s[s] = cost.step_s
            ratio[s] = cost.max_over_mean
            moved[s] += plan.transfers.total_step_bytes
            phase_rows.append(cost.phases.as_dict())
            device_load[s] = cost.device_load.sum(axis=0)
            if progress is not None:
                progress(1, S * len(policies))
        phases = {k: np.array([row[k] for row in phase_rows]) for k in phase_rows[0]}
        runs[name] = PolicyRun(name, step_s, ratio, moved, phases, plan_ms, device_load, plan)
    return runs
