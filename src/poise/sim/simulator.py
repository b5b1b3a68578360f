"""The simulator: replay a routing trace step by step on a modelled cluster under every policy.

`simulate(trace, cluster, spec, policies, schedule, replan_every, predictor)`:

- every `replan_every` steps each policy plans from the predictor's forecast made from the steps
  before (step 0 has no history: policies see uniform loads), with its own plan in force as
  `previous` and the recent per-expert totals as `ctx.history`;
- each step is priced on its *actual* loads, so stale plans cost what they cost; the step where
  a new plan takes effect pays its migration;
- planning wall time is measured per call and charged to the step it is made in, unless the
  schedule hides it (`Schedule.planning_s`: Pro-Prophet plans under the all-to-all);
- `background_planning=True` models a planner beside training, as the runtime's `Balancer`
  plans in a worker process: the plan made at step s, from the same forecast, runs during
  steps s, s + 1, ... and takes effect at the first step boundary after it is ready (step s + 1
  at the earliest; step 0 runs the static placement, which the first plan moves from and pays
  for, where inline the first plan is the layout training starts with), so nothing is
  charged; a re-plan due while the previous plan is still being made is skipped (the planner
  makes one plan at a time and training does not wait for it: a planner slower than
  `replan_every` steps stretches the interval, as the runtime's does,
  `poise.runtime.planner.background`);
- a trace recorded on fewer ranks than the cluster has devices is scaled by resampling its
  source rows (`sim.scaling`), one step at a time, so memory stays O(L * D * E) per step;
- a cluster with measured host costs (`Cluster.host`, from `poise calibrate`) is priced by the
  cost model with them (`CostModel.complete`: the non-MoE compute at its measured rate and the
  token dispatcher's host work per layer on each step's actual rows, H_fwd + H_bwd of
  `poise.cost.host`), as the planners see it;
- every step, under every policy (static included), also pays its work outside the layers:
  the all-reduce of the gradients of the model's replicated (dense) parameters across the
  devices, the routing counts' gather, clipping and the optimizer
  (`poise.cost.step_overheads`). By default the dense parameters are the model's
  (`ModelSpec.dense_params`), as `poise simulate` charges them; `dense_params=N` sets the
  count, and `dense_params=0` (or None) times the MoE layers alone, nothing outside them
  (FasterMoE's MoE-only timing, `poise simulate --dense-params 0`). With the MoE layers
  alone, a cluster without host costs prices exactly as the cost model does.

Result (`SimResult`): per policy (`PolicyRun`) and step, the step time, the per-layer phase
breakdown `[S, L]` (with the host terms in `host_phases`), the per-step work outside the layers
`[S]`, device max/mean, bytes moved and the device loads `[S, D]`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal, TypeAlias

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.cost.model import CostModel, PlanPricer
from poise.cost.phases import PhaseTimes
from poise.cost.schedule import Schedule, parse_schedule
from poise.cost.step_overheads import OVERHEADS, StepWork, step_overheads
from poise.cost.traffic import padded_counts
from poise.plan.persistence import carried_age, pattern_age
from poise.plan.policies.auto import with_steps_left
from poise.plan.policies.base import HELPER_CPU_NOTE, PlanContext, PlanMemo
from poise.plan.policies.registry import get_policy, make_plan, make_plan_reusing
from poise.plan.predict import OnlineForecast, Predictor, parse_predictor
from poise.plan.retarget import retargeted
from poise.sim.scaling import ScaledTrace
from poise.trace.trace import Trace

HOST_PHASES = ("dispatch_host_fwd_s", "dispatch_host_bwd_s")  # per layer, `poise.cost.host`
PHASES = [f.name for f in fields(PhaseTimes) if f.name not in HOST_PHASES]
HISTORY_STEPS = 100  # per-expert totals kept for policies that look back (SmartMoE's window)
SPEC_DENSE: Final = "spec"  # `simulate(dense_params=...)`'s default: the model's own count
DenseParams: TypeAlias = int | Literal["spec"] | None


@dataclass
class PolicyRun:
    """What one policy did over a replay. Arrays are per step `[S]` unless noted.

    `step_s` includes the planning time charged (`plan_s`); `layer_s[S, L]` and
    `phases[name][S, L]` are the cost model's per-layer times (without planning);
    `plan_wall_s[S]` the measured planner time at re-planning steps (0 elsewhere; the CPU time
    of the planner's thread plus its helper threads', so policies replayed at once do not
    inflate each other's);
    `plan_charge_s[S]` what planning costs the step under the replay's planning model, whether
    or not it was charged (`plan_s` is it when charged, else zeros);
    `host_phases[name][S, L]` the dispatcher's host seconds per layer (`HOST_PHASES`, zeros
    without host costs), included in `layer_s`; `outside_s[name][S]` the step's work outside
    the layers (`poise.cost.step_overheads.OVERHEADS`, zeros when the MoE layers are timed
    alone), included in `step_s`."""

    policy: str
    step_s: np.ndarray
    layer_s: np.ndarray
    phases: dict[str, np.ndarray]
    plan_s: np.ndarray
    plan_wall_s: np.ndarray
    plan_charge_s: np.ndarray
    max_over_mean: np.ndarray
    bytes_moved: np.ndarray
    device_load: np.ndarray  # [S, D] tokens per device summed over layers
    plan_ms: list[float] = field(default_factory=list)  # per re-plan: ms per layer
    # per plan put in force: the steps from its request to the step it took effect at (0
    # inline; 1 at the earliest beside training)
    plan_delays: list[int] = field(default_factory=list)
    # beside training: the re-planning steps skipped because the last plan was still being made
    skipped_replans: list[int] = field(default_factory=list)
    last_plan: Plan | None = None
    host_phases: dict[str, np.ndarray] = field(default_factory=dict)
    outside_s: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def mean_step_s(self) -> float:
        return float(self.step_s.mean())

    @property
    def plan_ms_per_layer(self) -> float:
        return float(np.mean(self.plan_ms)) if self.plan_ms else 0.0

    @property
    def mean_plan_delay(self) -> float:
        """Mean steps from a plan's request to the step it took effect at (0 with none)."""
        return float(np.mean(self.plan_delays)) if self.plan_delays else 0.0

    def phase_totals(self) -> dict[str, float]:
        """Mean seconds of work per step in each phase (summed over layers), as a step performs
        it: dispatch and combine run once forward and once backward, so each counts twice;
        plus `planning_s` charged, the dispatcher's host work and the work outside the layers
        (zero where not modelled). Under overlapping schedules the step takes less than the sum
        (`step_s`)."""
        out = {k: float(v.sum(axis=1).mean()) for k, v in self.phases.items()}
        out["dispatch_s"] *= 2.0
        out["combine_s"] *= 2.0
        out.update({k: float(v.sum(axis=1).mean()) for k, v in self.host_phases.items()})
        out.update({k: float(v.mean()) for k, v in self.outside_s.items()})
        out["planning_s"] = float(self.plan_s.mean())
        return out


@dataclass
class SimResult:
    """A whole simulation: the runs per policy and what was simulated."""

    runs: dict[str, PolicyRun]
    cluster: Cluster
    spec: ModelSpec
    schedule: Schedule
    predictor: Predictor
    replan_every: int
    steps: int
    scaling: str
    trace_name: str = ""

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per policy, fastest first: the figures every output shows."""
        static = self.runs["static"].mean_step_s if "static" in self.runs else None
        rows = []
        for name, r in sorted(self.runs.items(), key=lambda kv: kv[1].mean_step_s):
            rows.append(
                {
                    "policy": name,
                    "mean_step_s": r.mean_step_s,
                    "speedup_vs_static": (static / r.mean_step_s) if static else None,
                    "max_over_mean": float(r.max_over_mean.mean()),
                    "bytes_moved_per_step": float(r.bytes_moved.mean()),
                    "planning_s_per_step": float(r.plan_s.mean()),
                    "plan_ms_per_layer": r.plan_ms_per_layer,
                    "plan_delay_steps": r.mean_plan_delay,
                }
            )
        return rows


def _as_counts(trace: Trace | np.ndarray) -> tuple[np.ndarray, str]:
    if isinstance(trace, Trace):
        return trace.counts, trace.name
    counts = np.asarray(trace)
    if counts.ndim != 4:
        raise ConfigError(
            f"trace counts must be [steps, layers, devices, experts], got {counts.shape}",
            source="trace",
            field="counts",
        )
    return counts, "array"


def _check(counts: np.ndarray, cluster: Cluster, spec: ModelSpec, source: str) -> None:
    S, L, _, E = counts.shape
    if spec.experts != E:
        raise ConfigError(
            f"trace has {E} experts but model {spec.name} has {spec.experts}",
            source=source,
            field="experts",
        )
    if spec.moe_layers != L:
        raise ConfigError(
            f"trace has {L} MoE layers but model {spec.name} has {spec.moe_layers}",
            source=source,
            field="layers",
        )
    if S < 1:
        raise ConfigError("trace has no steps", source=source, field="steps")


def simulate(
    trace: Trace | np.ndarray,
    cluster: Cluster,
    spec: ModelSpec,
    policies: Sequence[str],
    schedule: Schedule | str = "sync",
    replan_every: int = 10,
    predictor: Predictor | str = "ema",
    *,
    slots_per_device: int | None = None,
    policy_slots: Mapping[str, int] | None = None,
    fixed_plans: Sequence[str] = (),
    steps: int | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    seed: int = 0,
    count_planning: bool = True,
    background_planning: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    dense_params: DenseParams = SPEC_DENSE,
    split_tokens: bool = False,
    retarget: bool = False,
) -> SimResult:
    """Replay `trace` (`Trace` or counts `[S, L, D0, E]`) on `cluster` under each policy.

    `slots_per_device` defaults to ceil(E / D) + 1 (one spare slot per device);
    `policy_slots[name]` gives policy `name` its own slots per device instead (a system whose
    design bounds its copies otherwise: `poise.plan.memory_slots`); `steps` cuts
    the trace; `options` are per-policy settings (`auto`'s horizon is at least `replan_every`:
    `auto.base_horizon`, and at most the steps the replay has left: `auto.steps_left`, as the
    live Balancer caps it at the run's end);
    `progress(done, total)` is called after each priced step of each policy;
    `background_planning`: see the module docstring; `workers`: policies replayed at once in
    threads (default: one per CPU; results do not depend on it). Planner time is the CPU time
    of the planner's thread, so other work on the machine does not inflate it.
    `dense_params`: the replicated (non-expert) parameters whose gradients every step
    all-reduces across the devices, with the rest of the work outside the layers
    (`poise.cost.step_overheads`): `"spec"` (the default, `SPEC_DENSE`) the model's own
    (`ModelSpec.dense_params`), an int that count, 0 or None the MoE layers alone (nothing
    outside them priced; so does a model whose count is 0).
    `split_tokens`: every plan splits each step's tokens of its replicated experts by that
    step's counts, as the live runtime does by default (`PlanContext.split_tokens`,
    `Assignment.by_counts`); off by default, so the papers' systems run their own fixed splits.
    `retarget`: each step that a plan with replicas runs, but the step it takes effect, runs it
    with its replicas re-chosen from the step before's actual counts
    (`poise.plan.retarget.retargeted`), as the live runtime does by default
    (`Balancer(retarget=)`); off by default, as `split_tokens`."""
    counts, source = _as_counts(trace)
    _check(counts, cluster, spec, source)
    if replan_every < 1:
        raise ConfigError("must be >= 1", source=str(replan_every), field="replan_every")
    names = list(dict.fromkeys(policies))
    if not names:
        raise ConfigError("no policy given", source="policies", field="policies")
    for name in names:
        get_policy(name)  # unknown names fail before any work
    if steps is not None:
        if steps < 1:
            raise ConfigError("must be >= 1", source=str(steps), field="steps")
        counts = counts[:steps]
    schedule = parse_schedule(schedule) if isinstance(schedule, str) else schedule
    predictor = parse_predictor(predictor) if isinstance(predictor, str) else predictor
    D, E = cluster.num_devices, spec.experts
    scaled = ScaledTrace.create(counts, D, seed)
    cost = CostModel(cluster, spec, schedule)
    slots = slots_per_device if slots_per_device is not None else -(-E // D) + 1
    base_ctx = PlanContext.create(
        cluster, spec, slots_per_device=slots, cost=cost, split_tokens=split_tokens
    )
    dense = resolve_dense_params(dense_params, spec)
    host = OutsideTerms.create(cluster, spec, base_ctx.slots_per_device, dense)
    opts = {k: dict(v) for k, v in (options or {}).items()}
    opts.setdefault("auto", {}).setdefault("base_horizon", replan_every)
    S, L = scaled.steps, spec.moe_layers
    start: Plan | None = None
    if background_planning:
        ctx0 = PlanContext(
            cluster, spec, cost, base_ctx.slots_per_device, options=opts, split_tokens=split_tokens
        )
        start = make_plan("static", np.zeros((L, D, E)), None, ctx0)
    own_slots = dict(policy_slots or {})
    for name in [*own_slots, *fixed_plans]:
        if name not in names:
            raise ConfigError(
                "names no policy of this run", source=name, field="policy_slots / fixed_plans"
            )
    for n in own_slots.values():
        PlanContext.create(cluster, spec, slots_per_device=n)  # too few slots fail here
    replays = [
        _PolicyReplay(
            name,
            _empty_run(name, S, L, D),
            cost,
            count_planning,
            start,
            host,
            retarget,
            slots=own_slots.get(name),
            fixed=name in fixed_plans,
        )
        for name in names
    ]
    forecast = OnlineForecast(predictor)
    history: list[np.ndarray] = []  # [L, E] per observed step
    pattern: tuple[int, int] | None = None  # (newest step seen, its pattern's age), as live
    done, total = 0, S * len(names)
    threads = min(workers if workers is not None else (os.cpu_count() or 1), len(names))
    with ThreadPoolExecutor(threads) if threads > 1 else nullcontext() as pool:
        for s in range(S):
            actual = scaled.step(s)  # [L, D, E]
            if schedule.pads:  # DeepSpeed's dispatcher: what it moves is what planners see
                actual = padded_counts(actual)
            loads, ctx = None, None
            if s % replan_every == 0:
                if forecast.seen:
                    loads = forecast.forecast()
                else:
                    # Step 0: nothing observed yet; each layer's tokens spread evenly.
                    per_cell = actual.sum(axis=(1, 2), keepdims=True) / (D * E)
                    loads = np.broadcast_to(per_cell, actual.shape).copy()
                # the steps the plan can serve: from this step, or the next one when it is
                # made beside training (`auto`'s horizon stops at the trace's end)
                left = S - s - (1 if background_planning else 0)
                step_opts = with_steps_left(opts, left)
                # the steps the pattern held before the window, carried as the live planner
                # carries them (`poise.plan.persistence`)
                held = carried_age(pattern, s - 1, len(history))
                step_opts["auto"]["held_before"] = held
                seen = np.array(history) if history else None
                ctx = PlanContext(
                    cluster,
                    spec,
                    cost,
                    base_ctx.slots_per_device,
                    history=seen,
                    options=step_opts,
                    split_tokens=split_tokens,
                    memo=PlanMemo(loads),  # the policies plan on one forecast: share plans
                )
                if seen is not None and "auto" in names:
                    recent = int(step_opts["auto"]["base_horizon"])
                    pattern = (s - 1, pattern_age(seen, loads.sum(axis=1), recent, held))
            step = _Step(s, actual, loads, ctx)
            # Policies share nothing they write: several replay at once (NumPy frees the GIL),
            # or one thread replays them in turn.
            each = map if pool is None else pool.map
            for _ in each(lambda r, step=step: r.advance(step), replays):
                done += 1
                if progress is not None:
                    progress(done, total)
            forecast.update(actual)
            history = [*history[-(HISTORY_STEPS - 1) :], actual.sum(axis=1)]
    runs = {r.run.policy: r.run for r in replays}
    for r in replays:
        r.run.last_plan = r.plan
    return SimResult(
        runs=runs,
        cluster=cluster,
        spec=spec,
        schedule=schedule,
        predictor=predictor,
        replan_every=replan_every,
        steps=S,
        scaling=scaled.describe(),
        trace_name=source,
    )


def resolve_dense_params(dense_params: DenseParams, spec: ModelSpec) -> int | None:
    """The dense parameters a replay charges (`simulate`'s `dense_params`): `"spec"` is
    `spec.dense_params`; None when the MoE layers are timed alone (a count of 0, or None)."""
    if isinstance(dense_params, str):
        if dense_params != SPEC_DENSE:
            raise ConfigError(
                f"must be an int >= 0, None or {SPEC_DENSE!r}",
                source=dense_params,
                field="dense_params",
            )
        dense_params = spec.dense_params
    if dense_params is None:
        return None
    if dense_params < 0:
        raise ConfigError("must be >= 0", source=str(dense_params), field="dense_params")
    return int(dense_params) or None


@dataclass(frozen=True)
class OutsideTerms:
    """The per-step work outside the layers the simulator adds to the cost model's price of a
    step (module docstring): seconds by `OVERHEADS` name. `create` returns None when the MoE
    layers are timed alone (`dense_params` None), so such replays price bit for bit as the cost
    model does (whose price includes the cluster's measured host costs inside the layers,
    `CostModel.complete`)."""

    outside: dict[str, float]

    @classmethod
    def create(
        cls, cluster: Cluster, spec: ModelSpec, slots_per_device: int, dense_params: int | None
    ) -> OutsideTerms | None:
        if dense_params is None:
            return None
        work = StepWork.of(spec, dense_params, slots_per_device)
        return cls(step_overheads(cluster, work))


@dataclass
class _Step:
    """One step of a replay: its index, actual loads `[L, D, E]`, and at re-planning steps the
    forecast `[L, D, E]` and the planning context (None elsewhere)."""

    index: int
    actual: np.ndarray
    loads: np.ndarray | None
    ctx: PlanContext | None


class _PolicyReplay:
    """One policy's replay: the plan it last made, the plan in force (with its pricer), a plan
    made in the background waiting for the next step, and the `PolicyRun` being filled."""

    def __init__(
        self,
        name: str,
        run: PolicyRun,
        cost: CostModel,
        count_planning: bool,
        start: Plan | None,
        host: OutsideTerms | None = None,
        retarget: bool = False,
        slots: int | None = None,
        fixed: bool = False,
    ) -> None:
        self.name, self.run, self.cost, self.count_planning = name, run, cost, count_planning
        self.host = host
        self.slots = slots  # this policy's own slots per device (None: the replay's)
        self.fixed = fixed  # plans once, at step 0, and keeps that plan
        self.planned = False
        self.retarget = retarget
        self.last_actual: np.ndarray | None = None  # the step before's loads `[L, D, E]`
        self.background = start is not None
        self.plan: Plan | None = None  # the last plan made (`previous` of the next)
        self.pending: Plan | None = None  # made in the background, not yet in force
        self.pending_since = 0  # the step it was requested at
        self.pending_left_s = 0.0  # its planning seconds still to run
        self.active: tuple[PlanPricer, Plan] | None = None
        if start is not None:  # background planning: step 0 runs the static placement
            self.active = (cost.pricer(start.placement, start.assignment), start)
            # and the first plan is made with it in force: its moves from the static homes
            # are paid, as the live Balancer, which starts from them, pays them
            self.plan = start

    def _activate(self, plan: Plan, s: int, requested: int) -> np.ndarray:
        """Put `plan`, requested at step `requested`, in force at step `s`; its migrations,
        paid at `s`."""
        self.active = (self.cost.pricer(plan.placement, plan.assignment), plan)
        self.run.plan_delays.append(s - requested)
        self.run.bytes_moved[s] += plan.transfers.migrate_bytes.sum()
        return plan.transfers.migrations

    def advance(self, step: _Step) -> None:
        """Plan (at re-planning steps) and price one step."""
        run, s = self.run, step.index
        migrations = None
        if self.pending is not None and self.pending_left_s <= 0.0:  # ready: in force now
            migrations = self._activate(self.pending, s, self.pending_since)
            self.pending = None
        wall, replans = 0.0, False
        # beside training, a re-plan due while the last plan is still being made is skipped
        # a re-plan is due at re-planning steps, but never again for a plan fixed at step 0
        due = step.loads is not None and step.ctx is not None
        due = due and not (self.fixed and self.planned)
        if due and self.pending is None:
            assert step.loads is not None and step.ctx is not None
            replans, self.planned = True, True
            ctx = step.ctx
            if self.slots is not None:
                ctx = dataclasses.replace(ctx, slots_per_device=self.slots)
            t0 = time.thread_time()
            plan, reused_cpu_s = make_plan_reusing(self.name, step.loads, self.plan, ctx)
            wall = time.thread_time() - t0 + float(plan.notes.get(HELPER_CPU_NOTE, 0.0))
            wall += reused_cpu_s  # a plan another replay made on this forecast took it that long
            self.plan = plan
            run.plan_wall_s[s] = wall
            run.plan_ms.append(wall * 1e3 / step.loads.shape[0])
            if self.background:
                self.pending, self.pending_left_s, self.pending_since = plan, wall, s
            else:
                migrations = self._activate(plan, s, s)
        elif due:
            run.skipped_replans.append(s)
        assert self.active is not None
        pricer, in_force = self.active
        if self.retarget and migrations is None and self.last_actual is not None:
            routed = retargeted(in_force, self.last_actual, self.cost.spec)
            if routed is not in_force:  # its replicas re-chosen: price what runs
                pricer = self.cost.pricer(routed.placement, routed.assignment)
                in_force = routed
        self.last_actual = step.actual
        priced = pricer.price(step.actual, migrations)
        layer_s, step_s = priced.layer_s, priced.step_s
        for k in PHASES:
            run.phases[k][s] = getattr(priced.phases, k)
        for k in HOST_PHASES:
            run.host_phases[k][s] = getattr(priced.phases, k)
        if self.host is not None:
            for k, v in self.host.outside.items():
                run.outside_s[k][s] = v
            step_s = float(layer_s.sum()) + sum(self.host.outside.values())
        run.layer_s[s] = layer_s
        if self.pending is not None:  # the background plan runs during this step
            self.pending_left_s -= step_s
        if replans:
            if not self.background:  # beside training, planning delays no step
                a2a = 2.0 * float((priced.phases.dispatch_s + priced.phases.combine_s).sum())
                run.plan_charge_s[s] = self.cost.schedule.planning_s(wall, a2a)
            if self.count_planning:
                run.plan_s[s] = run.plan_charge_s[s]
        run.step_s[s] = step_s + run.plan_s[s]
        run.max_over_mean[s] = priced.max_over_mean
        run.bytes_moved[s] += in_force.transfers.total_step_bytes
        run.device_load[s] = priced.device_load.sum(axis=0)


def _empty_run(name: str, S: int, L: int, D: int) -> PolicyRun:
    return PolicyRun(
        policy=name,
        step_s=np.zeros(S),
        layer_s=np.zeros((S, L)),
        phases={k: np.zeros((S, L)) for k in PHASES},
        plan_s=np.zeros(S),
        plan_wall_s=np.zeros(S),
        plan_charge_s=np.zeros(S),
        max_over_mean=np.zeros(S),
        bytes_moved=np.zeros(S),
        device_load=np.zeros((S, D)),
        host_phases={k: np.zeros((S, L)) for k in HOST_PHASES},
        outside_s={k: np.zeros(S) for k in OVERHEADS},
    )


def replay(
    counts: np.ndarray,
    ctx: PlanContext,
    policies: Sequence[str],
    *,
    replan_every: int = 10,
    predictor: Predictor | None = None,
    progress: Callable[[int, int], None] | None = None,
    count_planning: bool = False,
    dense_params: DenseParams = None,
) -> dict[str, PolicyRun]:
    """`simulate` with a ready `PlanContext` (its cluster, model, cost model's schedule, slots
    and options), counts `[S, L, D, E]` with D the cluster's devices. It compares placements
    (the demo's trace replays): planning time is not charged and the MoE layers are timed alone
    by default (`dense_params=None`; pass `SPEC_DENSE` or a count for whole steps, as
    `simulate` prices them by default). Per-step splitting follows `ctx.split_tokens`."""
    result = simulate(
        np.asarray(counts),
        ctx.cluster,
        ctx.spec,
        policies,
        ctx.cost.schedule,
        replan_every,
        predictor or Predictor("ema", alpha=0.5),
        slots_per_device=ctx.slots_per_device,
        options={k: dict(v) for k, v in ctx.options.items()},
        count_planning=count_planning,
        progress=progress,
        dense_params=dense_params,
        split_tokens=ctx.split_tokens,
    )
    return result.runs
