"""The published setups of the systems Poise compares with, replayed in the simulator.

A `Scenario` is one paper's evaluation, reduced to what the simulator can model: a cluster
preset, a model shape, a routing trace recipe, the schedules the systems ran with, the policies
compared, and the published figures (copied from `docs/paper-figures.md`, with their source).
`run_scenario` replays every case with `simulate` and returns our figures beside theirs.

Conventions (the same in every scenario, so the rows can be read together):

- "speedup of X over Y" = mean step time of Y / mean step time of X (papers: time(Y) / time(X));
- each system is a policy under the schedule it ships with: FastMoE and DeepSpeed-MoE =
  `static` + `sync`; Tutel = `static` + `pipelined(4)`; FasterMoE = `shadow` + `pipelined(4)`
  (dynamic shadowing and smart scheduling both on, its default); SmartMoE = `permute` + `sync`;
  FlexMoE = `vexpert` + `sync`; Pro-Prophet = `prophet` + `prophet`; HybridEP = `hybrid` +
  `hybrid`;
- every run of a scenario (one schedule) replays the *same* trace under every registered policy,
  `auto` included, so `auto` is checked against all of them under each schedule; `auto`'s
  figure beside a system's is `auto` under that system's schedule over the same baseline;
- the first `warmup` steps (default: the first re-planning interval, whose plan was made before
  any load was observed, so that every policy plans on uniform loads) are replayed but left out
  of the means, as the papers report steady-state iteration times;
- planning wall time is charged (`simulate(count_planning=True)`: the papers' iteration times
  include their planners) unless a scenario says otherwise and why; `checks` report `auto`
  both ways whatever the setting.

`ScenarioResult.rows` has one row per published figure (`Row`); `checks` has, for every case and
run, `auto`'s mean step time beside the fastest other policy's, with and without planning time.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from poise.errors import ConfigError
from poise.policies.base import REGISTRY, get_policy
from poise.sim.simulator import SimResult, simulate
from poise.spec import ModelSpec
from poise.topology import Cluster, get_cluster
from poise.trace import Trace

MB = 1e6  # HybridEP's sizes are decimal megabytes
SMARTMOE_SAMPLE = "smartmoe-ae-sample"
SMARTMOE_SAMPLE_RANKS = 16  # the sample's ranks (a generated stand-in has as many rows)
DRIFT = {"s": 1.0, "rate": 0.05}  # the generated traces' Zipf skew and per-step drift

Progress = Callable[[str, int, int], None]  # (what, done, total)


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class TraceRecipe:
    """How a case's routing trace is made.

    `kind="generate"`: `trace_generate.generate(generator, ...)` with the model's experts, top-k,
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


@dataclass(frozen=True)
class Run:
    """One `simulate` call per case: a schedule and the policies it must include."""

    schedule: str
    policies: tuple[str, ...]


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
    planning_note: str = (
        "planning wall time charged (the papers' iteration times include their planners)"
    )
    all_policies: bool = True
    quick_cases: tuple[str, ...] = ()  # cases kept by --quick (empty: all)
    notes: tuple[str, ...] = ()

    @property
    def warmup_steps(self) -> int:
        return self.replan_every if self.warmup is None else self.warmup

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

    @property
    def ratio_charged(self) -> float:
        return self.auto_charged_s / self.best_charged_s

    @property
    def ratio_priced(self) -> float:
        return self.auto_priced_s / self.best_priced_s

    @property
    def auto_fastest(self) -> bool:
        """What the scenario's figures see: charged when `count_planning`, else priced."""
        return (self.ratio_charged if self.count_planning else self.ratio_priced) <= 1.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio_charged"] = self.ratio_charged
        d["ratio_priced"] = self.ratio_priced
        d["auto_fastest"] = self.auto_fastest
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
    `../shared/data`, or the workspace's `shared/data` next to the repository."""
    candidates = [
        str(explicit) if explicit else None,
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
    from poise.trace_generate import generate
    from poise.trace_import import load_any

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


def _policies(scenario: Scenario, run: Run, figures: Sequence[Figure]) -> list[str]:
    names: list[str] = []
    if scenario.all_policies:
        get_policy("static")  # fills REGISTRY
        names.extend(sorted(REGISTRY))
    names.extend(run.policies)
    for f in figures:
        for sched, pol in (f.system, *f.baselines):
            if sched == run.schedule:
                names.append(pol)
    names.append("auto")
    return list(dict.fromkeys(names))


def step_times(result: SimResult, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """`(charged, priced)` seconds per step `[S]`: the cost model's step time with the planner's
    measured wall time charged as the schedule charges it, and without it (whatever
    `count_planning` the replay used)."""
    run = result.runs[policy]
    priced = run.step_s - run.plan_s
    a2a = 2.0 * (run.phases["dispatch_s"] + run.phases["combine_s"]).sum(axis=1)
    plan = np.array(
        [
            result.schedule.planning_s(float(w), float(a)) if w > 0 else 0.0
            for w, a in zip(run.plan_wall_s, a2a, strict=True)
        ]
    )
    return priced + plan, priced


def _window(x: np.ndarray, warmup: int) -> float:
    return float(x[min(warmup, len(x) - 1) :].mean())


def run_scenario(
    scenario: Scenario,
    *,
    quick: bool = False,
    data: str | Path | None = None,
    progress: Progress | None = None,
) -> ScenarioResult:
    """Replay every case of `scenario` under each of its runs and compute the figures."""
    started = time.perf_counter()
    data_dir = find_shared_data(data)
    cases = scenario.cases_for(quick)
    warmup = scenario.warmup_steps
    means: dict[str, dict[str, dict[str, float]]] = {}
    checks: list[Check] = []
    trace_notes: dict[str, str] = {}
    total = len(cases) * len(scenario.runs)
    done = 0
    for case in cases:
        trace, note = build_trace(case, quick, data_dir)
        trace_notes[case.label] = note
        cluster = case.get_cluster()
        means[case.label] = {}
        for run in scenario.runs:
            names = _policies(scenario, run, scenario.figures)
            what = f"{scenario.name}: {case.label}, {run.schedule}"
            if progress is not None:
                progress(what, done, total)
            result = simulate(
                trace,
                cluster,
                case.spec,
                names,
                run.schedule,
                scenario.replan_every,
                scenario.predictor,
                count_planning=scenario.count_planning,
            )
            charged, priced = {}, {}
            for n in names:
                c, p = step_times(result, n)
                charged[n], priced[n] = _window(c, warmup), _window(p, warmup)
            means[case.label][run.schedule] = charged if scenario.count_planning else priced
            checks.append(_check(scenario, case.label, run.schedule, result, charged, priced))
            done += 1
            if progress is not None:
                progress(what, done, total)
    rows = [_row(scenario, f, cases, means) for f in scenario.figures]
    rows = [r for r in rows if r is not None]
    return ScenarioResult(
        scenario=scenario,
        rows=rows,
        checks=checks,
        means=means,
        wall_s=time.perf_counter() - started,
        quick=quick,
        trace_notes=trace_notes,
    )


def _check(
    scenario: Scenario,
    case: str,
    schedule: str,
    result: SimResult,
    charged: dict[str, float],
    priced: dict[str, float],
) -> Check:
    others = [n for n in result.runs if n != "auto"]
    best_c = min(others, key=lambda n: charged[n])
    best_p = min(others, key=lambda n: priced[n])
    auto_plan = result.runs["auto"].last_plan
    chosen = list(auto_plan.notes.get("chosen", [])) if auto_plan is not None else []
    return Check(
        scenario=scenario.name,
        case=case,
        schedule=schedule,
        count_planning=scenario.count_planning,
        auto_charged_s=charged["auto"],
        best_charged=best_c,
        best_charged_s=charged[best_c],
        auto_priced_s=priced["auto"],
        best_priced=best_p,
        best_priced_s=priced[best_p],
        auto_planning_s=charged["auto"] - priced["auto"],
        auto_chosen=chosen,
    )


def _speedup(f: Figure, means: dict[str, dict[str, float]], system_policy: str) -> float:
    base = float(np.mean([means[s][p] for s, p in f.baselines]))
    return base / means[f.system[0]][system_policy]


def _row(
    scenario: Scenario,
    f: Figure,
    cases: Sequence[Case],
    means: dict[str, dict[str, dict[str, float]]],
) -> Row | None:
    labels = [c.label for c in cases if not f.cases or c.label in f.cases]
    if not labels:
        return None  # a --quick run left this figure's cases out
    ours = {c: _speedup(f, means[c], f.system[1]) for c in labels}
    auto = {c: _speedup(f, means[c], "auto") for c in labels}
    if f.aggregate == "max":
        o, a = max(ours.values()), max(auto.values())
        setup = f"max over {', '.join(labels)}" if len(labels) > 1 else labels[0]
    elif f.aggregate == "mean":
        o, a = float(np.mean(list(ours.values()))), float(np.mean(list(auto.values())))
        setup = f"mean over {', '.join(labels)}" if len(labels) > 1 else labels[0]
    else:
        o, a = ours[labels[0]], auto[labels[0]]
        setup = ", ".join(labels)
    return Row(
        scenario=scenario.name,
        setup=setup,
        comparison=f.label,
        ours=o,
        auto=a,
        published=f.published,
        published_text=f.published_text,
        source=f.source,
        cases=labels,
        per_case=ours,
        per_case_auto=auto,
    )


# --------------------------------------------------------------------------- the scenarios

FASTMOE = ("sync", "static")
DEEPSPEED = ("sync", "static")
TUTEL = ("pipelined(4)", "static")
FASTERMOE = ("pipelined(4)", "shadow")
SMARTMOE = ("sync", "permute")
FLEXMOE = ("sync", "vexpert")
PROPHET = ("prophet", "prophet")
HYBRIDEP = ("hybrid", "hybrid")


def _fastermoe() -> Scenario:
    src = "paper-figures.md §1: FasterMoE (PPoPP'22) §5.5, Fig. 13 (johnny)"
    # Table 2 (α = 2), 16 experts on 16 V100; top-2, fp32 and the per-rank batch (1,024 rows for
    # GPT, 2,048 for BERT) from the artifact's benchmark scripts.
    models = [
        ("MoE-GPT-S", 12, 1024, 1024),
        ("MoE-GPT-L", 12, 4096, 1024),
        ("MoE-BERT-Deep", 24, 1024, 2048),
        ("MoE-BERT-Deep-L", 24, 4096, 2048),
    ]
    cases = tuple(
        Case(
            name,
            "v100-ib50",
            ModelSpec(
                name.lower(),
                d_model=h,
                d_expert=2 * h,
                experts=16,
                top_k=2,
                moe_layers=layers,
                dtype_bytes=4,
                tokens_per_device=tokens,
            ),
            TraceRecipe(steps=40, quick_steps=20, seed=11),
        )
        for name, layers, h, tokens in models
    )
    figures = (
        Figure(
            "dynamic shadowing alone vs FastMoE",
            ("sync", "shadow"),
            (FASTMOE,),
            1.95,
            "up to 1.95×",
            src,
            aggregate="max",
        ),
        Figure(
            "smart scheduling alone vs FastMoE",
            ("pipelined(4)", "static"),
            (FASTMOE,),
            1.40,
            "up to 1.40×",
            src,
            aggregate="max",
        ),
        Figure(
            "shadowing + smart scheduling (FasterMoE) vs FastMoE",
            FASTERMOE,
            (FASTMOE,),
            2.20,
            "2.20× (max of Fig. 13)",
            src,
            aggregate="max",
        ),
    )
    return Scenario(
        name="fastermoe",
        paper="FasterMoE (He et al., PPoPP 2022)",
        summary="16 V100 (2 nodes, PCIe, one 50 Gb/s IB NIC per node: `v100-ib50`); MoE-GPT-S/L, "
        "MoE-BERT-Deep/-Deep-L (16 experts, top-2, fp32); FastMoE = static + sync",
        cases=cases,
        runs=(Run("sync", ("static", "shadow")), Run("pipelined(4)", ("static", "shadow"))),
        figures=figures,
        quick_cases=("MoE-GPT-S",),
    )


# Pro-Prophet Table III: (layers, d_model, FFN hidden); experts = GPUs.
PROPHET_MODELS = {
    "GPT-S": (12, 512, 1024),
    "GPT-M": (12, 1024, 2048),
    "GPT-L": (12, 2048, 4096),
    "GPT-DS": (24, 512, 1024),
    "GPT-DM": (24, 1024, 2048),
}
# Table IV (16 GPUs) and Table V (8 GPUs): (k, model) -> (FasterMoE, Pro-Prophet) vs DeepSpeed.
PROPHET_TABLE_IV = {
    (1, "GPT-S"): (1.63, 1.98),
    (1, "GPT-M"): (1.99, 2.22),
    (1, "GPT-L"): (1.62, 1.80),
    (1, "GPT-DS"): (1.34, 1.70),
    (1, "GPT-DM"): (1.68, 2.26),
    (2, "GPT-S"): (2.31, 2.62),
    (2, "GPT-M"): (1.82, 2.10),
    (2, "GPT-L"): (1.94, 2.23),
    (2, "GPT-DS"): (1.77, 1.94),
    (2, "GPT-DM"): (1.84, 2.07),
}
PROPHET_TABLE_V = {
    (1, "GPT-S"): (1.20, 1.30),
    (1, "GPT-M"): (1.02, 1.18),
    (1, "GPT-DS"): (1.12, 1.30),
    (1, "GPT-DM"): (0.96, 1.26),
    (2, "GPT-S"): (1.56, 1.91),
    (2, "GPT-M"): (1.29, 1.94),
    (2, "GPT-DS"): (1.44, 1.64),
    (2, "GPT-DM"): (1.25, 1.58),
}


def prophet_spec(model: str, top_k: int, experts: int, tokens_per_device: int) -> ModelSpec:
    """Pro-Prophet's MoE-GPT-* (Table III): every FFN an MoE layer, experts = GPUs; fp32 (it is
    built on the FasterMoE artifact, whose default is fp32)."""
    layers, d_model, hidden = PROPHET_MODELS[model]
    return ModelSpec(
        f"pro-prophet-{model.lower()}-k{top_k}",
        d_model=d_model,
        d_expert=hidden,
        experts=experts,
        top_k=top_k,
        moe_layers=layers,
        dtype_bytes=4,
        tokens_per_device=tokens_per_device,
    )


def lpwnv_cluster() -> Cluster:
    """Pro-Prophet's LPWNV: "same as HPWNV except GPU type": 2 nodes of 4 RTX 2080 Ti. The GEMM
    rate is the RTX 3090 preset's scaled by the cards' fp32 peak ratio (13.4 / 35.6 TFLOP/s),
    memory 11 GiB."""
    base = get_cluster("rtx3090-ib100:2")
    return dataclasses.replace(
        base,
        name="rtx2080ti-ib100:2",
        gemm_flops=base.gemm_flops * 13.4 / 35.6,
        memory_bytes=11 * 2**30,
    )


def _pro_prophet() -> Scenario:
    cases: list[Case] = []
    figures: list[Figure] = []
    tables = (
        ("IV", PROPHET_TABLE_IV, "rtx3090-ib100", None, 16, 16_384),
        ("V", PROPHET_TABLE_V, "rtx2080ti-ib100:2", lpwnv_cluster(), 8, 4_096),
    )
    for table, data, cluster, obj, gpus, tokens in tables:
        src = f"paper-figures.md §2: Pro-Prophet (arXiv 2411.10003) Table {table}"
        for (k, model), (faster, prophet) in data.items():
            label = f"{gpus} GPUs, {model}, k={k}"
            cases.append(
                Case(
                    label,
                    cluster,
                    prophet_spec(model, k, gpus, tokens // gpus),
                    TraceRecipe(steps=40, quick_steps=20, seed=21 + k),
                    cluster_obj=obj,
                )
            )
            figures.append(
                Figure(
                    "Pro-Prophet vs DeepSpeed-MoE",
                    PROPHET,
                    (DEEPSPEED,),
                    prophet,
                    f"{prophet:.2f}×",
                    src,
                    cases=(label,),
                )
            )
            figures.append(
                Figure(
                    "FasterMoE vs DeepSpeed-MoE",
                    FASTERMOE,
                    (DEEPSPEED,),
                    faster,
                    f"{faster:.2f}×",
                    src,
                    cases=(label,),
                )
            )
    return Scenario(
        name="pro-prophet",
        paper="Pro-Prophet (Wang et al., arXiv 2411.10003)",
        summary="Table IV: 16 RTX 3090 (4 nodes of 4, PCIe, 100 Gb/s IB: `rtx3090-ib100`; the "
        "paper's HPNV nodes also bridge GPU pairs with NVLink), 16,384 tokens per iteration; "
        "Table V: 8 RTX 2080 Ti (LPWNV, 2 nodes), 4,096 tokens; MoE-GPT-S/M/L/DS/DM, experts = "
        "GPUs, k = 1, 2, fp32; DeepSpeed-MoE = static + sync",
        cases=tuple(cases),
        runs=(
            Run("sync", ("static",)),
            Run("pipelined(4)", ("shadow",)),
            Run("prophet", ("prophet",)),
        ),
        figures=tuple(figures),
        quick_cases=("16 GPUs, GPT-S, k=1", "8 GPUs, GPT-S, k=2"),
    )


def smartmoe_spec(experts: int = 32) -> ModelSpec:
    """SmartMoE-AE's inky model GPT-L16-H2560 (Megatron: FFN 4 h, fp16); the sample's experts
    and top-2, and its 8,192 tokens per rank and step (inky's batch gives 16 x 1,024 per GPU)."""
    return ModelSpec(
        "smartmoe-gpt-l16-h2560",
        d_model=2560,
        d_expert=4 * 2560,
        experts=experts,
        top_k=2,
        moe_layers=16,
        dtype_bytes=2,
        tokens_per_device=8192,
    )


def _smartmoe() -> Scenario:
    src = "paper-figures.md §3: SmartMoE (ATC'23) abstract, §1 (headline maximum)"
    recipe = TraceRecipe(kind="smartmoe", snapshots=(1001, 5001), hold=10)
    cases = (
        Case("16 GPUs", "v100-ib50", smartmoe_spec(), recipe),
        Case("32 GPUs", "v100-ib50:4", smartmoe_spec(), recipe),
    )
    figures = tuple(
        Figure(
            "SmartMoE vs FasterMoE",
            SMARTMOE,
            (FASTERMOE,),
            1.88,
            "up to 1.88× (headline)",
            src,
            cases=(c.label,),
        )
        for c in cases
    )
    return Scenario(
        name="smartmoe",
        paper="SmartMoE (Zhai et al., USENIX ATC 2023)",
        summary="GPT-L16-H2560 (16 MoE layers, fp16) on 16 and 32 V100 in nodes of 8 with one "
        "50 Gb/s NIC per node (`v100-ib50`, `v100-ib50:4`; inky's hardware is not stated); the "
        "shipped SmartMoE-AE routing sample (16 ranks, 32 experts, top-2), resampled to 32 "
        "devices; FasterMoE = shadow + pipelined(4) (inky logs: shadowing and smart schedule on)",
        cases=cases,
        runs=(Run("sync", ("permute",)), Run("pipelined(4)", ("shadow",))),
        figures=figures,
        replan_every=5,
        notes=(
            "The sample's iteration 1 (an untrained, nearly uniform router) is not replayed; "
            "iterations 1,001 and 5,001 are held 10 steps each, so the plan made at step 10 "
            "from 1,001's loads is priced on 5,001's.",
        ),
    )


def _flexmoe() -> Scenario:
    src = "paper-figures.md §4: FlexMoE (SIGMOD'23) abstract"
    models = [("GPT-MoE", 12, 1024), ("BERT-MoE", 24, 1024)]
    cases = tuple(
        Case(
            f"64 GPUs, {name}",
            "v100-nvlink-ib100",
            ModelSpec(
                name.lower(),
                d_model=h,
                d_expert=4 * h,
                experts=64,
                top_k=2,
                moe_layers=layers,
                dtype_bytes=2,
                tokens_per_device=4096,
            ),
            TraceRecipe(steps=40, quick_steps=20, seed=31),
        )
        for name, layers, h in models
    )
    figures = (
        Figure("FlexMoE vs DeepSpeed-MoE", FLEXMOE, (DEEPSPEED,), 1.70, "1.70× on average", src,
               aggregate="mean"),
        Figure("FlexMoE vs DeepSpeed-MoE", FLEXMOE, (DEEPSPEED,), 2.10, "up to 2.10×", src,
               aggregate="max"),
        Figure("FlexMoE vs FasterMoE", FLEXMOE, (FASTERMOE,), 1.30, "1.30× on average", src,
               aggregate="mean"),
        Figure("FlexMoE vs FasterMoE", FLEXMOE, (FASTERMOE,), 1.45, "up to 1.45×", src,
               aggregate="max"),
    )  # fmt: skip
    return Scenario(
        name="flexmoe",
        paper="FlexMoE (Nie et al., SIGMOD 2023)",
        summary="FlexMoE's cluster and models were not found (abstract only): ours is 64 V100 "
        "(16 nodes of 4, NVLink, 100 Gb/s IB: `v100-nvlink-ib100`), a GPT- and a BERT-shaped "
        "MoE (d_model 1024, FFN 4 h, 64 experts, top-2, fp16, 4,096 tokens per GPU)",
        cases=cases,
        runs=(Run("sync", ("static", "vexpert")), Run("pipelined(4)", ("shadow",))),
        figures=figures,
        quick_cases=("64 GPUs, GPT-MoE",),
    )


# HybridEP Table V: data traffic (MB) -> (Tutel, FasterMoE, SmartMoE, HybridEP) seconds.
HYBRIDEP_TABLE_V = {
    2: {
        6: (2.52, 2.58, 2.59, 2.48),
        12: (4.26, 4.37, 4.34, 2.63),
        24: (5.82, 5.90, 5.97, 2.74),
        48: (7.62, 7.81, 7.80, 2.82),
        96: (12.65, 12.80, 12.68, 3.01),
        192: (20.35, 20.82, 20.91, 3.78),
    },
    4: {
        6: (3.74, 3.86, 3.82, 3.49),
        12: (7.30, 7.50, 7.46, 3.53),
        24: (10.69, 11.09, 10.94, 3.54),
        48: (13.54, 13.88, 14.08, 3.85),
        96: (18.59, 19.32, 19.25, 4.24),
        192: (28.46, 29.43, 29.53, 5.20),
    },
}
HYBRIDEP_PUBLISHED = {
    2: {6: 1.03, 12: 1.64, 24: 2.15, 48: 2.75, 96: 4.22, 192: 5.47},
    4: {6: 1.09, 12: 2.10, 24: 3.08, 48: 3.59, 96: 4.49, 192: 5.60},
}


def hybridep_spec(data_mb: float, top_k: int = 2) -> ModelSpec:
    """HybridEP's Table V setting: 32 experts, 12 layers, H = 512 (Table III), fp16, the expert
    fixed at 0.36 MB (2 x 512 x 176 x 2 bytes = 0.360 MB), and `data_mb` of dispatched data per
    GPU and MoE layer (its model's D): tokens per GPU = D / (top_k x 512 x 2 bytes)."""
    d_model, dtype = 512, 2
    tokens = round(data_mb * MB / (top_k * d_model * dtype))
    return ModelSpec(
        f"hybridep-{data_mb:g}mb",
        d_model=d_model,
        d_expert=176,
        experts=32,
        top_k=top_k,
        moe_layers=12,
        dtype_bytes=dtype,
        tokens_per_device=tokens,
    )


def _hybridep() -> Scenario:
    src = "paper-figures.md §5: HybridEP (arXiv 2510.19470) Table V"
    cases: list[Case] = []
    figures: list[Figure] = []
    for dcs, row in HYBRIDEP_PUBLISHED.items():
        for data_mb, pub in row.items():
            label = f"{dcs} DCs x 8 A800, {data_mb} MB"
            cluster = "a800-eth10" if dcs == 2 else f"a800-eth10:{dcs}"
            cases.append(
                Case(
                    label,
                    cluster,
                    hybridep_spec(data_mb),
                    TraceRecipe(steps=20, quick_steps=12, seed=41),
                )
            )
            figures.append(
                Figure(
                    "HybridEP vs mean of Tutel, FasterMoE, SmartMoE",
                    HYBRIDEP,
                    (TUTEL, FASTERMOE, SMARTMOE),
                    pub,
                    f"{pub:.2f}×",
                    src,
                    cases=(label,),
                )
            )
    return Scenario(
        name="hybridep",
        paper="HybridEP (Yang et al., arXiv 2510.19470)",
        summary="2 and 4 datacentres of 8 A800 (128 Gb/s inside, 10 Gb/s Ethernet between: "
        "`a800-eth10`, `a800-eth10:4`); 32 experts, 12 layers, top-2, expert 0.36 MB, data per "
        "GPU and layer 6-192 MB; Tutel = static + pipelined(4), FasterMoE = shadow + "
        "pipelined(4), SmartMoE = permute + sync",
        cases=tuple(cases),
        runs=(
            Run("pipelined(4)", ("static", "shadow")),
            Run("sync", ("permute",)),
            Run("hybrid", ("hybrid",)),
        ),
        figures=tuple(figures),
        replan_every=5,
        quick_cases=("2 DCs x 8 A800, 6 MB", "4 DCs x 8 A800, 192 MB"),
    )


def cross_dc_spec() -> ModelSpec:
    """HybridEP's GPT-Medium widths (Table II: H 1024, expert 8.4 M parameters = 2 x 1024 x
    4096, 32 experts), fp16, 4,096 tokens per GPU; 4 MoE layers (cut from 12 to keep an
    8,000-device replay within the time budget: layers are priced independently, so the
    speedup is an average over layers either way)."""
    return ModelSpec(
        "hybridep-gpt-medium-4l",
        d_model=1024,
        d_expert=4096,
        experts=32,
        top_k=2,
        moe_layers=4,
        dtype_bytes=2,
        tokens_per_device=4096,
    )


def _cross_dc() -> Scenario:
    src = "paper-figures.md §5: HybridEP §V-G, Fig. 17 (SimAI simulation, 1000 DCs)"
    case = Case(
        "1000 DCs x 8 H100",
        "cross-dc-1000",
        cross_dc_spec(),
        TraceRecipe(steps=6, quick_steps=4, seed=51, devices=64),
    )
    figures = (
        Figure(
            "HybridEP vs EP (S_ED fixed)",
            HYBRIDEP,
            (("hybrid", "static"),),
            1.45,
            "1.05-1.45×",
            src,
            aggregate="max",
        ),
        Figure(
            "HybridEP vs EP (p fixed)",
            HYBRIDEP,
            (("hybrid", "static"),),
            3.76,
            "1.31-3.76×",
            src,
            aggregate="max",
        ),
    )
    return Scenario(
        name="cross-dc-1000",
        paper="HybridEP large-scale simulation (arXiv 2510.19470 §V-G)",
        summary="1,000 datacentres of one 8-GPU node (`cross-dc-1000`: 8,000 H100, NVLink "
        "inside, 10 Gb/s wide-area links 20 ms apart); a drifting trace generated on 64 ranks "
        "and resampled to 8,000 devices; GPT-Medium widths, 32 experts (so DeepSpeed's static "
        "layout keeps 250 expert-data-parallel copies of each), top-2, 4 MoE layers",
        cases=(case,),
        runs=(Run("hybrid", ("static", "hybrid")),),
        figures=figures,
        replan_every=2,
        count_planning=False,
        planning_note="planning not charged: the published figures come from a SimAI "
        "simulation of communication and compute, with no planner in the loop",
    )


def _registry() -> dict[str, Scenario]:
    out = {}
    for make in (_fastermoe, _pro_prophet, _smartmoe, _flexmoe, _hybridep, _cross_dc):
        s = make()
        out[s.name] = s
    return out


SCENARIOS: dict[str, Scenario] = _registry()


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ConfigError(
            f"unknown scenario (known: {', '.join(SCENARIOS)})", source=name, field="scenario"
        )
    return SCENARIOS[name]


# --------------------------------------------------------------------------- output


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def markdown_table(results: Sequence[ScenarioResult]) -> str:
    """The comparison table (one row per published figure), then `auto`'s check per run."""
    lines = [
        "| scenario | setup | system vs baseline | ours | auto | published | source |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for res in results:
        for r in res.rows:
            lines.append(
                f"| {r.scenario} | {r.setup} | {r.comparison} | {_x(r.ours)} | {_x(r.auto)} "
                f"| {r.published_text} | {r.source} |"
            )
    lines += [
        "",
        "`auto` against the fastest other policy of each run (one case under one schedule, every "
        "policy on the same trace), mean step time over the measured steps, with the planner's "
        "measured wall time charged and without it (the cost model's time alone); the figures "
        "above use the column the scenario's setup names:",
        "",
        "| scenario | case | schedule | auto, planning charged (s) | fastest other | auto / other "
        "| auto, not charged (s) | fastest other | auto / other |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for res in results:
        for c in res.checks:
            flag_c = " **slower**" if c.ratio_charged > 1.0 else ""
            flag_p = " **slower**" if c.ratio_priced > 1.0 else ""
            lines.append(
                f"| {c.scenario} | {c.case} | {c.schedule} | {c.auto_charged_s:.4g} | "
                f"{c.best_charged} {c.best_charged_s:.4g} | {c.ratio_charged:.4f}{flag_c} | "
                f"{c.auto_priced_s:.4g} | {c.best_priced} {c.best_priced_s:.4g} | "
                f"{c.ratio_priced:.4f}{flag_p} |"
            )
    lines += ["", "Setups:", ""]
    for res in results:
        s = res.scenario
        lines.append(
            f"- **{s.name}** ({s.paper}): {s.summary}. Re-plan every {s.replan_every} steps "
            f"({s.predictor} forecast), first {s.warmup_steps} steps warm-up (not in the means), "
            f"{s.planning_note}. Traces: "
            + "; ".join(sorted(set(res.trace_notes.values())))
            + ". "
            + " ".join(s.notes)
            + f" ({res.wall_s:.1f} s)"
        )
    return "\n".join(lines) + "\n"


def results_json(results: Sequence[ScenarioResult]) -> dict[str, Any]:
    return {"scenarios": [r.as_dict() for r in results]}
