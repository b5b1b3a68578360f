"""Scenario data types, trace recipes (`build_trace`) and the sweeps of the generated traces'
skew and seeds (`with_zipf_s`, `with_seed_shift`); `replay` replays a scenario's cases."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.presets import get_cluster
from poise.core.spec import ModelSpec
from poise.trace.trace import Trace

MB = 1e6  # HybridEP's sizes are decimal megabytes
SMARTMOE_SAMPLE = "smartmoe-ae-sample"
SMARTMOE_SAMPLE_RANKS = 16  # the sample's ranks (a generated stand-in has as many rows)
DRIFT = {"s": 1.0, "rate": 0.05}  # the generated traces' Zipf skew and per-step drift

Progress = Callable[[str, int, int], None]  # (what, done, total)


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class TraceRecipe:
    """How a case's routing trace is made.

    `kind="generate"`: `trace.generate.generate(generator, ...)` with the model's experts, top-k,
    layers and tokens per device, on `devices` source rows (None: the cluster's devices; fewer are
    resampled onto the cluster by the simulator), `params` (default `DRIFT`) and `seed`.

    `kind="smartmoe"`: the SmartMoE-AE sample (`load_any`), the iterations `snapshots`, each
    replayed `hold` steps in a row (the sample has three snapshots, 1,000 and 4,000 iterations
    apart; holding one for a few steps models loads that drift slowly between them), layers cut
    to the model's MoE layers; resampled onto the cluster's devices by the simulator."""

    kind: str = "generate"
    steps: int = 40
    quick_steps: int = 20
    generator: str = "drift"
    params: tuple[tuple[str, float], ...] = tuple(DRIFT.items())
    devices: int | None = None
    seed: int = 0
    snapshots: tuple[int, ...] = ()
    hold: int = 1

    def describe(self, quick: bool) -> str:
        steps = self.quick_steps if quick else self.steps
        if self.kind == "smartmoe":
            its = ", ".join(str(s) for s in self.snapshots)
            return (
                f"SmartMoE-AE sample, iterations {its}, each held {self.hold} steps "
                f"({self.steps_for(quick)} steps)"
            )
        params = ", ".join(f"{k}={v:g}" for k, v in self.params)
        rows = f", {self.devices} source rows resampled" if self.devices else ""
        return f"generated {self.generator}({params}), {steps} steps, seed {self.seed}{rows}"

    def steps_for(self, quick: bool) -> int:
        if self.kind == "smartmoe":
            return len(self.snapshots) * self.hold
        return self.quick_steps if quick else self.steps


# FasterMoE's smart schedule as its artifact runs it: workers exchange in groups of 2
# (fastermoe-ae scripts/runme.sh: FMOE_FUSE_GRAN=2, the group size later named
# FMOE_FASTER_GROUP_SIZE), and a layer pipelines over the W / 2 groups (fastmoe's smart schedule:
# n_groups = world_size / pipeline_gran). A run's schedule names it; `case_schedule` resolves it.
FASTERMOE_PIPELINE = "pipelined(W/2)"


def case_schedule(schedule: str, cluster: Cluster) -> str:
    """`schedule` on `cluster`: `FASTERMOE_PIPELINE` becomes pipelined(D / 2) for its D
    devices (at least 1 stage); any other schedule is returned as it is."""
    if schedule == FASTERMOE_PIPELINE:
        return f"pipelined({max(1, cluster.num_devices // 2)})"
    return schedule


@dataclass(frozen=True)
class Run:
    """One `simulate` call per case: a schedule and the policies it must include. `options`:
    per-policy settings of this call (`simulate`'s `options`); `key`: the name figures use for
    this run (default: the schedule), for two runs of one schedule with different options."""

    schedule: str
    policies: tuple[str, ...]
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    key: str = ""

    @property
    def name(self) -> str:
        return self.key or self.schedule


@dataclass(frozen=True)
class Figure:
    """A published figure and how to compute ours.

    `system` and each of `baselines` are `(schedule, policy)`; ours = mean step time of the
    baselines (averaged, as HybridEP's "avg. speedup") / that of the system. `cases`: the case
    labels it covers (empty: all); `aggregate`: `one` (a single case), `max` ("up to") or `mean`
    ("on average") over the cases' speedups. `published` is the number; `published_text` how the
    paper states it."""

    label: str
    system: tuple[str, str]
    baselines: tuple[tuple[str, str], ...]
    published: float | None
    published_text: str
    source: str
    cases: tuple[str, ...] = ()
    aggregate: str = "one"
    assumed: str = ""  # what this figure's set-up assumes beyond its scenario's ("": nothing)


@dataclass(frozen=True)
class Case:
    """One configuration of a scenario: label, cluster preset, model, trace."""

    label: str
    cluster: str
    spec: ModelSpec
    trace: TraceRecipe
    cluster_obj: Cluster | None = None  # a cluster not among the presets (Pro-Prophet's LPWNV)

    def get_cluster(self) -> Cluster:
        return self.cluster_obj if self.cluster_obj is not None else get_cluster(self.cluster)


@dataclass(frozen=True)
class Scenario:
    """A paper's setup: cases x runs, the figures to compare, and the replay settings."""

    name: str
    paper: str
    summary: str
    cases: tuple[Case, ...]
    runs: tuple[Run, ...]
    figures: tuple[Figure, ...]
    replan_every: int = 10
    predictor: str = "ema"
    warmup: int | None = None  # None: replan_every
    count_planning: bool = True
    background_planning: bool = True
    planning_note: str = (
        "planning beside training (each plan takes effect once its planning time has run, the "
        "step after at the earliest; a re-plan due before then is skipped, so a planner slower "
        "than the interval stretches it and no step waits for it)"
    )
    all_policies: bool = True
    # Each system as designed: the policies whose systems set no slot limit, bounded by device
    # memory alone (FasterMoE's shadows, HybridEP's gathered experts, Pro-Prophet's lightweight
    # placement: `poise.plan.memory_slots`); the others keep one spare slot per device. And the
    # policies that fix their plan before training (HybridEP's p, from its model on an even gate).
    memory_bound: tuple[str, ...] = ("shadow", "hybrid", "prophet", "vexpert", "auto")
    fixed_plans: tuple[str, ...] = ("hybrid",)
    # What the paper's times cover: "step", a whole training iteration (the MoE layers, the
    # dense compute and, every step, the dense parameters' gradient all-reduce across the
    # devices: `timed_spec`, `timed_dense_params`); "moe", the MoE layers alone (FasterMoE's
    # Fig. 13): no dense compute and no dense all-reduce.
    timed: str = "step"
    quick_cases: tuple[str, ...] = ()  # cases kept by --quick (empty: all)
    notes: tuple[str, ...] = ()
    # What the set-up assumes where its paper does not say ("": it follows the paper); the
    # fidelity score counts the rows of assumed set-ups apart (`fidelity.summarise`).
    assumed: str = ""
    # A scenario that is not a plain trace replay (Parm's schedule grid, SmartMoE's layouts)
    # computes its own result: `runner(quick, data)` replaces the replay loop of
    # `run_scenario` (`data`: the folder holding `smartmoe-ae-sample/`, or None).
    runner: Callable[[bool, Path | None], ScenarioResult] | None = None

    def __post_init__(self) -> None:
        if self.timed not in ("step", "moe"):
            raise ConfigError(
                f"timed must be 'step' or 'moe', got {self.timed!r}",
                source=self.name,
                field="timed",
            )

    @property
    def warmup_steps(self) -> int:
        """Steps left out of the means: by default up to the first plan made from observed
        loads, which takes effect at `replan_every` (one step later, at the earliest, when
        planning runs in the background)."""
        if self.warmup is not None:
            return self.warmup
        return self.replan_every + (1 if self.background_planning else 0)

    def cases_for(self, quick: bool) -> tuple[Case, ...]:
        if quick and self.quick_cases:
            return tuple(c for c in self.cases if c.label in self.quick_cases)
        return self.cases


@dataclass
class Row:
    """One line of the table: a published figure and ours."""

    scenario: str
    setup: str
    comparison: str
    ours: float
    auto: float
    published: float | None
    published_text: str
    source: str
    cases: list[str]
    per_case: dict[str, float] = field(default_factory=dict)
    per_case_auto: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """ours / published (None without a published number)."""
        if self.published is None or self.published <= 0:
            return None
        return self.ours / self.published

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio_to_published"] = self.ratio
        return d


@dataclass
class Check:
    """`auto` against the fastest other policy of one run (one case, one schedule), mean step
    seconds over the measured steps, both with the planning wall time charged as the schedule
    charges it (`Schedule.planning_s`: in full, or what the all-to-all does not hide under
    `prophet`) and without it (the cost model's time alone). The scenario's figures use the
    first when `count_planning`, else the second."""

    scenario: str
    case: str
    schedule: str
    count_planning: bool
    auto_charged_s: float
    best_charged: str
    best_charged_s: float
    auto_priced_s: float
    best_priced: str
    best_priced_s: float
    auto_planning_s: float  # mean planning seconds per measured step, as charged
    auto_chosen: list[str]  # the candidate auto kept per layer in its last plan
    # Standard error of (auto - fastest other), in the figures' column: see `paired_gap_se`.
    gap_se_s: float | None = None

    @property
    def gap_in_se(self) -> float | None:
        """auto's gap to the fastest other policy (figures' column) in standard errors; None
        with fewer than two re-planning windows or no spread."""
        if not self.gap_se_s:
            return None
        auto, best = (
            (self.auto_charged_s, self.best_charged_s)
            if self.count_planning
            else (self.auto_priced_s, self.best_priced_s)
        )
        return (auto - best) / self.gap_se_s

    @property
    def ratio_charged(self) -> float:
        return self.auto_charged_s / self.best_charged_s

    @property
    def ratio_priced(self) -> float:
        return self.auto_priced_s / self.best_priced_s

    @property
    def ratio(self) -> float:
        """auto / fastest other in the figures' column: charged when `count_planning`, else
        priced."""
        return self.ratio_charged if self.count_planning else self.ratio_priced

    @property
    def best(self) -> str:
        """The fastest other policy in the figures' column."""
        return self.best_charged if self.count_planning else self.best_priced

    @property
    def auto_fastest(self) -> bool:
        """What the scenario's figures see (`ratio`)."""
        return self.ratio <= 1.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio_charged"] = self.ratio_charged
        d["ratio_priced"] = self.ratio_priced
        d["auto_fastest"] = self.auto_fastest
        d["gap_in_se"] = self.gap_in_se
        return d


@dataclass
class ScenarioResult:
    scenario: Scenario
    rows: list[Row]
    checks: list[Check]
    means: dict[str, dict[str, dict[str, float]]]  # case -> schedule -> policy -> mean step s
    wall_s: float
    quick: bool
    trace_notes: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "name": s.name,
            "paper": s.paper,
            "summary": s.summary,
            "replan_every": s.replan_every,
            "predictor": s.predictor,
            "warmup_steps": s.warmup_steps,
            "count_planning": s.count_planning,
            "timed": s.timed,
            "planning_note": s.planning_note,
            "quick": self.quick,
            "wall_s": self.wall_s,
            "cases": {
                c.label: {
                    "cluster": c.cluster,
                    "devices": c.get_cluster().num_devices,
                    "model": dataclasses.asdict(c.spec),
                    "trace": self.trace_notes.get(c.label, c.trace.describe(self.quick)),
                }
                for c in s.cases_for(self.quick)
            },
            "rows": [r.as_dict() for r in self.rows],
            "checks": [c.as_dict() for c in self.checks],
            "mean_step_s": self.means,
            "notes": list(s.notes),
        }


# --------------------------------------------------------------------------- traces


def find_shared_data(explicit: str | Path | None = None) -> Path | None:
    """The folder holding `smartmoe-ae-sample/`: `explicit`, `$POISE_SHARED_DATA`,
    `../shared/data`, or the workspace's `shared/data` next to the repository. A folder named
    explicitly (`--data`) that lacks the sample is an error, never silently replaced by a
    generated trace."""
    if explicit is not None and str(explicit) != "":
        if not (Path(explicit) / SMARTMOE_SAMPLE).is_dir():
            what = "no such folder" if not Path(explicit).is_dir() else "no such sub-folder"
            raise ConfigError(
                f"{what}: expected {Path(explicit) / SMARTMOE_SAMPLE}/ (the SmartMoE-AE sample)",
                source=str(explicit),
                field="--data",
            )
        return Path(explicit)
    candidates = [
        os.environ.get("POISE_SHARED_DATA"),
        "../shared/data",
        str(Path(__file__).resolve().parents[3].parent / "shared" / "data"),
    ]
    for c in candidates:
        if c and (Path(c) / SMARTMOE_SAMPLE).is_dir():
            return Path(c)
    return None


def build_trace(case: Case, quick: bool, data: Path | None) -> tuple[Trace, str]:
    """The case's trace `[S, L, D0, E]` and one line saying what it is."""
    from poise.trace.generate import generate
    from poise.trace.importers import load_any

    r, spec = case.trace, case.spec
    if r.kind == "smartmoe":
        folder = data / SMARTMOE_SAMPLE if data is not None else None
        if folder is not None and folder.is_dir():
            sample = load_any(folder)
            index = {int(it): i for i, it in enumerate(sample.step_ids)}
            missing = [s for s in r.snapshots if s not in index]
            if missing:
                raise ConfigError(
                    f"iterations {missing} not in the sample (it has {sorted(index)})",
                    source=str(folder),
                    field="snapshots",
                )
            if sample.layers < spec.moe_layers or sample.experts != spec.experts:
                raise ConfigError(
                    f"sample has {sample.layers} layers x {sample.experts} experts; model "
                    f"{spec.name} needs {spec.moe_layers} x {spec.experts}",
                    source=str(folder),
                    field="model",
                )
            rows = [index[s] for s in r.snapshots for _ in range(r.hold)]
            counts = sample.counts[rows][:, : spec.moe_layers]
            trace = Trace(
                np.ascontiguousarray(counts),
                np.arange(len(rows), dtype=np.int64),
                sample.top_k,
                sample.tokens_per_device,
                name="smartmoe-ae-sample",
                meta={**sample.meta, "iterations": [int(sample.step_ids[i]) for i in rows]},
            )
            return trace, r.describe(quick) + f", first {spec.moe_layers} of {sample.layers} layers"
        # No sample: a generated trace of the same shape, said so in the setup.
        recipe = dataclasses.replace(
            r,
            kind="generate",
            steps=r.steps_for(quick),
            quick_steps=r.steps_for(quick),
            devices=SMARTMOE_SAMPLE_RANKS,
        )
        trace, text = build_trace(dataclasses.replace(case, trace=recipe), quick, None)
        return trace, f"SmartMoE-AE sample NOT FOUND; {text}"
    devices = r.devices or case.get_cluster().num_devices
    trace = generate(
        r.generator,
        steps=r.steps_for(quick),
        layers=spec.moe_layers,
        devices=devices,
        experts=spec.experts,
        top_k=spec.top_k,
        tokens_per_device=spec.tokens_per_device,
        seed=r.seed,
        **dict(r.params),
    )
    return trace, r.describe(quick)


# --------------------------------------------------------------------------- running


def with_zipf_s(scenario: Scenario, s: float) -> Scenario:
    """`scenario` with every generated trace's Zipf skew set to `s` (the skew sweep: rows built
    on generated traces move with it; replays of recorded routing do not)."""
    if not s > 0:
        raise ConfigError(f"must be > 0, got {s}", source=scenario.name, field="zipf_s")

    def skewed(case: Case) -> Case:
        if case.trace.kind != "generate":
            return case
        params = tuple((k, s if k == "s" else v) for k, v in case.trace.params)
        return dataclasses.replace(case, trace=dataclasses.replace(case.trace, params=params))

    return dataclasses.replace(scenario, cases=tuple(skewed(c) for c in scenario.cases))


def with_seed_shift(scenario: Scenario, shift: int) -> Scenario:
    """`scenario` with every generated trace's seed moved by `shift` (the seed sweep: whether
    the figures built on generated traces, and whether `auto` is the fastest policy, hold on
    other draws of those traces, not just the seeds the scenarios name). Replays of recorded
    routing (`kind="smartmoe"`) are unchanged, as is a scenario whose `runner` makes its own
    cases; 0 gives the scenario's own traces."""
    if shift < 0:
        raise ConfigError(f"must be >= 0, got {shift}", source=scenario.name, field="seed_shift")

    def shifted(case: Case) -> Case:
        if case.trace.kind != "generate":
            return case
        trace = dataclasses.replace(case.trace, seed=case.trace.seed + shift)
        return dataclasses.replace(case, trace=trace)

    return dataclasses.replace(scenario, cases=tuple(shifted(c) for c in scenario.cases))
