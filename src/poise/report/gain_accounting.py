"""Where the ideal's gain went: one round of static and auto, step by step, in shares.

The ideal (`poise.report.ideal`) credits static's step s with `excess[s] = c * sum_l
(slow[s, l] - mean[s, l])`, the expert seconds perfect, free balance would save. Auto ran the
same steps in the same turns, so per measured step

    achieved[s] = step_static[s] - step_auto[s]
    lost[s]     = excess_static[s] - achieved[s]

and over the steps `G = sum_s excess_static[s]`, the ideal's gain in seconds. Each step of the
auto run is charged to one cause, the first that applies:

- `probe_steps`: the guard's probe steps (the plan's homes without its replicas, for the
  paired clock: `poise.runtime.probe_steps`);
- `switch_steps`: the steps whose boundary put another plan in force (migration, re-lay, the
  new replicas' first Trans);
- `static_layout`: the steps run on the static layout (the warm-up, the re-plans the guard
  refused, the steps after a fallback to it), as each step's `layout` in `metrics.jsonl` says;
  for a run that did not log it, the steps before its first switch;
- every other step, under a plan, splits its loss three ways:
  `residual_imbalance`, auto's own excess at `c` (what its layout left unbalanced);
  `transfers`, the replicas' Trans and Agg inside forward and backward and its `balance`
  phase beyond static's (what it paid to move weights and gradients, as `shed_pairs_worth`
  counts them);
  `other`, the rest: what shedding pairs cost beyond those (the busy neighbour, the split's
  dispatch, the all-to-all's other routes: `shed_pairs_worth`'s premise below 1), and the
  machine's noise, which pairs of steps in turns leave small over tens of steps.

`achieved` plus the six losses is 1 (each a share of `G`, by construction). These are
seconds: the gain fraction of tokens per second, `(S/A - 1) / (S/I - 1)` with `S`, `A`, `I` the
summed static, auto and ideal steps, is `achieved * I / A`, within a few per cent of it where
auto's steps are near the ideal's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.report.ideal import expert_pairs, measured_steps, phase_seconds, step_pairs

CAUSES = (
    "static_layout",
    "probe_steps",
    "switch_steps",
    "residual_imbalance",
    "transfers",
    "other",
)


def gain_accounting(
    static: Any, auto: Any, c_s: float, skip: int, cores: float = 0.0
) -> dict[str, Any]:
    """The shares of the ideal's gain that auto `achieved` and lost by cause (module
    docstring) over the steps after `skip`, `c_s` seconds a pair, ranks sharing `cores` (0:
    none); `ideal_gain_ms`, `G` per step. `static`, `auto`: `MeasuredRun`s of one round, the
    same steps (`step_s[S]`, `device_tokens[S, L, D]`, `phases["balance"]`, `moe_phases`,
    `steps`); `auto` also `probe_steps[S]` (bool), `switches` (the step numbers whose
    boundary switched) and `layouts[S]` (names, or empty). Shares are None where the ideal
    gains nothing."""
    w = measured_steps(static.step_s, skip)
    step_s = np.asarray(static.step_s, dtype=float)[w]
    step_a = np.asarray(auto.step_s, dtype=float)[w]
    if step_s.shape != step_a.shape:
        raise ValueError(f"the runs' steps differ: {step_s.shape} against {step_a.shape}")
    slow_s, mean_s = expert_pairs(step_pairs(static, w), cores)
    slow_a, mean_a = expert_pairs(step_pairs(auto, w), cores)
    excess = c_s * (slow_s - mean_s)
    lost = excess - (step_s - step_a)
    numbers = np.asarray(auto.steps)[w]
    switches = np.asarray(auto.switches, dtype=np.int64)
    probe = np.asarray(auto.probe_steps, dtype=bool)[w]
    switch = np.isin(numbers, switches) & ~probe
    layouts = list(getattr(auto, "layouts", []))
    if len(layouts) == len(auto.step_s) and all(layouts):
        static_layout = np.asarray(layouts, dtype=object)[w] == "static"
    else:  # not logged: the steps before the first switch
        first = switches.min() if switches.size else np.inf
        static_layout = numbers < first
    static_layout &= ~(probe | switch)
    under = ~(static_layout | probe | switch)
    transfers = phase_seconds(auto, "moe_phases", "transfers_in_compute", w)
    transfers = transfers + phase_seconds(auto, "phases", "balance", w)
    transfers = transfers - phase_seconds(static, "phases", "balance", w)
    residual = c_s * (slow_a - mean_a)
    seconds = {
        "static_layout": lost[static_layout].sum(),
        "probe_steps": lost[probe].sum(),
        "switch_steps": lost[switch].sum(),
        "residual_imbalance": residual[under].sum(),
        "transfers": transfers[under].sum(),
        "other": (lost - residual - transfers)[under].sum(),
    }
    total = float(excess.sum())

    def share(x: float) -> float | None:
        return round(float(x) / total, 3) if total > 0 else None

    return {
        "ideal_gain_ms": round(total / len(excess) * 1e3, 2),
        "achieved": share((step_s - step_a).sum()),
        "lost": {k: share(v) for k, v in seconds.items()},
        "steps": {
            "static_layout": int(static_layout.sum()),
            "probe_steps": int(probe.sum()),
            "switch_steps": int(switch.sum()),
            "under_plans": int(under.sum()),
        },
    }


def accounting_rows(account: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Where the ideal's gain went (`poise.report.gain_accounting`) as table rows `(where,
    share of the ideal's gain, steps)`: what auto kept, then each cause."""
    lost, steps = account["lost"], account["steps"]
    names = {
        "static_layout": ("lost on the static layout", steps.get("static_layout")),
        "probe_steps": ("lost on probe steps (the homes without the replicas)",
                        steps.get("probe_steps")),
        "switch_steps": ("lost on switch steps", steps.get("switch_steps")),
        "residual_imbalance": ("lost to imbalance the plans left", steps.get("under_plans")),
        "transfers": ("lost to the replicas' Trans and Agg", steps.get("under_plans")),
        "other": ("lost to what shedding pairs costs beyond those, and noise",
                  steps.get("under_plans")),
    }  # fmt: skip
    rows = [("kept by auto", f"{account['achieved']:.0%}", "")]
    for key in CAUSES:
        label, n = names[key]
        rows.append((label, f"{lost[key]:.0%}", "" if n is None else str(n)))
    return rows


__all__ = ["CAUSES", "accounting_rows", "gain_accounting"]
