"""The Balancer's planning half: request a plan, take the leader's decision, switch.

`PlanCycle` is mixed into `poise.runtime.balancer.Balancer`; the Balancer keeps the layers, the
step boundary and the moves, and calls into this half at its boundaries:

    boundary s, replan_due_at(s)        ->  _request(s)       the leader submits a PlanningJob
    boundary s >= _due_at               ->  _decide(stats)    the leader's outcome, on every rank
                                              _own_outcome      (the leader) its planner's result,
                                                                judged by the guard
                                              _switch           apply the plan, measure the switch

Only the leader plans (`poise.runtime.planner.broadcast`; every rank with `check_plans`, which
compares
the plans' digests and raises `PlanMismatchError` where they differ). The planning itself runs
in the background planner (`poise.runtime.planner.background`) on snapshots
(`poise.runtime.planning_job`);
the decision is the guard's (`poise.runtime.guard`, `poise.runtime.leader`).

The attributes annotated on `PlanCycle` are the Balancer state this half reads and writes; the
Balancer sets them all in its constructor. Its two abstract methods, `spec` and `apply`, are the
Balancer's own.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.core.errors import PoiseError
from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.nn.comm import comm_device
from poise.plan.persistence import carried_age
from poise.plan.predict import Predictor
from poise.runtime.guard import SwitchGuard, migration_seconds, switch_seconds
from poise.runtime.leader import leader_outcome, median_period_s, trial_judgeable
from poise.runtime.paired_clock import Probes
from poise.runtime.planner.background import BackgroundPlanner
from poise.runtime.planner.broadcast import Outcome, plans_agree, share_outcome
from poise.runtime.planning_job import PlanningJob, live_plan, run_job
from poise.runtime.probe_steps import ProbeSteps
from poise.runtime.records import FIT_WINDOW, N_MEASURED, STATIC, StepRecords
from poise.runtime.selfcal import fit as selfcal
from poise.runtime.stats import StepStats


class PlanMismatchError(PoiseError):
    """Ranks computed different plans from the same gathered loads."""


class PlanCycle(ABC):
    """Requesting, deciding and switching plans (module docstring), for the Balancer."""

    # the Balancer's state this half uses (set in `Balancer.__init__`)
    policy: str
    replan_every: int
    plan_lag: int
    lag: int
    total_steps: int | None
    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    cluster: Cluster
    fitted_cluster: Cluster
    fit: selfcal.Fit
    calibrate: bool
    predictor: Predictor
    options: dict[str, dict[str, Any]]
    slots: int
    split_tokens: bool
    check_plans: bool
    leader: bool
    guard: SwitchGuard
    probes: ProbeSteps
    holdout: bool
    retarget_replicas: bool
    switch_probe: tuple[float, float, float, int] | None
    planner: BackgroundPlanner
    records: StepRecords
    window: deque[np.ndarray]
    measured: deque[np.ndarray]
    plan: Plan
    static_plan: Plan
    steps_done: int
    switches: int
    _vote_pg: dist.ProcessGroup | None
    _plans_here: bool
    _planner_shares_cores: bool
    _due_at: int | None
    _requested_at: int | None
    recheck: bool
    replan_phase: int
    _layout: int
    _plan_since: int
    _switch_check: tuple[int, float, float] | None
    _last_candidate: tuple[int, Plan] | None
    _pattern: tuple[int, int] | None
    _replicas_timed: bool

    @abstractmethod
    def spec(self) -> ModelSpec:
        """The model shape the planner prices (`Balancer.spec`)."""

    @abstractmethod
    def apply(self, plan: Plan, stats: StepStats | None = None) -> None:
        """Make `plan` the layers' routing now (`Balancer.apply`). Collective."""

    def steps_left(self, step: int) -> int | None:
        """The steps a plan requested at boundary `step` would serve: those after its decision
        at `step + lag`, up to `total_steps` (0 when none; None where the run's length is not
        known)."""
        if self.total_steps is None:
            return None
        return max(0, self.total_steps - (step + self.lag))

    def replan_due_at(self, step: int) -> bool:
        """Whether boundary `step` is on the re-plan cadence: `step % replan_every ==
        replan_phase` (the phase is 0 until an `unsettled` refusal shifts it, `recheck`)."""
        return step % self.replan_every == self.replan_phase

    def _shift_after_unsettled(self, decided_at: int) -> None:
        """After an `unsettled` refusal at boundary `decided_at` (`recheck`): the next request
        comes `replan_every // 2` steps after the refused one, unless that boundary has passed;
        the cadence runs on from it (`replan_phase`). Once a run: only while the cadence is
        unshifted (the run's first re-plan, which has no earlier candidate to backtest, is the
        refusal this is for; later ones, on loads whose forecasts did not hold, keep the
        period, so that planning on shared cores does not double while loads move). Every rank
        takes the same outcome, so every rank shifts alike."""
        if not self.recheck or self._requested_at is None or self.replan_phase != 0:
            return
        sooner = self._requested_at + max(1, self.replan_every // 2)
        if decided_at <= sooner < self._requested_at + self.replan_every:
            self.replan_phase = sooner % self.replan_every

    def plan_next(self) -> Plan:
        """The policy's plan from the window, now, on this thread (every rank computes the same
        one; verified across ranks when `check_plans`)."""
        plan, _ = live_plan(
            self.policy, self.predictor, np.stack(self.window), self.plan, self.fitted_cluster,
            self.spec(), self.slots, self.options, self.split_tokens,
        )  # fmt: skip
        if self.check_plans and self.world_size > 1:
            self.verify_plan(plan)
        return plan

    def wall_reference(
        self, history: np.ndarray | None = None, measured: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`StepRecords.wall_reference` of this run's record."""
        return self.records.wall_reference(history, measured)

    def probe_pairs(
        self, history: np.ndarray | None = None, measured: np.ndarray | None = None
    ) -> Probes:
        """`StepRecords.probe_pairs` of this run's record."""
        return self.records.probe_pairs(history, measured)

    def _request(self, step: int) -> None:
        """Submit a planning job on snapshots of this step's window: fit the cluster to the
        steps run under the plan in force, judge whether that plan paid (`verdict.verdict`),
        forecast, plan, price against the plan in force. Only the leader plans (every rank
        with `check_plans`); every rank notes the step the decision is due."""
        self._due_at = step + self.lag
        self._requested_at = step
        measured = self.records.measured_rows()
        self._measure_switch(measured[self.records.not_probe()])
        if not self._plans_here:
            return
        history = np.stack(self.window)  # [S, L, D, E], a copy
        # the newest rows of both, measured under the plan in force, probe steps left out (a
        # restored window may hold older rows that were not measured)
        aligned = history[len(history) - len(measured) :]
        under = self.records.under_plan(measured, self._plan_since)
        fit_rows = measured[under]
        rank_experts = self.records.rank_expert_rows()[under]
        static_counts, static_rows, balanced_counts, balanced_rows = self.wall_reference(
            history, measured
        )
        backtest_plan, backtest_counts = None, None
        if self._last_candidate is not None and self._layout == STATIC:
            since, backtest_plan = self._last_candidate  # rows from `since` on ran after it
            # the window's rows by step (the newest is this step's), whether measured in this
            # process or restored from a checkpoint
            steps = np.arange(step - len(history), step)
            backtest_counts = history[steps >= since]
        job = PlanningJob(
            history=history,
            fit_counts=aligned[under],
            fit_rows=fit_rows,
            settled=fit_rows[:, 0] > self._plan_since,  # not the step that carried the switch
            static_counts=static_counts,
            static_rows=static_rows,
            balanced_counts=balanced_counts,
            balanced_rows=balanced_rows,
            current=self.plan,
            static=self.static_plan,
            prior=self.cluster,
            spec=self.spec(),
            previous=self.fit,
            policy=self.policy,
            predictor=self.predictor,
            options=self.options,
            slots=self.slots,
            calibrate=self.calibrate,
            split_tokens=self.split_tokens,
            horizon=self.guard.horizon,
            measured_switch=self._switch_scale(),
            guarded=self.guard.enabled,
            probes=self.probe_pairs(history, measured) if self.probes.every > 0 else None,
            fit_rank_experts=rank_experts,
            fit_ran=self.records.ran_rows(len(measured), under),
            steps_left=self.steps_left(step),
            backtest_plan=backtest_plan,
            backtest_counts=backtest_counts,
            holdout=self.holdout,
            retarget=self.retarget_replicas,
            # homes only while the clock refutes replicas, where it could not judge any adopted
            # now, or where the ranks share their cores
            homes_only=self.guard.trust <= 0
            or (self.guard.enabled and self._replicas_barred(self.steps_left(step))),
            held_before=carried_age(self._pattern, step, len(history)),
        )
        self.planner.submit(partial(run_job, job), requested_at=step, adopt_at=step + self.lag)

    def _switch_scale(self) -> float | None:
        """The measured / modelled seconds of a switch's migration: the guard's `k_switch` once
        this run measured a switch, the start-up switch probe's before (`probe_switch_scale`),
        None without either."""
        if self.guard.switches:
            return self.guard.k_switch
        return self.switch_probe[0] if self.switch_probe is not None else None

    def _measure_switch(self, measured: np.ndarray) -> None:
        """Record the last switch's measured seconds against its modelled ones once its step and
        a settled step after it were measured (`guard.switch_seconds`; every rank alike)."""
        if self._switch_check is None:
            return
        step, modelled, wait = self._switch_check
        seconds = switch_seconds(measured, step, wait)
        if seconds is not None:
            self.guard.record_switch(seconds, modelled, migration_seconds(measured, step))
            self._switch_check = None

    def _decide(self, stats: StepStats) -> bool:
        """Take the leader's decision (`poise.runtime.planner.broadcast`): the leader takes its
        planner's
        result and decides (guard), every rank receives the outcome and acts on it; with
        `check_plans` every rank's own plan is compared with the leader's. Returns whether a
        plan took effect."""
        self._due_at = None
        t0 = time.perf_counter()
        mine = self._own_outcome(stats) if self._plans_here else None
        outcome = share_outcome(mine if self.leader else None, self._vote_pg, leader=self.leader)
        if mine is None:  # waited in the broadcast for the leader's planner
            stats.add_seconds("plan_wait", time.perf_counter() - t0)
        if self.check_plans and not plans_agree(
            mine.plan if mine is not None else None, outcome.plan, self._vote_pg
        ):
            self._mismatch()
        self.fitted_cluster, self.fit = outcome.cluster, outcome.fit
        if self.plan_lag > 0 and outcome.next_lag > 0:
            self.lag = outcome.next_lag
        stats.replanned = True
        stats.fit = outcome.fit.as_dict()
        stats.gain_s, stats.switch_cost_s = outcome.gain_s, outcome.switch_s
        stats.doubt_s = outcome.doubt_s
        stats.predicted_step_s = outcome.predicted_step_s
        stats.decision = outcome.decision
        stats.verdict = outcome.verdict.as_dict() if outcome.verdict is not None else {}
        self.note_verdict(outcome.verdict)
        if outcome.decision == "fallback":
            self.guard.fell_back(outcome.verdict)
            self._switch(outcome.plan, stats, outcome.modelled_switch_s, outcome.wait_s)
            self.guard.returned(to_static=self._layout == STATIC)
            return True
        if not outcome.adopts:
            if outcome.decision == "idle":
                self.guard.planning_idle()
            elif outcome.decision == "unsettled":
                self._shift_after_unsettled(self.steps_done)
            return False
        if outcome.decision != "replace":  # a replacement has yet to prove itself
            self.guard.kept()
        self.guard.promised(outcome.step_gain_s, from_static=self._layout == STATIC)
        self._switch(outcome.plan, stats, outcome.modelled_switch_s, outcome.wait_s)
        return True

    def _own_outcome(self, stats: StepStats) -> Outcome:
        """This rank's planner result and what the guard decides on it (`leader_outcome`; the
        leader's is the one every rank takes)."""
        done = self.planner.take()
        self._last_candidate = (done.requested_at, done.value.next_backtest())
        age = done.value.plan.notes.get("pattern_age")  # `auto`'s (`persistence.carried_age`)
        self._pattern = None if age is None else (done.requested_at, int(age))
        stats.add_seconds("plan", done.plan_s)
        stats.add_seconds("plan_wait", done.wait_s)
        planning_s = done.cpu_s if self._planner_shares_cores else 0.0
        stats.add_seconds("plan_cpu", planning_s)
        recent = list(self.measured)[-FIT_WINDOW:]
        measured = np.stack(recent) if recent else np.zeros((0, 1 + N_MEASURED))
        left = None if self.total_steps is None else self.total_steps - self.steps_done
        return leader_outcome(
            self.guard,
            done.value,
            wait_s=done.wait_s,
            plan_s=done.plan_s,
            planning_s=planning_s,
            on_static=self.plan.digest() == self.static_plan.digest(),
            period_s=median_period_s(measured),
            plan_lag=self.plan_lag,
            blind_replicas=self._replicas_barred(left),
        )

    def _replicas_barred(self, steps_left: int | None) -> bool:
        """Whether the guard takes no plan with replicas now: the ranks share their cores
        (`cores_shared`) or one adopted with `steps_left` steps to go would run blind
        (`_blind_replicas`). The request then asks `auto` for homes only, and the leader
        refuses another policy's replicas (`leader`, rule 4)."""
        return self.cores_shared() or self._blind_replicas(steps_left)

    def _blind_replicas(self, steps_left: int | None) -> bool:
        """Whether a plan with replicas adopted with `steps_left` steps to go would run blind:
        the paired clock has timed no plan with replicas in this run and could not judge one
        adopted now before the run ends (`leader`, rule 4; `trial_judgeable`)."""
        every, replan = self.probes.every, self.replan_every
        return not self._replicas_timed and not trial_judgeable(steps_left, every, replan)

    def cores_shared(self) -> bool:
        """Whether this run's ranks share their cores (the prior cluster's
        `HostCosts.shared_cores`: CPU ranks that want more cores than the host gives them,
        `plan_inputs.shared_cores`). There the guard plans homes only: a replica's Trans and
        Agg are gloo's copies on the cores the experts compute on, which no overlap hides and
        the model does not price. On `train_speedup.py`'s `skewed-4` (4 ranks on 2 cores)
        each trial of replicas ran 12-30 ms a step slower than static for a modelled 2-4 ms of
        transfers, the same candidates' layouts ran 0-5 ms slower while shedding 1,000 pairs
        from the slowest ranks, and balance with every transfer free (`--peers free`) read
        0.99 of static; on a 16-core host the same setting's replicas paid (1.01-1.04)
        (docs/benchmarks.md, "Homes only where the ranks share cores"). A policy other than
        `auto` still plans its replicas there, and the leader refuses them as it refuses blind
        ones (`leader`, rule 4: `unjudged`)."""
        return self.cluster.host.shared_cores > 0

    def _switch(self, plan: Plan, stats: StepStats, modelled_s: float, wait_s: float) -> None:
        """Apply `plan` now and start measuring it."""
        self.apply(plan, stats)
        stats.switched = True
        self.switches += 1
        self._plan_since = self.steps_done
        self._switch_check = (self.steps_done, modelled_s, wait_s)

    def verify_plan(self, plan: Plan) -> None:
        """Raise `PlanMismatchError` on every rank unless all ranks hold the same plan (one
        all-reduce of `Plan.digest`). Collective."""
        if self.world_size == 1:
            return
        h = plan.digest()
        t = torch.tensor([h, -h], dtype=torch.long, device=comm_device(self.group, "cpu"))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if int(t[0]) != -int(t[1]):
            self._mismatch()

    def _mismatch(self) -> None:
        raise PlanMismatchError(
            f"ranks computed different plans at step {self.steps_done} (policy "
            f"{self.policy!r}): the planner saw different inputs or is not deterministic on "
            "these machines",
            source=f"rank {self.rank}",
            field="plan",
        )


__all__ = ["PlanCycle", "PlanMismatchError"]
