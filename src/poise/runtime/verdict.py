"""Whether the plan in force pays: the verdict on the steps it ran.

The do-no-harm guard (`poise.runtime.guard`) adopts a plan only when the model predicts it pays;
this module judges whether it did. The planning job computes the `verdict` beside training
(`poise.runtime.planning_job`), the leader acts on `plan_pays` (`SwitchGuard.pays`), and the
Balancer stops probing once the clock has spoken (`clock_settled`). `busy` and `live_s` are
the guard's (its module docstring): what a placement changes in a live step.

Two tests on the steps run under the plan in force (the step that carried the switch left
out). The clock's (2) decides where it is conclusive (balancing measured slower by more than
`clock_z` standard errors: the plan goes; faster by more: it stays); otherwise the model's (1)
does. `clock_z` is the two-sided 95% critical value of Student's t for the degrees of freedom
of the clock's standard error (`Verdict.dof`), which is estimated from as few as 3 or 4
samples: a fixed 2 there would call about 14% of differences of nothing conclusive (t with 3
degrees of freedom), not 5%.

1. The model's counterfactual on the same steps: the saving is the static layout's `busy` minus
   the plan's, both priced on the very counts those steps routed with the fitted cluster, and
   the cost is the transfer seconds the steps measured. The saving must exceed the cost.
2. The wall clock's. What the model leaves out (ranks that share cores, where a transfer's or
   the planner's CPU seconds slow everyone's compute; a router still moving; the host's other
   work) shows only in the measured step. With `period` the measured seconds between two
   step boundaries, each step's residual is what the static layout's model does not explain:

       r[s] = period[s] - busy_static(counts[s])

   On steps run under the static layout, r is the rest of the step (non-MoE work, optimizer, data);
   on steps run under the plan, it is that rest minus what the plan saved plus what it cost. So
   `wall_saving = median(r | static steps) - median(r | balanced steps)` is balancing's measured
   saving per step, with the loads of each step priced out (medians: single slow steps of a shared
   machine do not decide). Its standard error is `1.2533 * sqrt(s_a^2 / n_a + s_b^2 / n_b)`, with
   `s` the median absolute deviation times 1.4826 (the normal-equivalent spread; 1.2533 = sqrt(pi /
   2), the standard error of a median over a mean's), with `min(n_a, n_b) - 1` degrees of freedom
   (the conservative choice for two samples of unequal spread). The plan fails when `wall_saving +
   z * se < 0`: balancing measured slower than static by more than the noise. The static steps are
   the run's latest settled static steps (the Balancer's `FIT_WINDOW` at most); the balanced steps
   are every settled step run under plans with replicas since the static layout last ran, whichever
   plan ran them (r prices every step on the static layout, so steps of different plans pool;
   balancing is judged as a whole, and the sample grows with each plan adopted instead of starting
   again at each switch). At least `MIN_WALL_STEPS` on each side, else this test is not taken. It
   is taken only for plans with replicas: a plan that only moved homes has no Trans and no Agg
   after its switch, so what the clock could add to test 1 is noise, and a false alarm there would
   move every home back (a migration as large as the switch). Balancing is thus judged by the clock
   after the switch, not only by the model that chose it. On `benchmarks/train_speedup.py`'s
   `skewed-4` (4 ranks on 2 cores) the first plan measured 51-86 ms per step slower than static
   (one standard error 35-46 ms) while test 1 held.

   That standard error sees only the spread inside the two samples, not the machine's drift
   between them: on the 2-core machine, static runs compared with themselves this way (their
   first settled steps against later windows) came out "different" beyond one standard error
   in 62% of the comparisons and beyond two in 32% (about 32% and 5% expected), because the
   step time wanders by 10-20% over tens of steps. Hence probe steps (`Balancer(probe_every=)`):
   while a plan with replicas is in force, a step now and then runs on the plan's homes without
   its replicas, and `paired_clock` (`poise.runtime.paired_clock`) compares each with its
   neighbours (one step away: the same machine speed), `d_i = r(probe i) - mean(r(neighbours))`,
   saving `mean(d)`, standard error `std(d) / sqrt(P)` with `P - 1` degrees of freedom: the
   replicas' measured saving over the same homes alone. On the same static runs, probes every
   5 or 10 steps in groups of 5 gave 2-5% beyond the 95% t critical value (t with 4 degrees of
   freedom, 2.78): nominal. With probing on, the clock speaks only from at least `MIN_PROBES`
   probes (before that the model's test decides), and the static steps are not used. Each
   probe forgoes the replicas' saving once, so once a shared verdict is conclusive
   (`clock_settled`) the Balancer stops probing until plans with replicas take over again.
   Each probed verdict also carries the fitted model's figure for the same comparison
   (`modelled_clock`), and the clock prices the replicas the next plans make
   (`replica_scale`: what they measured to cost a step over their modelled Trans + Agg, read
   at the clock's ceiling, `clock_ceiling`; `planning_job.run_job`).

When the clock contradicts the model's own prediction for the same comparison
(`prediction_refuted`), the clock's estimate judges the plan (`plan_pays`), and a replacement
made from the same forecast is credited at the share of its predecessor's promise the steps
delivered (`delivered_share`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.placement import Plan
from poise.cost.model import CostModel
from poise.runtime.paired_clock import (
    Probes,
    modelled_clock,
    paired_clock,
    residuals,
    robust_spread,
)
from poise.runtime.selfcal.fit import Ran, exposed_transfers_s, live_parts

MIN_WALL_STEPS = 3  # settled steps on each side for the wall-clock test (module docstring)
MIN_PROBES = 4  # probe steps, each paired with its neighbours, for the paired clock test
# The clock is conclusive beyond `clock_z(dof)` standard errors: 95% two-sided (and 1 - 0.05 / 2
# one-sided for the fallback it triggers), since a fallback moves homes back and stops
# balancing (module docstring, test 2). Student's t's 0.975 quantiles for 1 to 30 degrees of
# freedom (NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2, "Critical
# values of the Student's t distribution"); `CLOCK_Z` beyond 30 and where the degrees of
# freedom are not known (t is 2.00 at 60, 1.96 in the limit).
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
CLOCK_Z = 2.0
MEDIAN_SE = float(np.sqrt(np.pi / 2))  # a median's standard error over a mean's (normal data)


@dataclass(frozen=True)
class Verdict:
    """Whether the plan in force pays, over `steps` steps run under it: `saving_s` (static's
    busy seconds minus the plan's, priced on those steps' counts) against `cost_s` (their
    measured transfer seconds); `wall_saving_s` (None: not measured) the wall clock's saving
    per step and `wall_se_s` its standard error, with `dof` degrees of freedom (module
    docstring, test 2); with probes, `modelled_clock_s`, what the cost model predicts the
    paired clock measures
    (`modelled_clock`): predicted against measured for the same comparison; `stalled_probes`,
    the probe steps left out because a neighbour straddled a stall of the machine
    (`paired_clock.steady_probes`; set by the planning job)."""

    saving_s: float
    cost_s: float
    steps: int
    wall_saving_s: float | None = None
    wall_se_s: float = 0.0
    probes: int = 0  # > 0: the clock's figures come from that many paired probe steps
    modelled_clock_s: float | None = None
    wall_dof: int = 0  # degrees of freedom of `wall_se_s` (0: from `probes`, else not known)
    stalled_probes: int = 0

    @property
    def dof(self) -> int:
        """The degrees of freedom of the clock's standard error: `wall_dof`, else `probes - 1`
        for a paired clock, else 0 (not known: `clock_z` then takes `CLOCK_Z`)."""
        return self.wall_dof or max(self.probes - 1, 0)

    @property
    def z(self) -> float:
        """`clock_z(dof)`: standard errors beyond which this clock is conclusive."""
        return clock_z(self.dof)

    def as_dict(self) -> dict[str, float | int | None]:
        """Plain JSON-ready values (for a log line)."""
        return {
            "saving_s": self.saving_s,
            "cost_s": self.cost_s,
            "steps": self.steps,
            "wall_saving_s": self.wall_saving_s,
            "wall_se_s": self.wall_se_s,
            "probes": self.probes,
            "modelled_clock_s": self.modelled_clock_s,
            "dof": self.dof,
            "stalled_probes": self.stalled_probes,
        }


def verdict(
    cost: CostModel,
    static: Plan,
    current: Plan,
    counts: np.ndarray,
    measured: np.ndarray,
    static_counts: np.ndarray | None = None,
    static_measured: np.ndarray | None = None,
    balanced_counts: np.ndarray | None = None,
    balanced_measured: np.ndarray | None = None,
    probes: Probes | None = None,
    ran: Ran | None = None,
) -> Verdict:
    """Whether `current` paid on the steps it ran: `counts[S, L, D, E]` and their
    `measured[S, len(selfcal.MEASURED)]`; with steps run under `static` (`static_counts[T, L,
    D, E]`, `static_measured[T, len(selfcal.MEASURED)]`), the wall clock's saving too (module
    docstring), on the steps balancing ran since it left static (`balanced_counts[B, ...]`,
    `balanced_measured[B, ...]`; default: `current`'s own). With `probes` (the Balancer
    probes), the clock's saving comes from them alone (`paired_clock`); `ran`: what each step of
    `counts` ran, where not `current` itself (its replicas retargeted, `ran_plans`): the model's
    saving prices that. NumPy only."""
    if len(counts) == 0:
        return Verdict(0.0, 0.0, 0)
    static_busy = live_parts(cost, static, counts)[:, 0]
    plan_busy = live_parts(cost, current if ran is None else ran, counts)[:, 0]
    cost_s = float(exposed_transfers_s(measured).sum())
    saving_s = float((static_busy - plan_busy).sum())
    if probes is not None:
        if len(probes) < MIN_PROBES or not current.placement.replicas().any():
            return Verdict(saving_s, cost_s, len(counts))
        wall, se = paired_clock(cost, static, probes)
        modelled = modelled_clock(cost, current, probes)
        return Verdict(saving_s, cost_s, len(counts), wall, se, len(probes), modelled)
    if balanced_counts is None or balanced_measured is None:
        balanced_counts, balanced_measured = counts, measured
    if (
        static_counts is None
        or static_measured is None
        or min(len(static_counts), len(balanced_counts)) < MIN_WALL_STEPS
        or not current.placement.replicas().any()
    ):
        return Verdict(saving_s, cost_s, len(counts))
    on_plan = residuals(cost, static, balanced_counts, balanced_measured)
    on_static = residuals(cost, static, static_counts, static_measured)
    wall = float(np.median(on_static) - np.median(on_plan))
    se = MEDIAN_SE * float(np.sqrt(robust_spread(on_static) ** 2 / len(on_static)
                                   + robust_spread(on_plan) ** 2 / len(on_plan)))  # fmt: skip
    dof = min(len(on_static), len(on_plan)) - 1
    return Verdict(saving_s, cost_s, len(counts), wall, se, wall_dof=dof)


def clock_z(dof: int) -> float:
    """Standard errors beyond which the clock is conclusive: Student's t's two-sided 95%
    critical value for `dof` degrees of freedom (`T_975`); `CLOCK_Z` for more than 30 or
    for 0 (not known).

    >>> clock_z(3), clock_z(7), clock_z(0), clock_z(100)
    (3.182, 2.365, 2.0, 2.0)
    """
    return T_975[dof - 1] if 1 <= dof <= len(T_975) else CLOCK_Z


def clock_says_slower(v: Verdict | None) -> bool:
    """The wall clock measured balancing slower by more than `Verdict.z` standard errors (test 2
    of the module docstring failed)."""
    return v is not None and v.wall_saving_s is not None and clock_ceiling(v) < 0


def clock_ceiling(v: Verdict) -> float:
    """The largest saving a step the paired clock leaves plausible: its estimate plus
    `Verdict.z` standard errors (the one-sided 97.5% bound). Replicas are priced dearer than
    their model only by what the clock shows beyond its own noise (`paired_clock.replica_scale`):
    on `skewed` a clock of 28.5 +- 16.2 ms from 5 probes, against 39.8 modelled, had priced every
    later replica 5.5 times its Trans + Agg from the point estimate, and the plans that followed
    kept 2-3 replicas where 6-7 measured faster (docs/benchmarks.md).

    >>> v = Verdict(0.0, 0.0, 10, wall_saving_s=0.010, wall_se_s=0.002, probes=4)
    >>> round(clock_ceiling(v), 6)  # 0.010 + 3.182 * 0.002 (t with 3 degrees of freedom)
    0.016364
    """
    if v.wall_saving_s is None:
        raise ValueError("the verdict has no clock")
    return v.wall_saving_s + v.z * v.wall_se_s


def clock_settled(v: Verdict | None) -> bool:
    """The paired clock has spoken: at least `MIN_PROBES` probe steps and a saving beyond
    `Verdict.z` standard errors either way. More probes in the episode would only confirm it at
    the price of the replicas' saving on each, so the Balancer stops probing there."""
    return (
        v is not None
        and v.probes >= MIN_PROBES
        and v.wall_saving_s is not None
        and abs(v.wall_saving_s) > v.z * v.wall_se_s
    )


def clock_proved(v: Verdict | None) -> bool:
    """The paired clock has settled (`clock_settled`) that the plan in force saves time a step:
    the plan pays on the wall clock's word, and no probe is due in its episode."""
    return clock_settled(v) and v is not None and (v.wall_saving_s or 0.0) > 0


def prediction_refuted(v: Verdict | None) -> bool:
    """The paired clock measured the replicas' saving more than `Verdict.z` standard errors below
    what the fitted model predicted for the same comparison (`Verdict.modelled_clock_s`, from
    at least `MIN_PROBES` probes): the model that would judge the plan is wrong about it."""
    return (
        v is not None
        and v.probes >= MIN_PROBES
        and v.wall_saving_s is not None
        and v.modelled_clock_s is not None
        and v.modelled_clock_s - v.wall_saving_s > v.z * v.wall_se_s
    )


def delivered_share(promised_s: float | None, v: Verdict | None) -> float:
    """The share of the plan in force's promise (`promised_s`, its predicted saving a step over
    the static layout net of transfers, `SwitchGuard.promised`) that the steps run under it
    delivered by the model's counterfactual (`(v.saving_s - v.cost_s) / v.steps`, the same
    kind of figure priced on the loads those steps routed, with their measured transfers),
    within [0, 1]; 1 where either is not known or nothing was promised.

    A plan goes stale when the loads move away from the forecast it was made on; a
    replacement made from the newest forecast is the remedy only where forecasts held for as
    long as a plan serves. On `skewed-4` (4 ranks on 2 cores, the router still moving in the
    first 30 steps) the first plan promised 19 ms a step and delivered -3: its replacement,
    promised 10 from the next forecast, cost 7-23 ms a step until the next verdict, in every
    round."""
    if promised_s is None or not promised_s > 0 or v is None or v.steps <= 0:
        return 1.0
    delivered = (v.saving_s - v.cost_s) / v.steps
    return float(np.clip(delivered / promised_s, 0.0, 1.0))


def plan_pays(v: Verdict | None) -> bool:
    """Whether the plan in force pays (True without steps run under it): the wall clock decides
    where it is conclusive (balancing slower by more than `Verdict.z` standard errors: no; faster
    by more: yes); where it is not but it refutes the model's prediction for the same
    comparison (`prediction_refuted`), its own estimate does (a saving above 0); the model's
    counterfactual otherwise (its saving over the static layout on the steps it ran exceeds
    their measured transfer seconds). Pure, so that the planning job prices the exits only
    where the leader will weigh them.

    Why the middle rule: on `skewed-4` (4 ranks on 2 cores, whose ideal is 1.02-1.03x) the
    clock read -2 to -17 ms a step (standard error 8-11 ms, 8 probes: never conclusive) where
    the model predicted +15 ms; the model's counterfactual, wrong by more than the clock's
    noise, kept the replicas for the whole run, and `auto` ran 0.91x static."""
    if v is None or v.steps == 0:
        return True
    if clock_says_slower(v):
        return False
    if v.wall_saving_s is not None and v.wall_saving_s - v.z * v.wall_se_s > 0:
        return True
    if prediction_refuted(v):
        assert v.wall_saving_s is not None
        return v.wall_saving_s > 0
    return v.saving_s > v.cost_s


__all__ = [
    "CLOCK_Z",
    "MIN_PROBES",
    "MIN_WALL_STEPS",
    "T_975",
    "Verdict",
    "clock_ceiling",
    "clock_proved",
    "clock_says_slower",
    "clock_settled",
    "clock_z",
    "delivered_share",
    "plan_pays",
    "prediction_refuted",
    "verdict",
]
