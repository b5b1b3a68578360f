"""Measured training runs as `poise train` writes them, and whether two runs' losses agree.

    run = MeasuredRun.load("poise-out/train-static")

`MeasuredRun.load` reads a run folder (`config.yaml`, `metrics.jsonl`, `summary.json`,
`trace.npz`); `loss_agreement` and `agreement_sentence` compare two runs' losses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from poise.core.errors import ConfigError
from poise.util.yaml_load import load_yaml

# Two runs of the same seed are the same computation until one of them changes its plan: their
# losses then agree to fp32 rounding (in practice exactly). After a plan change the runs sum
# expert outputs and gradients in another order, and training amplifies those rounding
# differences (a near-tied top-1 router choice can flip within a few steps), so two curves can
# no longer tell a change of mathematics from a change of summation order: the equivalence
# tests (`tests/test_balancer_equivalence.py` and the training tests) check that exactly.
LOSS_AGREEMENT_TOL = 1e-5


# ------------------------------------------------------------------------------ measured runs
def _last_probed_evidence(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The last logged evidence on the plan in force with a paired clock's reading from probe
    steps (`Evidence.as_dict`; empty if none)."""
    for r in reversed(records):
        evidence = r.get("evidence") or {}
        if (evidence.get("probes") or 0) > 0:
            return dict(evidence)
    return {}


def _decisions(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Balancer's decisions as logged (one per re-plan that was decided): `step`,
    `decision` (the controller's: adopt, keep, revert) and its `reason`, the replica slots in
    force after it (`replicas`, summed over layers) and the homes it moved."""
    return [
        {
            "step": int(r["step"]),
            "decision": str(r["decision"]),
            "reason": str(r.get("reason", "")),
            "replicas": int(sum(r.get("replicas") or [])),
            "moved_homes": int(r.get("moved_homes") or 0),
        }
        for r in records
        if r.get("decision")
    ]


def _switch_steps(records: list[dict[str, Any]]) -> list[int]:
    """The step boundaries at which the run put another plan in force (`switched` as logged;
    `plan_changed` for runs written before it was), in order."""
    return [int(r["step"]) for r in records if r.get("switched") or r.get("plan_changed")]


@dataclass
class MeasuredRun:
    """One `poise train` output folder. Arrays are per logged step `[S]` unless noted.

    `device_tokens[S, L, D]`: token-expert pairs each rank computed per MoE layer (under the plan
    in force); `phases[name][S]`: rank 0's seconds per step phase (data, forward, backward,
    grad_sync, balance, clip, optimizer); `moe_phases[name][S]`: rank 0's seconds inside the MoE
    layers and the balancer (gate, dispatch, experts, combine: forward only; transfers, plan);
    `bytes_moved[S]`: Trans + Agg + migration bytes (all ranks) at each step boundary;
    `last_evidence`: the last logged evidence with a paired clock's reading (`Evidence.as_dict`:
    `clock_s`, `clock_se_s`, `probes`, `modelled_clock_s`), empty if none; `decisions`:
    the Balancer's decisions in order (`_decisions`), empty for static; `switches`: the steps
    after whose loss another plan took effect (`_switch_steps`), empty for static;
    `probe_steps[S]`: whether the step was a probe step (all False for
    static); `layouts[S]`: what each step ran under (`poise.runtime.records.LAYOUT_NAMES`;
    "" where the run did not log it)."""

    policy: str
    path: Path
    steps: np.ndarray
    losses: np.ndarray
    step_s: np.ndarray
    tokens_per_step: int
    tokens_per_s: float
    device_tokens: np.ndarray
    phases: dict[str, np.ndarray]
    moe_phases: dict[str, np.ndarray]
    bytes_moved: np.ndarray
    plan_changes: int
    val: list[tuple[int, float]]
    config: dict[str, Any]
    world_size: int
    trace_path: Path | None
    last_evidence: dict[str, Any] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    switches: list[int] = field(default_factory=list)
    probe_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    layouts: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> MeasuredRun:
        """Read a run folder; a missing or unreadable file is one `ConfigError` naming it."""
        path = Path(path)
        metrics = path / "metrics.jsonl"
        records = []
        try:
            for line in metrics.read_text().splitlines():
                if line.strip():
                    records.append(json.loads(line))
            summary = json.loads((path / "summary.json").read_text())
            config = load_yaml((path / "config.yaml").read_text()) or {}
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ConfigError(
                f"cannot read the training run: {exc}", source=str(path), field="run"
            ) from None
        if not records:
            raise ConfigError("no steps logged", source=str(metrics), field="metrics")
        phase_names = list(records[0].get("phases_s", {}))
        moe_names = sorted({k for r in records for k in r.get("moe_s", {})})
        trace = path / "trace.npz"
        return cls(
            policy=str(config.get("policy", summary.get("policy", path.name))),
            path=path,
            steps=np.array([r["step"] for r in records], dtype=np.int64),
            losses=np.array([r["loss"] for r in records], dtype=float),
            step_s=np.array([r["step_s"] for r in records], dtype=float),
            tokens_per_step=int(records[0].get("tokens", summary.get("tokens_per_step", 0))),
            tokens_per_s=float(summary.get("tokens_per_s", 0.0)),
            device_tokens=np.array([r.get("device_tokens", []) for r in records], dtype=float),
            phases={k: np.array([r["phases_s"].get(k, 0.0) for r in records]) for k in phase_names},
            moe_phases={
                k: np.array([r.get("moe_s", {}).get(k, 0.0) for r in records]) for k in moe_names
            },
            bytes_moved=np.array(
                [
                    r.get("trans_bytes", 0) + r.get("agg_bytes", 0) + r.get("migrate_bytes", 0)
                    for r in records
                ],
                dtype=float,
            ),
            plan_changes=int(summary.get("plan_changes", records[-1].get("plan_changes", 0))),
            val=[(int(s), float(v)) for s, v in summary.get("val", [])],
            config=config,
            world_size=int(summary.get("world_size", 1)),
            trace_path=trace if trace.is_file() else None,
            last_evidence=_last_probed_evidence(records),
            decisions=_decisions(records),
            switches=_switch_steps(records),
            probe_steps=np.array([bool(r.get("probe")) for r in records], dtype=bool),
            layouts=[str(r.get("layout") or "") for r in records],
        )

    def warm(self) -> slice:
        """The measured steps: the first `min(3, S // 4)` are warm-up (as `TrainResult`)."""
        return slice(min(3, len(self.step_s) // 4), None)

    @property
    def median_step_s(self) -> float:
        return float(np.median(self.step_s[self.warm()]))

    @property
    def max_over_mean(self) -> float:
        """Slowest rank's load over the mean rank load, averaged over layers and steps."""
        x = self.device_tokens
        if x.ndim != 3 or x.size == 0:
            return 1.0
        mean = x.mean(axis=2)
        return float(
            np.mean(np.divide(x.max(axis=2), mean, out=np.ones_like(mean), where=mean > 0))
        )

    def moe_phase_mean(self, name: str) -> float:
        """Mean seconds per measured step of one `moe_phases` entry (0 when not logged)."""
        series = self.moe_phases.get(name)
        return float(series[self.warm()].mean()) if series is not None else 0.0

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per measured step by phase (rank 0), `_s` suffixed for the plots."""
        w = self.warm()
        return {f"{k}_s": float(v[w].mean()) for k, v in self.phases.items()}


@dataclass(frozen=True)
class LossAgreement:
    """How two loss curves of the same seed compare at the steps both logged.

    `first_switch`: the first step after whose loss either run put another plan in force (None
    if neither did). The steps up to it (`judged_steps`, largest difference `judged_max`) are the
    same computation in both runs and must agree to `LOSS_AGREEMENT_TOL`; after it the curves
    are described, not judged: `first_above` is the first step whose difference exceeds the
    tolerance (None if none), `max_diff` the largest over all steps (at `max_step`), `last_diff`
    the one at the last common step; `val` the last validation losses (NaN when not measured)."""

    steps: int
    max_diff: float
    max_step: int
    last_diff: float
    first_switch: int | None
    judged_steps: int
    judged_max: float
    first_above: int | None
    first_above_diff: float
    val: tuple[float, float]

    @property
    def judged(self) -> bool:
        """Whether any common step precedes every plan change, so agreement can be judged."""
        return self.judged_steps > 0

    @property
    def agrees(self) -> bool:
        """Equal to rounding over the steps that are the same computation in both runs."""
        return self.judged and self.judged_max <= LOSS_AGREEMENT_TOL


def _first_switch(a: MeasuredRun, b: MeasuredRun) -> int | None:
    firsts = [r.switches[0] for r in (a, b) if r.switches]
    return min(firsts) if firsts else None


def loss_agreement(a: MeasuredRun, b: MeasuredRun) -> LossAgreement:
    """Compare two runs' losses (`LossAgreement`); the steps up to the first plan change of
    either run are judged, the rest described."""
    common, ia, ib = np.intersect1d(a.steps, b.steps, return_indices=True)
    nan = float("nan")
    va = a.val[-1][1] if a.val else nan
    vb = b.val[-1][1] if b.val else nan
    switch = _first_switch(a, b)
    if len(common) == 0:
        return LossAgreement(0, nan, 0, nan, switch, 0, nan, None, nan, (va, vb))
    diff = np.abs(a.losses[ia] - b.losses[ib])
    judged = int(np.sum(common <= switch)) if switch is not None else len(common)
    above = np.flatnonzero(diff > LOSS_AGREEMENT_TOL)
    return LossAgreement(
        steps=len(common),
        max_diff=float(diff.max()),
        max_step=int(common[int(diff.argmax())]),
        last_diff=float(diff[-1]),
        first_switch=switch,
        judged_steps=judged,
        judged_max=float(diff[:judged].max()) if judged else nan,
        first_above=int(common[above[0]]) if len(above) else None,
        first_above_diff=float(diff[above[0]]) if len(above) else nan,
        val=(va, vb),
    )


def _departure(ag: LossAgreement) -> str:
    """What the curves do after the first plan change, in words (no judgement)."""
    where = "After that plan change, "
    if ag.first_above is None:
        return (
            where + f"only the order in which expert outputs and gradients are summed differs; "
            f"the curves stay within {LOSS_AGREEMENT_TOL:.0e} over all {ag.steps} steps "
            f"(largest difference {ag.max_diff:.2e})."
        )
    after = ag.first_above - ag.first_switch if ag.first_switch is not None else 0
    return (
        where + f"expert outputs and gradients are summed in another order. The curves leave "
        f"rounding at step {ag.first_above}, {after} step{'s' if after != 1 else ''} later "
        f"({ag.first_above_diff:.2e}), and the difference grows to {ag.max_diff:.2e} (step "
        f"{ag.max_step}; {ag.last_diff:.2e} at the last step): training amplifies rounding "
        f"differences, and one flipped near-tied router choice is enough. Two curves cannot tell "
        f"that from a change of mathematics; the equivalence tests check it exactly."
    )


def agreement_sentence(ag: LossAgreement, a: str, b: str) -> str:
    """The report's statement about two loss curves of the same seed."""
    if ag.steps == 0:
        return f"The {a} and {b} runs share no logged step, so their losses cannot be compared."
    until = (
        f"over the {ag.judged_steps} steps up to the first plan change (after step "
        f"{ag.first_switch})"
        if ag.first_switch is not None
        else f"over all {ag.steps} steps (neither run changed its plan)"
    )
    if not ag.judged:
        head = (
            f"A plan changed before the {a} and {b} runs' first common step, so no step is "
            f"the same computation in both and agreement cannot be judged from the curves."
        )
    elif not ag.agrees:
        return (
            f"The {a} and {b} loss curves differ by {ag.judged_max:.2e} nats/byte {until}, "
            f"where both runs are the same computation and must agree to rounding (tolerance "
            f"{LOSS_AGREEMENT_TOL:.0e}): something other than a plan changed the training. "
            f"Largest difference {ag.max_diff:.2e} (step {ag.max_step})."
        )
    else:
        head = (
            f"The {a} and {b} loss curves agree to float rounding {until}, where both runs are "
            f"the same computation: the largest difference is {ag.judged_max:.2e} nats/byte."
        )
    tail = "" if ag.first_switch is None else " " + _departure(ag)
    if np.isfinite(ag.val[0]) and np.isfinite(ag.val[1]):
        tail += f" Final validation loss: {ag.val[0]:.4f} ({a}) and {ag.val[1]:.4f} ({b})."
    return head + tail


__all__ = [
    "LOSS_AGREEMENT_TOL",
    "LossAgreement",
    "MeasuredRun",
    "agreement_sentence",
    "loss_agreement",
]
