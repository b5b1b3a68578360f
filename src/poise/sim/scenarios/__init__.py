"""The published setups of the systems Poise compares with, replayed in the simulator.

Modules: `core` (types, traces), `replay` (the runner), `papers` (the six setups and their published
figures), `parm` and `smartmoe` (the scenarios that price their own rows: Parm's schedule grid,
SmartMoE's layout pool against FasterMoE's EP), `report` (markdown and JSON).

A `Scenario` is one paper's evaluation, reduced to what the simulator can model: a cluster
preset, a model shape, a routing trace recipe, the schedules the systems ran with, the policies
compared, and the published figures (copied from `docs/paper-figures.md`, with their source).
`run_scenario` replays every case with `simulate` and returns our figures beside theirs.

Conventions (the same in every scenario, so the rows can be read together):

- "speedup of X over Y" = mean step time of Y / mean step time of X (papers: time(Y) / time(X));
- each system is a policy under the schedule it ships with: FastMoE and DeepSpeed-MoE =
  `static` + `sync`; Tutel = `static` + `pipelined(4)`; FasterMoE = `shadow` + `pipelined(W/2)`
  (dynamic shadowing and smart scheduling both on, its default; W/2 stages on W devices, the
  artifact's groups of 2); SmartMoE = `permute` + `sync`
  where it is a baseline on plain EP (HybridEP's Table V), and its offline pool's layout in its
  own scenario (`smartmoe`);
  FlexMoE = `vexpert` + `sync`; Pro-Prophet = `prophet` + `prophet`; HybridEP = `hybrid` +
  `hybrid`;
- every run of a scenario (one schedule) replays the *same* trace under every registered policy,
  `auto` included, so `auto` is checked against all of them under each schedule; `auto`'s
  figure beside a system's is `auto` under that system's schedule over the same baseline;
- the first `warmup` steps (default: the first re-planning interval, whose plan was made before
  any load was observed, so that every policy plans on uniform loads) are replayed but left out
  of the means, as the papers report steady-state iteration times;
- planning runs in the background (`simulate(background_planning=True)`: a planner beside
  training, as the runtime's `Balancer` runs it; each plan takes effect at the first step after
  its planning time has run, the next at the earliest, the same for every policy) and the wall
  time it does not hide (a re-plan that comes before the previous plan is ready) is
  charged (`count_planning=True`: the papers' iteration times include their planners) unless a
  scenario says otherwise and why; `checks` report `auto` both ways whatever the setting.

`ScenarioResult.rows` has one row per published figure (`Row`); `checks` has, for every case and
run, `auto`'s mean step time beside the fastest other policy's, with and without planning time.
"""

from __future__ import annotations

from poise.sim.scenarios.core import (
    Case,
    Check,
    Figure,
    Row,
    Run,
    Scenario,
    ScenarioResult,
    TraceRecipe,
    build_trace,
    find_shared_data,
)
from poise.sim.scenarios.papers import (
    HYBRIDEP_PUBLISHED,
    HYBRIDEP_TABLE_V,
    PROPHET_TABLE_IV,
    PROPHET_TABLE_V,
    SCENARIOS,
    get_scenario,
    hybridep_spec,
    prophet_spec,
)
from poise.sim.scenarios.replay import paired_gap_se, run_scenario, step_times
from poise.sim.scenarios.report import markdown_table, results_json
from poise.sim.scenarios.smartmoe import smartmoe_spec

__all__ = [
    "HYBRIDEP_PUBLISHED",
    "HYBRIDEP_TABLE_V",
    "PROPHET_TABLE_IV",
    "PROPHET_TABLE_V",
    "SCENARIOS",
    "Case",
    "Check",
    "Figure",
    "Row",
    "Run",
    "Scenario",
    "ScenarioResult",
    "TraceRecipe",
    "build_trace",
    "find_shared_data",
    "get_scenario",
    "hybridep_spec",
    "markdown_table",
    "paired_gap_se",
    "prophet_spec",
    "results_json",
    "run_scenario",
    "smartmoe_spec",
    "step_times",
]
