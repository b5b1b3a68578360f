"""Parm (INFOCOM 2024) as a scenario row: its automatic S1/S2 choice over DeepSpeed-MoE's
schedule on the 1,296-layer grid of `poise.sim.parm_grid`, beside the published 1.13-5.77x.

Parm is not a placement policy replayed on a routing trace, so this scenario does not go through
`run_scenario`'s `simulate` loop: `run_parm` prices the grid with the event model and builds the
`ScenarioResult` itself (no cases, runs or `auto` checks). Two rows per testbed: the smallest
and the largest speedup of the chosen schedule over the baseline, against the two ends of the
published range. The `auto` column holds the oracle (the faster of S1 and S2 under the event
model), since Poise's `auto` policy has no part in Parm's choice.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from poise.layouts.parm import SCHEDULES
from poise.sim.parm_grid import PARM_CLUSTERS, PUBLISHED_SPEEDUP, grid_size, run_grid
from poise.sim.scenarios.core import Figure, Row, Scenario, ScenarioResult

SOURCE = "paper-figures.md §7: Parm (arXiv 2407.00599) abstract, 1.13-5.77× on 1,296 layers"
SYSTEM = ("parm", "choice")
BASELINE = (("parm", "baseline"),)


def parm_scenario() -> Scenario:
    """The scenario's description (its figures are computed by `run_parm`)."""
    low, high = PUBLISHED_SPEEDUP
    text = f"{low:g}-{high:g}× (range)"
    figures = (
        Figure("Parm (auto S1/S2) vs DeepSpeed-MoE, min", SYSTEM, BASELINE, low, text, SOURCE),
        Figure("Parm (auto S1/S2) vs DeepSpeed-MoE, max", SYSTEM, BASELINE, high, text, SOURCE),
    )
    # `run_scenario` hands a scenario with a `runner` to it (once core.Scenario has the field)
    runner = {"runner": run_parm} if "runner" in Scenario.__dataclass_fields__ else {}
    return Scenario(
        **runner,  # type: ignore[arg-type]
        name="parm",
        paper="Parm: dedicated schedules for MP+EP+ESP (INFOCOM 2024, arXiv 2407.00599)",
        assumed=(
            "the grid's value sets and both testbeds' hardware: the paper's tables and testbed "
            "details could not be read (abstract only)"
        ),
        summary="1,296 MoE layers per testbed (B, L, M, H/M, E, k, f, N_MP = N_ESP; "
        "`poise.sim.parm_grid`) on `parm-8gpu` (one server of 8 GPUs on PCIe) and `parm-32gpu` "
        "(8 nodes of 4 GPUs, one 100 Gb/s NIC per node); each layer priced under DeepSpeed-MoE's "
        "schedule, S1 and S2 by the event model (`poise.sim.parm_events`), the schedule chosen "
        "by Parm's alpha-beta condition (`poise.layouts.parm.choose_schedule`)",
        cases=(),
        runs=(),
        figures=figures,
        count_planning=False,
        planning_note="no planner: the choice is made once per layer before training",
        notes=(
            "The auto column is the oracle (the faster of S1 and S2 under the event model).",
            "The grid's value sets and the two clusters are ours: the paper's tables could not "
            "be read; S2 is modelled as a unified all-to-all over all ranks "
            "(see poise.layouts.parm).",
        ),
    )


def run_parm(quick: bool = False, data: Path | None = None) -> ScenarioResult:
    """Price the grid on both testbeds and build the rows (`quick`: the reduced grid; `data`,
    the shared data folder, is not used: the grid needs no trace)."""
    started = time.perf_counter()
    scenario = parm_scenario()
    rows: list[Row] = []
    means: dict[str, dict[str, dict[str, float]]] = {}
    notes: dict[str, str] = {}
    for name, cluster in PARM_CLUSTERS.items():
        result = run_grid(cluster, quick=quick)
        choice, oracle = result.speedup("choice"), result.speedup("oracle")
        means[name] = {s: {"mean_layer_s": float(np.mean(result.truth_s[s]))} for s in SCHEDULES}
        notes[name] = (
            f"{name}: {result.configs} layers, choice right on {result.choice_accuracy:.0%} "
            f"(picked s1 {int((result.chosen == 's1').sum())}, s2 "
            f"{int((result.chosen == 's2').sum())})"
        )
        for figure, agg in zip(scenario.figures, (np.min, np.max), strict=True):
            rows.append(
                Row(
                    scenario=scenario.name,
                    setup=f"{name}, {agg.__name__} over {result.configs} layers",
                    comparison=figure.label,
                    ours=float(agg(choice)),
                    auto=float(agg(oracle)),
                    published=figure.published,
                    published_text=figure.published_text,
                    source=figure.source,
                    cases=[name],
                )
            )
    return ScenarioResult(
        scenario=scenario,
        rows=rows,
        checks=[],
        means=means,
        wall_s=time.perf_counter() - started,
        quick=quick,
        trace_notes={"grid": f"no trace: a grid of {grid_size(quick)} layers per cluster"} | notes,
    )
