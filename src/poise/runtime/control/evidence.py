"""Evidence on the plan in force: what it saves a step, measured, with its standard error.

One estimator (`judge`), two sources: *the clock*, where at least `MIN_PROBES` probe steps ran
and their paired clock (`clock.paired_clock`: the replicas' saving over their homes alone) is
conclusive, with the model's figure for the same comparison; otherwise *the model*, on every
settled step `i` run under the plan,

    saving_i = busy_static(counts_i) - busy_plan(counts_i) - exposed_transfers_i

priced on the counts the step routed, its transfers as measured; mean and `std / sqrt(n)`.
Either is conclusive beyond `t_critical(dof)` standard errors (Student's t, two-sided 95%: the
clock's rests on as few as 3 or 4 pairs). The plan is refuted (`Evidence.refutes`) when it is
conclusively slower than what it replaced. NumPy only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from poise.core.placement import Plan
from poise.cost.model import CostModel
from poise.cost.per_step import Ran, live_parts
from poise.runtime.control.clock import Probes, modelled_clock_parts, paired_clock
from poise.runtime.selfcal.fit import exposed_transfers_s

MIN_PROBES = 4  # probe steps, each paired with its neighbours, before the clock speaks
MAX_PROBES = 8  # probe steps an episode of plans with replicas takes at most
# Student's t's 0.975 quantiles for 1 to 30 degrees of freedom (NIST/SEMATECH e-Handbook of
# Statistical Methods, 1.3.6.7.2); `CLOCK_Z` beyond 30 and where they are not known.
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
CLOCK_Z = 2.0


def t_critical(dof: int) -> float:
    """Standard errors beyond which a mean is conclusive: `T_975[dof - 1]`, `CLOCK_Z` for more
    than 30 degrees of freedom or for 0 (not known).

    >>> t_critical(3), t_critical(0), t_critical(100)
    (3.182, 2.0, 2.0)
    """
    return T_975[dof - 1] if 1 <= dof <= len(T_975) else CLOCK_Z


@dataclass(frozen=True)
class Evidence:
    """What the plan in force saves a step (seconds): `saving_s` with standard error `se_s` and
    `dof` degrees of freedom over `steps` steps, from `source` (module docstring);
    `predicted_s`, the model's figure for the same comparison (the modelled clock; None for the
    model's own counterfactual). `probes`, `clock_s`, `clock_se_s`, `modelled_clock_s`: the
    paired clock's reading where probe steps ran, reported even where it did not decide;
    `stalled_probes`: probes left out beside a stall of the host."""

    source: str
    saving_s: float
    se_s: float
    dof: int
    steps: int
    predicted_s: float | None = None
    probes: int = 0
    clock_s: float | None = None
    clock_se_s: float = 0.0
    modelled_clock_s: float | None = None
    stalled_probes: int = 0

    @property
    def t(self) -> float:
        return t_critical(self.dof)

    @property
    def conclusive(self) -> bool:
        """The saving is beyond `t` standard errors from 0, either way."""
        return abs(self.saving_s) > self.t * self.se_s

    @property
    def upper_s(self) -> float:
        """The largest saving a step the evidence leaves plausible (one-sided 97.5%)."""
        return self.saving_s + self.t * self.se_s

    @property
    def refutes(self) -> bool:
        """The plan in force is conclusively slower than what it replaced."""
        return self.conclusive and self.upper_s < 0

    def as_dict(self) -> dict[str, float | int | str | None]:
        """Plain JSON-ready values, with `conclusive`."""
        return {**asdict(self), "conclusive": self.conclusive}


def model_evidence(
    cost: CostModel, static: Plan, ran: Ran, counts: np.ndarray, rows: np.ndarray
) -> Evidence | None:
    """The model's counterfactual (module docstring) on the settled steps `counts[S, L, D, E]`
    run under the plan in force, as they ran (`ran`), measured as `rows[S, len(MEASURED)]`;
    None without steps."""
    if len(counts) == 0:
        return None
    per_step = live_parts(cost, static, counts)[:, 0] - live_parts(cost, ran, counts)[:, 0]
    per_step = per_step - exposed_transfers_s(rows)
    n = len(per_step)
    se = float(per_step.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")
    return Evidence("model", float(per_step.mean()), se, n - 1, n)


def clock_evidence(
    cost: CostModel, static: Plan, current: Plan, probes: Probes | None, stalled: int = 0
) -> Evidence | None:
    """The paired clock's reading of `current` from `probes` (already cleared of stalls: `stalled`
    were left out); None with fewer than `MIN_PROBES` or where `current` holds no replica."""
    if probes is None or len(probes) < MIN_PROBES or not current.placement.replicas().any():
        return None
    saving, se = paired_clock(cost, static, probes)
    busy_saving, transfers = modelled_clock_parts(cost, current, probes)
    predicted = busy_saving - transfers
    P = len(probes)
    return Evidence("clock", saving, se, P - 1, P, predicted, P, saving, se, predicted, stalled)


def judge(
    cost: CostModel,
    static: Plan,
    current: Plan,
    ran: Ran,
    counts: np.ndarray,
    rows: np.ndarray,
    probes: Probes | None,
    stalled: int = 0,
) -> Evidence | None:
    """The evidence on `current` (module docstring): the clock's where it is conclusive, else
    the model's counterfactual on the settled steps (`counts`, `rows`, as `ran`) with the
    clock's reading beside it; None where neither has a step."""
    clock = clock_evidence(cost, static, current, probes, stalled)
    if clock is not None and clock.conclusive:
        return clock
    model = model_evidence(cost, static, ran, counts, rows)
    if model is None or clock is None:
        return model if model is not None else clock
    return Evidence(
        "model", model.saving_s, model.se_s, model.dof, model.steps, None, clock.probes,
        clock.clock_s, clock.clock_se_s, clock.modelled_clock_s, stalled,
    )  # fmt: skip


def probe_due(step: int, plan_since: int, every: int, taken: int, settled: bool) -> bool:
    """Whether the step after boundary `step` is a probe step, with a plan with replicas in
    force since boundary `plan_since`: every `every` steps counted from that switch, at offset
    `every // 2` (so `MIN_PROBES` of them fall before the second re-plan after it at the
    defaults, none on a re-plan boundary), once a settled step ran, fewer than `MAX_PROBES`
    `taken` in the episode, and none once the clock has `settled` it."""
    since = step - plan_since
    return (
        every > 0
        and since >= 2
        and since % every == every // 2
        and taken < MAX_PROBES
        and not settled
    )
