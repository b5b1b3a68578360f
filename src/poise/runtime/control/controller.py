"""The Balancer's decision: adopt a plan only when it pays, revert one the evidence refutes.

At each re-plan the controller sees the candidates of one planning job, each priced against
the plan in force (`pricing.Priced`), and the evidence on the plan in force (`evidence.
Evidence`; None on the static layout). For a candidate `c` of kind `k` (`replicas` where it
holds one, else `homes`):

    noise(c)  = hypot(c.se_s, miss * c.gain_s)      miss: how far the last forecast missed,
                                                     0 for a candidate that keeps the homes
    credit(c) = ratio[k] * c.gain_s - t(c) * noise(c)                         seconds a step
    net(c)    = credit(c) * c.horizon - (1 + margin) * c.switch_s    (an exit: ratio 1, margin 0)

1. The evidence learns: where it is conclusive, `ratio[kind in force]` moves halfway to the
   share of its prediction the plan delivered, `clip(saving / predicted, 0, 1)`.
2. Revert where the evidence refutes the plan in force (conclusively slower): to the exit of the
   best `net` or, where the model's own counterfactual saw the plan go stale (not the clock,
   which refuted the model that prices them), to a fresh candidate that nets more; the backoff
   grows (the next re-plans are skipped, 1, 2, 4, up to `MAX_BACKOFF`).
3. Otherwise adopt the candidate of the best `net` where that is above 0 (the backoff resets).
4. Otherwise keep the plan in force.

`c.horizon` never runs past the end of the run, so a plan near it is adopted only if it pays
back before. Inputs, not special cases: ranks that share their cores start with
`ratio["replicas"] = 0` (a replica's Trans and Agg are copies on the cores that compute);
`enabled=False` adopts every candidate that differs and never reverts. NumPy only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.errors import ConfigError
from poise.core.fields import get_int, get_number
from poise.core.placement import Plan
from poise.runtime.control.evidence import Evidence, t_critical
from poise.runtime.control.pricing import Priced

KINDS = ("homes", "replicas")
MAX_BACKOFF = 8  # re-plans skipped after a revert, doubling from 1


@dataclass(frozen=True)
class Action:
    """What the controller decided (`Adopt`, `Keep` or `Revert`), `reason` in words, and the
    figures behind it for the candidate it weighed last: `gain_s` its credited saving over its
    horizon, `switch_s` its switch's price, `doubt_s` what its noise took off the gain."""

    reason: str
    gain_s: float = 0.0
    switch_s: float = 0.0
    doubt_s: float = 0.0
    step_s: float = 0.0

    @property
    def name(self) -> str:
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Adopt(Action):
    plan: Plan | None = None


@dataclass(frozen=True)
class Keep(Action):
    pass


@dataclass(frozen=True)
class Revert(Action):
    plan: Plan | None = None


class Controller:
    """The rule of the module docstring with its learned state: `ratio` per kind, the promise of
    the plan in force (`promised_s`: its predicted saving a step over the static layout; None:
    not known), and the backoff. `margin`: a switch must be paid `1 + margin` times."""

    def __init__(self, margin: float = 0.2, enabled: bool = True, replicas_prior: float = 1.0):
        if not margin >= 0:
            raise ConfigError(f"must be >= 0, got {margin}", field="margin")
        self.margin = float(margin)
        self.enabled = enabled
        self.ratio = {"homes": 1.0, "replicas": float(replicas_prior)}
        self.promised_s: float | None = 0.0
        self.skip = 0  # re-plans still to skip
        self.next_backoff = 1

    # ------------------------------------------------------------------ the rule
    def decide(
        self,
        candidates: Sequence[Priced],
        evidence: Evidence | None,
        in_force: str | None,
        miss: float = 1.0,
    ) -> Action:
        """The action on `candidates` (the job's, exits among them where the evidence refutes)
        given `evidence` on the plan in force of kind `in_force` (None: the static layout) and
        the last forecast's `miss` in [0, 1] (module docstring)."""
        fresh = [c for c in candidates if not c.same and not c.exit]
        if not self.enabled:
            if not fresh:
                return Keep("keep: the plan in force is the policy's")
            return self._adopt(fresh[0], "adopt (guard off)", in_force, miss)
        if evidence is not None and in_force is not None:
            self._learn(in_force, evidence)
        # a clock that refuted the model leaves its prices of fresh plans no weight
        refuted = evidence is not None and evidence.refutes and in_force is not None
        weighed = [
            c
            for c in candidates
            if c.exit or (refuted and evidence.source == "model" and not c.same)
        ]
        if refuted and weighed:
            best = max(weighed, key=lambda c: self.net(c, miss))
            self.skip = self.next_backoff
            self.next_backoff = min(MAX_BACKOFF, 2 * self.next_backoff)
            self.promised_s = 0.0 if best.exit == "static" else None
            unit = "probes" if evidence.source == "clock" else "steps"
            return Revert(
                f"revert: the {evidence.source} measured {evidence.saving_s * 1e3:+.1f} +- "
                f"{evidence.se_s * 1e3:.1f} ms/step over {evidence.steps} {unit}; "
                f"to {_named(best)}",
                *self._figures(best, miss),
                plan=best.plan,
            )
        if not fresh:
            return Keep("keep: no candidate differs from the plan in force")
        best = max(fresh, key=lambda c: self.net(c, miss))
        gain, switch, doubt, step = self._figures(best, miss)
        if self.net(best, miss) > 0:
            self.next_backoff = 1
            return self._adopt(best, self._says("adopt", best, miss), in_force, miss)
        return Keep(self._says("keep", best, miss), gain, switch, doubt, step)

    def credit(self, c: Priced, miss: float) -> float:
        """`credit(c)`, seconds a step (module docstring)."""
        return self.ratio[c.kind] * c.gain_s - t_critical(c.n_recent - 1) * self.noise(c, miss)

    @staticmethod
    def noise(c: Priced, miss: float) -> float:
        """`noise(c)`: the recent steps' spread and, for a candidate that moves homes, the last
        forecast's miss as a share of its gain."""
        missed = 0.0 if c.forecast_free else float(np.clip(miss, 0.0, 1.0)) * max(c.gain_s, 0.0)
        return float(np.hypot(c.se_s, missed))

    def net(self, c: Priced, miss: float) -> float:
        """`net(c)`, seconds over its horizon (module docstring)."""
        if c.exit:
            return c.gain_s * c.horizon - c.switch_s
        return self.credit(c, miss) * c.horizon - (1.0 + self.margin) * c.switch_s

    def skip_replan(self) -> bool:
        """Consume one backed-off re-plan; True if this one is skipped."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    # ------------------------------------------------------------------ helpers
    def _learn(self, kind: str, ev: Evidence) -> None:
        """Rule 1: the share delivered, against the clock's model figure or the promise."""
        predicted = ev.predicted_s if ev.source == "clock" else self.promised_s
        if ev.conclusive and predicted is not None and predicted > 0:
            share = float(np.clip(ev.saving_s / predicted, 0.0, 1.0))
            self.ratio[kind] = 0.5 * (self.ratio[kind] + share)

    def _adopt(self, c: Priced, reason: str, in_force: str | None, miss: float) -> Adopt:
        """Adopt `c`; its gain adds to the promise of the plan in force over static."""
        if in_force is None:
            self.promised_s = c.gain_s
        elif self.promised_s is not None:
            self.promised_s += c.gain_s
        return Adopt(reason, *self._figures(c, miss), plan=c.plan)

    def _figures(self, c: Priced, miss: float) -> tuple[float, float, float, float]:
        if c.exit:
            return c.gain_s * c.horizon, c.switch_s, 0.0, c.step_s
        doubt = t_critical(c.n_recent - 1) * self.noise(c, miss) * c.horizon
        return self.ratio[c.kind] * c.gain_s * c.horizon - doubt, c.switch_s, doubt, c.step_s

    def _says(self, verb: str, c: Priced, miss: float) -> str:
        per_step = self.credit(c, miss) * 1e3
        switch = (1.0 + self.margin) * c.switch_s * 1e3
        return (
            f"{verb}: {_named(c)} saves {per_step:.1f} ms/step over {c.horizon} steps, "
            f"switch {c.switch_s * 1e3:.0f} ms (x{1 + self.margin:g} = {switch:.0f} ms)"
        )

    # ------------------------------------------------------------------ learned state
    def state(self) -> dict[str, Any]:
        """What the controller learned, as plain values (checkpoints; the leader's broadcast)."""
        return {
            "ratio": dict(self.ratio),
            "promised_s": self.promised_s,
            "skip": self.skip,
            "next_backoff": self.next_backoff,
        }

    def restore(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        """Take back `state()`; one `ConfigError` naming `source` and the entry otherwise."""
        if set(state) != {"ratio", "promised_s", "skip", "next_backoff"}:
            raise ConfigError(f"unexpected entries {sorted(state)}", source=source, field="control")
        ratio = state["ratio"]
        if not isinstance(ratio, Mapping) or set(ratio) != set(KINDS):
            raise ConfigError(f"not a ratio per kind: {ratio!r}", source=source, field="ratio")
        ratios = {k: get_number(ratio, k, source, prefix="ratio.") for k in KINDS}
        for kind, v in ratios.items():
            if not 0 <= v <= 1:
                raise ConfigError(f"not in [0, 1]: {v!r}", source=source, field=f"ratio.{kind}")
        counts = [
            get_int(state, k, source, minimum=0, maximum=MAX_BACKOFF)
            for k in ("skip", "next_backoff")
        ]
        promised = None if state["promised_s"] is None else get_number(state, "promised_s", source)
        self.ratio, self.promised_s = ratios, promised
        self.skip, self.next_backoff = counts


def _named(c: Priced) -> str:
    """A candidate in a few words: `static`, `homes alone`, or its replicas and homes moved."""
    if c.exit:
        return "the static layout" if c.exit == "static" else "its homes alone"
    replicas = int(c.plan.placement.replicas().sum())
    moved = 0 if c.plan.transfers is None else len(c.plan.transfers.migrations)
    return f"{c.plan.policy} ({replicas} replicas, {moved} homes moved)"
