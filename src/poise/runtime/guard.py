"""Do no harm: adopt a plan only when it pays, and fall back to the static layout when it does
not.

What a placement changes in a live step, per step and summed over layers, from the cost model's
phases (`poise.runtime.selfcal.live_parts`, priced on the self-calibrated cluster):

    busy      = expert forward + backward, dispatch + combine (with the dispatcher's host work)
    transfers = Trans + Agg (the model's seconds before any overlap)
    live_s    = busy + k * transfers

priced on the self-calibrated cluster, whose bulk transfers take the time this run's exposed
transfers measured (Trans waits and Agg in the step, Trans launches at the boundary:
`selfcal`'s `k_transfer` as `HostCosts.transfer_scale`) and whose dispatcher pays the host
work per row the token all-to-all measured, so `k` = 1 (`decide` takes another `k_transfer`
for a further scale).
The non-MoE work is the same under every placement and cancels.

Adoption (`SwitchGuard.decide`). A candidate is priced against the plan in force on the forecast
loads:

    gain   = (live_s(current) - live_s(candidate)) * horizon          seconds saved
    switch = k_switch * migrate_s(candidate) + relay_s + wait_s        seconds the switch costs

with `horizon` the steps the plan serves: the re-planning interval, or, for an `auto` plan, as
long as its load pattern has held where that is longer (`poise.plan.persistence`: a home moved
for a pattern that lasts pays over more than one interval), `migrate_s` the modelled
one-off transfer (homes moved with their optimizer state; a new replica's fill is not one:
it is the plan's first Trans, launched at the switch's boundary as every boundary launches
one, and `live_s` already charges it each step), `k_switch` the measured / modelled seconds of
the migrations this run already made, summed, each timed on its own (the boundary's seconds in
`transfers.migrate`, `selfcal.MIGRATE`; before the first, the prior the caller passes: the
Balancer's is its start-up switch probe's, a synthetic migration through `transfers.migrate`
timed against the same prior cluster (`poise.runtime.probe.probe_switch_scale`; without it
`k_transfer`, the scale this run's other bulk transfers measured: the exchange alone priced
`many-experts`' first switch 2.4-2.7 times under what it took), `relay_s`
the mean of what the switches this run made cost beyond their migration (the layers' slots
re-laid, the routing rebuilt, the new replicas filled, beyond the steady steps' transfers;
0 before the first), and `wait_s` the seconds the boundary waited for the planner. A switch
that moves no home is modelled at 0, so it is all `relay_s`; priced at 0 it was adopted for
any gain, however small: on `skewed-4` (4 ranks on 2 cores) `auto` changed its replicas at
every re-plan, each change 15-60 ms of boundary for a modelled gain of a few ms a step. The
ratio takes the migration alone because a switch's fixed part is no per-byte cost: on
`ep_step`'s zipf-1.2 trace a first switch that moved one home (4.7 MB) and added replicas
exposed 31 ms beyond its steady steps, 50 times its modelled migration; that ratio, applied
to every later migration, priced them about 4 times dearer than the 66 MB migrations of the
same trace measured (12.9 times their model), so `auto` kept four replicas and their
transfers for the rest of the run. A switch's measured seconds
(`switch_seconds`) are what its step exposed beyond the plan's steady steps: the exposed
transfer seconds (boundary, Trans waits, Agg) of the step that carried it, less their median
over the steps after it (which pay the same Trans and Agg) and less the planner wait. The plan
is adopted iff `gain - CLOCK_Z * se * horizon > (1 + margin) * switch` and `gain > 0`, with
`se` the standard error of the recent steps' mean gain a step (`Assessment.recent_gain_se_s`,
from the spread of the gains those steps' own counts give): a gain the steps' spread cannot
tell from the switch's price is not taken (on `skewed-4` `auto` had adopted at 7 of 9
re-plans, twice moving 19-22 homes, for savings 1.1-1.6 times the switch while the clock read
none). After a fallback where the paired clock refuted the model's prediction of it, the gain
of a candidate with replicas is credited only at the share the clock measured
(`SwitchGuard.trust`, `fell_back`); a candidate without replicas is credited in full, since the
clock measured replicas against their homes alone and said nothing of homes. The refutation
lasts `retrial` re-plans, then the model is trusted again for one trial; each refutation
doubles the next wait (`replan_due`). A
candidate equal to the plan in force (same placement and assignment) is skipped outright: no
transfer, no routing change.
The per-step difference in `gain` is the smaller of its value on the forecast and its mean over
the last `horizon` steps' actual counts (`assessment.assess(..., recent=)`): a plan fitted to
a smoothed forecast looks better on it than on any real step (per-step noise, a router still
moving in warm-up), and a plan that would not have paid on the steps just run is not expected
to pay on the next ones. Those steps are the ones the plan was made from; from the static
layout the leader also asks whether the last candidate would have saved time a step on the
steps run after it was made (`poise.runtime.leader.forecast_held`).

Keeping it (`SwitchGuard.pays`): whether the plan in force paid on the steps it ran, by the
model's counterfactual and the wall clock, is `poise.runtime.verdict`'s (`plan_pays`).

When the plan does not pay, it gives way (`SwitchGuard.exit_choice`) to whichever of the
fresh candidate and the exits (`exit_plans`: the plan's homes without its replicas, when it
moved homes; the static layout) nets the most over the horizon (gain over the plan in force
less the switch, the candidate's `1 + margin` times, as for adoption). A plan goes stale when
the router moves faster than re-plans (warm-up): the model's test fails with the clock's, and
a candidate made from the latest steps is the remedy, not the static layout, but only as far
as forecasts have held: the candidate is credited at the share of its own promise the plan in
force delivered (`delivered_share`: what that plan was predicted to save a step over static,
net of transfers, against the model's counterfactual on the steps it ran, the verdict's test
1; `SwitchGuard.promised` keeps the promise). When the clock refuted the model (the verdict's
test 2 failed while test 1 passed), the candidate, priced by that model, is not weighed.
Going to an exit is a fallback: the next `backoff` re-plans are skipped (doubling after each
fallback in a row, up to `max_backoff`). A replacement leaves the backoff as it is (it has yet
to prove itself). Going to the plan's homes alone (stage one of `fallback_target`) costs no
migration, Trans and Agg stop at once; the static homes come back when staying on stale homes
costs more over the horizon than moving them back, now or at a later fallback.

Planning itself (`SwitchGuard.planning_pays`). Where the planner thread shares the cores with
the training ranks (CPU devices), its CPU seconds slow the step as surely as a transfer. While
the static layout is in force, or a plan the paired clock has settled pays
(`verdict.clock_proved`), a re-plan whose best candidate was refused and would not have saved
even those seconds over its horizon says there is nothing here worth planning for: the next
re-plans are skipped with the same doubling backoff as after a fallback (reset when a plan is
adopted). Under a plan whose clock has not spoken the re-plans run on: each carries the verdict
that may still take the plan back. On accelerators the charge is 0 and planning never backs
off for its own cost.

Every input is identical on every rank (gathered measurements, the same plan from the same
loads), and one rank, the leader, decides for all (`poise.runtime.planner.broadcast`), so no rank's
own
planner timings can split the decision.

What the guard learned in a run (`SwitchGuard.state`, the entries of `LEARNED`) goes into the
run's checkpoints and back into a resumed run's guard (`poise.runtime.learned_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.errors import ConfigError
from poise.core.placement import Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.runtime.assessment import Assessment
from poise.runtime.moves.homes import homes_alone
from poise.runtime.selfcal.fit import MIGRATE, exposed_transfers_s
from poise.runtime.verdict import (
    CLOCK_Z,
    Verdict,
    clock_says_slower,
    delivered_share,
    plan_pays,
)

# `SwitchGuard.state()`'s entries and the attributes they are
LEARNED = {
    "k_switch": "k_switch",
    "migrated_s": "_migrated_s",
    "modelled_s": "_modelled_s",
    "switches": "switches",
    "relay_s": "relay_s",
    "relays": "relays",
    "fallbacks": "fallbacks",
    "idles": "idles",
    "trust": "trust",
    "retrial": "retrial",
    "retrial_in": "_retrial_in",
    "promised_s": "promised_s",
    "skip": "_skip",
    "next_backoff": "_next_backoff",
}


@dataclass(frozen=True)
class Decision:
    """What the guard decided: `adopt`, why (`reason`: adopt, same, no-gain, off), and the
    figures it compared (seconds): `gain_s` over the horizon, `switch_s` the switch's cost,
    `doubt_s` what the recent steps' spread took off the gain (`CLOCK_Z * se * horizon`)."""

    adopt: bool
    reason: str
    gain_s: float = 0.0
    switch_s: float = 0.0
    doubt_s: float = 0.0


def switch_seconds(rows: np.ndarray, step: int, wait_s: float) -> float | None:
    """The measured seconds of the switch made at `step` (module docstring), from the measured
    rows `rows[n, 1 + len(selfcal.MEASURED)]` (step id, then the seconds); None until the row
    of `step` and at least one settled row after it are there."""
    ids = rows[:, 0]
    carried = rows[ids == step, 1:]
    after = rows[ids > step, 1:]
    if len(carried) != 1 or len(after) == 0:
        return None
    steady = float(np.median(exposed_transfers_s(after)))
    return float(exposed_transfers_s(carried)[0]) - steady - max(0.0, wait_s)


def migration_seconds(rows: np.ndarray, step: int) -> float | None:
    """The seconds the switch made at `step` spent migrating homes (`selfcal.MIGRATE` of the
    row that carried it, as `switch_seconds` reads it); None while that row is missing."""
    carried = rows[rows[:, 0] == step, 1:]
    return float(carried[0, MIGRATE]) if len(carried) == 1 else None


def exit_plans(current: Plan, static: Plan, spec: ModelSpec) -> list[Plan]:
    """The layouts a fallback from `current` may go to: its homes alone when it has replicas
    on homes other than the static layout's (`fallback_target`'s first stage), then the static
    layout, each with its transfers from `current` (the homes it moves back)."""
    back = Plan(
        static.policy,
        static.placement,
        static.assignment,
        transfers_between(current.placement, static.placement, spec),
    )
    first = fallback_target(current, static, spec)
    return [back] if first is static else [first, back]


def fallback_target(current: Plan, static: Plan, spec: ModelSpec) -> Plan:
    """Where a fallback from `current` goes, in two stages: while `current` has replicas and
    its homes differ from the static layout's, to its own homes without the replicas (Trans and
    Agg stop at once; moving the homes back would cost a migration as large as the switch that
    moved them); otherwise to `static`. A homes-only plan is judged like any other plan in
    force, so if its homes do not pay either, the next fallback moves them back."""
    p = current.placement
    if not p.replicas().any() or np.array_equal(p.home, static.placement.home):
        return static
    return homes_alone(current, spec)


class SwitchGuard:
    """The adoption rule and the fallback rule (module docstring), with their state.

    `margin`: the switch must be paid `1 + margin` times; `horizon`: steps a plan serves;
    `backoff`: re-plans skipped after the first fallback (doubles up to `max_backoff`);
    `enabled=False` adopts every candidate that differs and never falls back."""

    def __init__(
        self,
        horizon: int,
        margin: float = 0.2,
        backoff: int = 1,
        max_backoff: int = 8,
        enabled: bool = True,
    ) -> None:
        if horizon < 1:
            raise ConfigError(f"must be >= 1, got {horizon}", field="guard.horizon")
        if not margin >= 0:
            raise ConfigError(f"must be >= 0, got {margin}", field="guard.margin")
        if backoff < 0 or max_backoff < backoff:
            raise ConfigError(
                f"need 0 <= backoff <= max_backoff, got {backoff}, {max_backoff}",
                field="guard.backoff",
            )
        self.horizon = int(horizon)
        self.margin = float(margin)
        self.backoff = int(backoff)
        self.max_backoff = int(max_backoff)
        self.enabled = enabled
        self.k_switch = 1.0  # measured / modelled migration seconds once `switches` > 0
        self._migrated_s = 0.0  # ... summed over the switches so far
        self._modelled_s = 0.0
        self.switches = 0
        self.relay_s = 0.0  # the mean measured seconds of switches beyond their migration
        self.relays = 0
        self.fallbacks = 0
        self.idles = 0  # re-plans that did not pay for their planning
        self.trust = 1.0  # the share of the model's predicted gains credited (`fell_back`)
        self.retrial = max(1, self.max_backoff)  # re-plans until a refuted model is trusted again
        self._retrial_in = 0  # re-plans left until then (0: trust is not waiting to return)
        # what the plan in force was predicted to save a step over the static layout, net of
        # its transfers (`promised`): 0 on static, None where not known (a fallback's homes)
        self.promised_s: float | None = 0.0
        self._skip = 0  # re-plans still to skip
        self._next_backoff = self.backoff

    # ------------------------------------------------------------------ what it learned
    def state(self) -> dict[str, float | int | None]:
        """What this guard learned in the run (`LEARNED`: the switches' measured price, the
        trust left by a refutation and its re-trial, the backoffs, the promise of the plan in
        force), as plain values for a checkpoint; its settings are the run's configuration."""
        return {name: getattr(self, attr) for name, attr in LEARNED.items()}

    def restore(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        """Take back `state()` of a guard of the same run (a resumed one): every `LEARNED`
        entry, numbers only (`promised_s` may be None); the backoffs are held to this guard's
        `max_backoff`. One `ConfigError` naming `source` and the entry for a malformed one."""
        missing = sorted(set(LEARNED) - set(state))
        unknown = sorted(set(state) - set(LEARNED))
        if missing or unknown:
            raise ConfigError(
                f"guard state: missing {missing}, unknown {unknown}", source=source, field="guard"
            )
        values = {}
        for name, attr in LEARNED.items():
            v = state[name]
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not (number or (v is None and name == "promised_s")):
                raise ConfigError(f"not a number: {v!r}", source=source, field=f"guard.{name}")
            values[attr] = v
        for attr, v in values.items():
            setattr(self, attr, v)
        self._skip = min(int(self._skip), self.max_backoff)
        self._next_backoff = min(int(self._next_backoff), self.max_backoff)

    # ------------------------------------------------------------------ adoption
    def switch_scale(self, prior: float = 1.0) -> float:
        """`k_switch`: the switches' measured / modelled ratio, `prior` before any was measured."""
        return self.k_switch if self.switches else float(prior)

    def switch_cost(self, modelled_s: float, wait_s: float = 0.0, prior: float = 1.0) -> float:
        """Seconds a switch whose migration is modelled at `modelled_s` costs (module
        docstring): `k_switch` (`prior` before any switch was measured) times it, plus
        `relay_s`, plus the planner wait `wait_s` (none below 0)."""
        return self.switch_scale(prior) * modelled_s + self.relay_s + max(0.0, wait_s)

    def decide(
        self,
        a: Assessment,
        wait_s: float = 0.0,
        k_transfer: float = 1.0,
        switch_prior: float = 1.0,
        horizon: int | None = None,
    ) -> Decision:
        """Adopt or not (see the module docstring); `switch_prior` is `k_switch` until a switch
        was measured; `horizon`: the steps the saving is credited over (None: `self.horizon`)."""
        if a.same:
            return Decision(False, "same")
        steps = horizon or self.horizon
        gain = a.live_gain_s(k_transfer) * steps
        switch = self.switch_cost(a.switch_s, wait_s, switch_prior)
        if not self.enabled:
            return Decision(True, "off", gain, switch)
        gain *= self.credit(a)  # after a fallback the clock forced on the model (`fell_back`)
        doubt = CLOCK_Z * a.recent_gain_se_s(k_transfer) * steps
        ok = gain > 0 and gain - doubt > (1.0 + self.margin) * switch
        return Decision(ok, "adopt" if ok else "no-gain", gain, switch, doubt)

    def credit(self, a: Assessment) -> float:
        """The share of `a`'s predicted gain credited after a refutation: `trust` where the
        candidate holds replicas (its transfers are priced above 0), 1 where it holds none. The
        paired clock times replicas against steps on their homes alone
        (`poise.runtime.selfcal.probe`),
        so its refutation is a fact about replicas; a homes-only plan's gain is the model's
        counterfactual alone, which the verdict tests separately."""
        return self.trust if a.candidate_transfers_s > 0 else 1.0

    def record_switch(
        self, measured_s: float, modelled_s: float, migrate_s: float | None = None
    ) -> None:
        """A switch's measured seconds (`switch_seconds`), its modelled migration and, where
        known, the seconds its migration took (`migrate_s`). `k_switch` becomes the ratio of
        the migration seconds (`migrate_s`, else the whole switch's) to the modelled ones,
        both summed over the switches that moved homes: a large migration, whose price
        matters most, weighs by its size, and a small one is mostly per-layer overhead. What
        the switch cost beyond its migration (all of it where no home moved, none where
        `migrate_s` is not known) counts towards `relay_s`, the mean over the switches (none
        below 0)."""
        if not np.isfinite(measured_s):
            return
        moved = modelled_s > 0
        known = migrate_s is not None and np.isfinite(migrate_s)
        if not moved or known:
            beyond = measured_s - (migrate_s if moved and known else 0.0)
            self.relays += 1
            self.relay_s += (max(0.0, beyond) - self.relay_s) / self.relays
        if not moved:
            return
        seconds = migrate_s if known else measured_s
        if not seconds > 0:
            return
        self.switches += 1
        self._migrated_s += seconds
        self._modelled_s += modelled_s
        self.k_switch = self._migrated_s / self._modelled_s

    # ------------------------------------------------------------------ keeping it
    def pays(self, v: Verdict | None) -> bool:
        """Whether the plan in force pays: `plan_pays`, or True with the guard off."""
        return not self.enabled or plan_pays(v)

    @staticmethod
    def clock_says_slower(v: Verdict | None) -> bool:
        """The wall clock measured balancing slower than static by more than one standard
        error (test 2 of `poise.runtime.verdict` failed)."""
        return clock_says_slower(v)

    @classmethod
    def model_refuted(cls, v: Verdict | None) -> bool:
        """The clock failed the plan (measured it slower than static, or refuted the model's
        prediction and read no saving: `plan_pays`) while the model's counterfactual said it
        paid: the model that prices plans missed what the clock saw. (Both failing is a plan
        gone stale, which the model sees too.)"""
        return v is not None and not plan_pays(v) and v.saving_s > v.cost_s

    def exit_choice(
        self,
        candidate: Assessment,
        exits: list[Assessment],
        model_refuted: bool,
        switch_prior: float = 1.0,
        horizon: int | None = None,
        paid: Verdict | None = None,
    ) -> int:
        """Where to go from a plan in force that does not pay: 0 for the fresh `candidate`,
        `i + 1` for `exits[i]` (`exit_plans`, each priced against the plan in force). Each
        option's net over the horizon is its `live_gain_s * horizon` less its switch
        (`switch_scale * switch_s`, the candidate's `1 + margin` times, as in `decide`); the
        best net wins, an exit on ties. When the clock refuted the model (`model_refuted`),
        the candidate, which that model priced, is not weighed: only the exits are; after a
        fallback the clock forced on the model, its gain is credited at `trust` (`decide`;
        at 0 it is not weighed either), and only at the share of its own promise the plan in
        force delivered by the model's counterfactual on the steps it ran (`paid`, the
        verdict: `delivered_share`; the candidate comes from the same forecast of loads).
        `horizon`: as in `decide`."""
        scale = self.switch_scale(switch_prior)
        steps = horizon or self.horizon

        def net(a: Assessment, margin: float, credit: float = 1.0) -> float:
            return credit * a.live_gain_s() * steps - (1.0 + margin) * scale * a.switch_s

        nets = [net(a, 0.0) for a in exits]
        best = int(np.argmax(nets)) + 1
        credit = self.replacement_credit(paid, candidate)
        if model_refuted or candidate.same or credit <= 0:
            return best
        return 0 if net(candidate, self.margin, credit) > nets[best - 1] else best

    def replacement_credit(self, paid: Verdict | None, a: Assessment) -> float:
        """The share of a replacement candidate's (`a`'s) predicted gain `exit_choice` credits:
        `credit(a)` (`trust` where `a` holds replicas) times the share of its promise the plan
        in force delivered (`delivered_share`)."""
        return self.credit(a) * delivered_share(self.promised_s, paid)

    def promised(self, step_gain_s: float, from_static: bool) -> None:
        """A plan predicted to save `step_gain_s` a step over the plan in force (credited, net
        of transfers) took effect: the promise over the static layout adds up (the gains over
        static of two plans in a row add: (static - a) + (a - b) = static - b); from an
        unknown one it stays unknown."""
        if from_static:
            self.promised_s = float(step_gain_s)
        elif self.promised_s is not None:
            self.promised_s += float(step_gain_s)

    def returned(self, to_static: bool) -> None:
        """A fallback took effect: to the static layout (promise 0) or to a plan's homes alone,
        whose saving over static no one predicted (unknown)."""
        self.promised_s = 0.0 if to_static else None

    def fell_back(self, v: Verdict | None = None) -> None:
        """Record a fallback: skip the next re-plans (doubling on repeats). Where the paired
        clock refuted the model's prediction of it (`model_refuted`, with the model's figure
        for the clock, `v.modelled_clock_s`), later candidates' gains are credited at the share
        the clock measured, `trust = clip(clock / predicted, 0, 1)` (the least over such
        fallbacks): the model that priced them was just measured to overstate what it saves,
        and nothing but another plan in force can measure it again (on `skewed-4` the guard
        fell back on the clock and re-adopted on the same model's prices a few re-plans later,
        twice a run). The refutation holds for `retrial` re-plans (`replan_due`), and
        `retrial` doubles for the next one."""
        self.fallbacks += 1
        if (
            v is not None
            and self.model_refuted(v)
            and v.wall_saving_s is not None
            and v.modelled_clock_s is not None
            and v.modelled_clock_s > 0
        ):
            share = min(1.0, max(0.0, v.wall_saving_s / v.modelled_clock_s))
            self.trust = min(self.trust, share)
            self._retrial_in = self.retrial
            self.retrial *= 2
        self._back_off()

    def replan_due(self) -> None:
        """A re-plan is due (skipped or not): count it towards the refuted model's re-trial.
        When `retrial` re-plans have passed since the refutation, `trust` returns to 1, so the
        next candidate with replicas is priced in full and, if adopted, measured by the clock
        again. A refutation measures the loads and the machine of its time; loads drift, and a
        run of 10,000 steps should not give up replicas for good on one of its first 100 (the
        circuit breaker's half-open state). Each refutation doubles the wait for the next
        (`fell_back`), so over a run the trials' cost is a geometric series: the first comes
        `max_backoff` re-plans after the first refutation, the guard's longest backoff."""
        if self._retrial_in <= 0:
            return
        self._retrial_in -= 1
        if self._retrial_in == 0:
            self.trust = 1.0

    def planning_pays(self, decision: Decision, planning_s: float) -> bool:
        """Whether a re-plan was worth its `planning_s` (the planner's seconds charged to the
        step): it adopted, or its candidate's gain over the horizon exceeded them."""
        return not self.enabled or decision.adopt or decision.gain_s > planning_s

    def planning_idle(self) -> None:
        """Record a re-plan that did not pay for itself: skip the next re-plans (doubling on
        repeats, as after a fallback)."""
        self.idles += 1
        self._back_off()

    def _back_off(self) -> None:
        self._skip = self._next_backoff
        self._next_backoff = min(self.max_backoff, max(1, 2 * self._next_backoff))

    def kept(self) -> None:
        """A plan proved itself: reset the backoff."""
        self._next_backoff = self.backoff

    def skip_replan(self) -> bool:
        """Consume one skipped re-plan; True if this one is skipped."""
        if self._skip > 0:
            self._skip -= 1
            return True
        return False


__all__ = [
    "LEARNED",
    "Decision",
    "SwitchGuard",
    "exit_plans",
    "fallback_target",
    "migration_seconds",
    "switch_seconds",
]
