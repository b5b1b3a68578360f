"""The Balancer's planning half: request a planning job, take the leader's decision, learn.

    boundary s, s % replan_every == 0   ->  request(s, ...)    the leader submits a PlanningJob
    boundary s >= due_at                ->  decide(stats, ...)  the leader's controller decides,
                                                                 every rank takes its Outcome

Only the leader plans (every rank with `check_plans`). The job runs in the background planner
on snapshots of the records and is decided `lag` steps after its request, as many as the last
job took (`adoption_lag`). A re-plan due while a job is in flight, or backed off, is skipped.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any

import numpy as np
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError, PoiseError
from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.plan.persistence import carried_age
from poise.plan.predict import Predictor
from poise.runtime.config import BalancerConfig
from poise.runtime.control.controller import Controller
from poise.runtime.control.evidence import Evidence
from poise.runtime.control.job import PlanningJob, run_job
from poise.runtime.control.pricing import SwitchPrice, migration_seconds, switch_seconds
from poise.runtime.planner.background import BackgroundPlanner, adoption_lag
from poise.runtime.planner.broadcast import Outcome, plans_agree, share_outcome
from poise.runtime.records import FIT_WINDOW, StepRecords
from poise.runtime.selfcal.fit import PERIOD, Fit, cluster_of
from poise.runtime.stats import StepStats


class PlanMismatchError(PoiseError):
    """Ranks computed different plans from the same gathered loads."""


class Planning:
    """Requests, decisions and what they learned (module docstring), for one Balancer."""

    def __init__(
        self,
        config: BalancerConfig,
        policy: str,
        replan_every: int,
        cluster: Cluster,
        *,
        slots: int,
        options: dict[str, dict[str, Any]],
        predictor: Predictor,
        vote_group: dist.ProcessGroup | None,
        leader: bool,
        retarget: bool,
        shared_cores: bool,
        on_cpu: bool,
        fit: Fit,
        switch_prior: float,
    ) -> None:
        self.config, self.policy, self.replan_every = config, policy, replan_every
        self.cluster, self.fitted_cluster, self.fit = cluster, cluster, fit
        self.slots, self.options, self.predictor = slots, options, predictor
        self.vote_group, self.leader = vote_group, leader
        self.plans_here = leader or config.check_plans
        self.retarget, self.on_cpu = retarget, on_cpu
        # replicas cannot pay where a rank's Trans and Agg copy on the cores others compute on
        self.controller = Controller(config.margin, config.guard, 0.0 if shared_cores else 1.0)
        self.switch_price = SwitchPrice(switch_prior)
        self.planner = BackgroundPlanner(config.plan_process, preload=(run_job.__module__,))
        self.lag = config.plan_lag  # steps from a request to its decision
        self.due_at: int | None = None  # the boundary of the next decision
        self.last_forecast: tuple[int, Plan] | None = None  # (requested at, plan): backtests
        self.pattern: tuple[int, int] | None = None  # (requested at, `auto`'s pattern age)
        self._switch_check: tuple[int, float, float] | None = None  # (step, modelled s, wait s)
        self._modelled_switch_s, self._wait_s = 0.0, 0.0

    def steps_left(self, step: int) -> int | None:
        """The steps a plan requested at boundary `step` would serve (None: not known)."""
        total = self.config.total_steps
        return None if total is None else max(0, total - (step + self.lag))

    def due(self, step: int) -> bool:
        """Whether a decision is due at boundary `step`."""
        return self.due_at is not None and step >= self.due_at

    def may_request(self, step: int) -> bool:
        """Whether boundary `step` requests a plan: on the cadence, none in flight, one that would
        serve a step, and not backed off (consumed here, alike on every rank)."""
        if step % self.replan_every or self.due_at is not None or self.steps_left(step) == 0:
            return False
        return not self.controller.skip_replan()

    def request(
        self, step: int, records: StepRecords, plan: Plan, static: Plan, plan_since: int,
        spec: ModelSpec, probing: bool,
    ) -> None:  # fmt: skip
        """Submit a planning job on snapshots of `records` (the leader, and every rank with
        `check_plans`); every rank notes the boundary of its decision."""
        self.due_at = step + self.lag
        measured = records.measured_rows()
        if self._switch_check is not None:  # the last switch, once a step after it was measured
            at, modelled, wait = self._switch_check
            seconds = switch_seconds(measured[records.not_probe()], at, wait)
            if seconds is not None:
                self.switch_price.record(seconds, modelled, migration_seconds(measured, at))
                self._switch_check = None
        if not self.plans_here:
            return
        history = np.stack(records.window)  # [S, L, D, E], a copy
        aligned = history[len(history) - len(measured) :]
        under = records.under_plan(measured, plan_since)
        fit_rows = measured[under]
        last = None
        if self.last_forecast is not None:
            since, forecast = self.last_forecast  # the window's rows from `since` on ran after it
            last = (forecast, len(history) - (step - since))
        job = PlanningJob(
            history=history, fit_counts=aligned[under], fit_rows=fit_rows,
            settled=fit_rows[:, 0] > plan_since, current=plan, static=static,
            prior=self.cluster, spec=spec, previous=self.fit, policy=self.policy,
            predictor=self.predictor, options=self.options, slots=self.slots,
            horizon=self.config.horizon or self.replan_every, calibrate=self.config.calibrate,
            split_tokens=self.config.split_tokens, switch_scale=self.switch_price.k_switch,
            guarded=self.config.guard, retarget=self.retarget,
            replicas=self.controller.ratio["replicas"] > 0,
            probes=records.probe_pairs(history, measured) if probing else None,
            fit_rank_experts=records.rank_expert_rows()[under],
            fit_ran=records.ran_rows(len(measured), under), steps_left=self.steps_left(step),
            held_before=carried_age(self.pattern, step, len(history)), last=last,
        )  # fmt: skip
        self.planner.submit(partial(run_job, job), requested_at=step, adopt_at=step + self.lag)

    def decide(
        self, stats: StepStats, records: StepRecords, plan: Plan, static: Plan, step: int,
        rank: int,
    ) -> tuple[Plan | None, Evidence | None]:  # fmt: skip
        """Take the leader's decision on every rank (collective over the vote group): the plan to
        apply now (None: keep the plan in force) and the evidence it weighed; `stats` records
        the decision, its reason and its figures."""
        self.due_at = None
        t0 = time.perf_counter()
        mine = self._own_outcome(stats, records, plan, static) if self.plans_here else None
        outcome = share_outcome(mine if self.leader else None, self.vote_group, leader=self.leader)
        if mine is None:  # waited in the broadcast for the leader's planner
            stats.add_seconds("plan_wait", time.perf_counter() - t0)
        if self.config.check_plans and not plans_agree(
            None if mine is None else mine.forecast_digest, outcome.forecast_digest,
            self.vote_group,
        ):  # fmt: skip
            raise PlanMismatchError(
                f"ranks computed different plans at step {step} (policy {self.policy!r}): the "
                "planner saw different inputs or is not deterministic on these machines",
                source=f"rank {rank}",
                field="plan",
            )
        self.fitted_cluster, self.fit = outcome.cluster, outcome.fit
        self.controller.restore(outcome.control, source="the leader's decision")
        if self.config.plan_lag > 0 and outcome.next_lag > 0:
            self.lag = outcome.next_lag
        action = outcome.action
        stats.replanned = True
        stats.decision, stats.reason = action.name, action.reason
        stats.gain_s, stats.switch_cost_s, stats.doubt_s = (
            action.gain_s, action.switch_s, action.doubt_s,
        )  # fmt: skip
        stats.predicted_step_s = action.step_s
        stats.fit = outcome.fit.as_dict()
        stats.evidence = outcome.evidence.as_dict() if outcome.evidence is not None else {}
        self._modelled_switch_s, self._wait_s = outcome.modelled_switch_s, outcome.wait_s
        return getattr(action, "plan", None), outcome.evidence

    def switched(self, step: int) -> None:
        """The decided plan took effect at boundary `step`: measure that switch."""
        self._switch_check = (step, self._modelled_switch_s, self._wait_s)

    def _own_outcome(
        self, stats: StepStats, records: StepRecords, plan: Plan, static: Plan
    ) -> Outcome:
        """This rank's planner result, decided by its controller."""
        done = self.planner.take()
        result = done.value
        self.last_forecast = (done.requested_at, result.forecast)
        age = result.forecast.notes.get("pattern_age")  # `auto`'s (`persistence.carried_age`)
        self.pattern = None if age is None else (done.requested_at, int(age))
        stats.add_seconds("plan", done.plan_s)
        stats.add_seconds("plan_wait", done.wait_s)
        # the planner's CPU seconds, taken from the ranks where they compute on the host's cores
        stats.add_seconds("plan_cpu", done.cpu_s if self.on_cpu else 0.0)
        candidates = [
            dataclasses.replace(c, switch_s=self.switch_price.cost(c.migration_s, done.wait_s))
            for c in result.candidates
        ]
        on_static = plan.digest() == static.digest()
        in_force = None if on_static else _kind(plan)
        action = self.controller.decide(candidates, result.evidence, in_force, result.miss)
        chosen = [c for c in candidates if c.plan is getattr(action, "plan", None)]
        periods = records.measured_rows()[-FIT_WINDOW:, 1 + PERIOD]
        period = float(np.median(periods[periods > 0])) if (periods > 0).any() else 0.0
        return Outcome(
            action, result.evidence, result.cluster, result.fit, self.controller.state(),
            adoption_lag(done.plan_s, period, self.config.plan_lag),
            chosen[0].migration_s if chosen else 0.0, done.wait_s, result.forecast.digest(),
        )  # fmt: skip

    # ------------------------------------------------------------------------ learned state
    def learned_state(self) -> dict[str, Any]:
        """What the run learned, as plain values for a checkpoint: the controller's state, the
        switches' price, the fit, the lag and the load pattern's age."""
        return {
            "version": 2,
            "control": self.controller.state(),
            "switch": self.switch_price.state(),
            "fit": self.fit.as_dict(),
            "lag": int(self.lag),
            "pattern": None if self.pattern is None else [int(x) for x in self.pattern],
        }

    def restore_learned(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Take back `learned_state()` of the run this one resumes; one `ConfigError` naming
        `source` and the entry for a malformed one, all checked before anything is set."""
        keys = {"version", "control", "switch", "fit", "lag", "pattern"}
        if set(state) != keys or state["version"] != 2:
            raise ConfigError(f"expected {sorted(keys)}", source=source, field="balancer.learned")
        fit = Fit.from_dict(state["fit"], source=source)
        lag, pattern = state["lag"], state["pattern"]
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ConfigError(f"not a step count: {lag!r}", source=source, field="balancer.lag")
        if pattern is not None and not (
            isinstance(pattern, (list, tuple)) and len(pattern) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pattern)
        ):  # fmt: skip
            raise ConfigError(f"not (step, age): {pattern!r}", source=source, field="pattern")
        Controller().restore(state["control"], source)  # checked first
        SwitchPrice().restore(state["switch"], source)
        self.controller.restore(state["control"], source)
        self.switch_price.restore(state["switch"], source)
        self.fit, self.fitted_cluster = fit, cluster_of(self.cluster, fit)
        if self.config.plan_lag > 0:
            self.lag = max(self.config.plan_lag, lag)
        self.pattern = None if pattern is None else (int(pattern[0]), int(pattern[1]))


def _kind(plan: Plan) -> str:
    return "replicas" if plan.placement.replicas().any() else "homes"
