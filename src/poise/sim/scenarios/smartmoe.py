"""SmartMoE (USENIX ATC 2023) as a scenario row: the parallel layout SmartMoE's offline pool picks
against FasterMoE's expert parallelism, case by case, as the paper's Fig. 8 compares them.

SmartMoE's "up to 1.88x over FasterMoE" (abstract, §1) is one bar of Fig. 8: inky, 16 GPUs, the
uncapped (naive) gate, FasterMoE time / SmartMoE time over 200 whole Megatron iterations
(paper-setups.md §2.3, recomputed from the artifact's logs to three digits). Its gain comes from
the hybrid layout SmartMoE's offline stage chose, pipeline 4 x data 4 x expert 2 x expert-data 2
with 8 experts per GPU and online re-placement off (`dynamicOFF`), against FasterMoE's plain
expert parallelism with one expert per GPU, shadowing and smart scheduling on (the logs' file
names). So this scenario is not a placement policy replayed on plain EP: `run_smartmoe` prices
both systems per case with Poise's one cost model and builds the `ScenarioResult` itself:

- SmartMoE: the offline pool (`poise.layouts.price.rank_layouts`) ranks every feasible layout
  of the case's cluster and model on the case's loads; its argmin (`LayoutSearch.ranked[0]`, not
  the paper's layout named by hand) is priced on the measured steps with `price_layout`, online
  re-placement off as in the case (`LayoutSettings.online=False`), the sync schedule (the
  SmartMoE logs: `smart_OFF`), and m micro-batches per step from the case's fixed global batch
  (`LayoutSettings.micro_batch_tokens` = mbs x seq: Megatron-LM's m = gbs / (mbs dp));
- FasterMoE: `simulate` replays the same loads on the same cluster and model under `shadow` +
  `pipelined(W/2)` (dynamic shadowing + smart scheduling in the artifact's groups of 2),
  re-planning every step (FasterMoE decides its shadows every iteration), with the dense
  gradients' all-reduce charged (`dense_params`), planning charged beyond what a planner
  thread hides, as every scenario does.

Both sides include the same work per step: `price_layout`'s T_step = T_pipe + T_p2p + T_edp +
T_dp + T_out (`poise.layouts.price`) is, for a layout without pipeline or EDP copies, exactly
the simulator's `static` step with `dense_params` (tests/test_layouts.py); a pipelined layout
adds its bubble ((m + pp - 1) / m of the slowest stage) and point-to-point activations, an EDP
layout its expert-gradient all-reduce. Neither side counts what neither system changes beyond
that (data loading, iteration 1's warm-up).

Assumptions, each a fact of the case or a stated stand-in:

- Routing: the SmartMoE-AE sample (16 ranks, 32 experts, top-2, 8,192 tokens per rank; from a
  24-layer model of the artifact, not the Fig. 8 GPT-L16-H2560), iterations 1,001 and 5,001 held
  10 steps each, first 16 layers. The 16-GPU case's model has 16 experts (logs: `totalE16`):
  the sample's experts are folded in adjacent pairs (expert e -> e // 2), conserving every
  token-to-expert assignment (a token whose two choices fold into one expert counts twice
  there). The 32-GPU case has 32 experts (`totalE32`): the sample as it is, resampled to 32
  source devices. Counts are scaled by an integer factor to the case's tokens per GPU.
- Batch: gbs 256 (16 GPUs) and 512 (32 GPUs) sequences of 1,024 tokens, mbs 4 (logs): 16,384
  tokens per GPU in both.
- Cluster: inky's GPUs and links are not in what we read (paper-setups.md §2.3): the V100 nodes
  of 8 with one 50 Gb/s NIC per node (`v100-ib50`, `v100-ib50:4`) stand in, as before.
- Model: GPT-L16-H2560, fp16, expert hidden 5,120 (logs print `hhs=5120`), top-2 (fmoefy's
  default); `smartmoe_spec`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from poise.core.errors import ConfigError
from poise.core.spec import ModelSpec
from poise.layouts.pool import Layout, LayoutSettings
from poise.layouts.price import LayoutCost, price_layout, rank_layouts
from poise.plan.memory_slots import memory_bound_slots
from poise.plan.policies.base import REGISTRY
from poise.plan.policies.registry import get_policy
from poise.sim.scenarios.core import (
    FASTERMOE_PIPELINE,
    Case,
    Check,
    Figure,
    Row,
    Run,
    Scenario,
    ScenarioResult,
    TraceRecipe,
    build_trace,
    case_schedule,
)
from poise.sim.scenarios.replay import auto_check, measured_mean, memory_spec, step_times
from poise.sim.simulator import simulate

SOURCE = (
    "paper-figures.md §3: SmartMoE (ATC'23) abstract, §1 (headline maximum); the case's "
    "set-up and per-case bars from the artifact's Fig. 8 logs (paper-setups.md §2.3)"
)
FASTERMOE = (FASTERMOE_PIPELINE, "shadow")  # dynamic shadowing + smart scheduling (logs: both ON)
SMARTMOE = ("layout", "pool")  # the offline pool's argmin, priced by `price_layout`
SEQ = 1024  # tokens per sequence (logs: seq 1024)
MBS = 4  # sequences per micro-batch (logs: mbs 4)
SAMPLE_EXPERTS = 32  # the SmartMoE-AE sample's experts
SAMPLE_TOKENS = 8192  # the sample's tokens per rank and step (4 micro-batches x 2,048)
RECIPE = TraceRecipe(kind="smartmoe", snapshots=(1001, 5001), hold=10)
REPLAN_EVERY = 1  # FasterMoE decides its shadows every iteration


def smartmoe_spec(experts: int = SAMPLE_EXPERTS, tokens_per_device: int = 16_384) -> ModelSpec:
    """SmartMoE-AE's inky model GPT-L16-H2560 (paper-setups.md §2.3, logged Megatron arguments):
    16 layers, every FFN an MoE layer, hidden 2,560, expert hidden 5,120 (`hhs=5120`), top-2,
    fp16; `experts` in total and `tokens_per_device` = gbs x 1,024 / GPUs."""
    return ModelSpec(
        "smartmoe-gpt-l16-h2560",
        d_model=2560,
        d_expert=5120,
        experts=experts,
        top_k=2,
        moe_layers=16,
        dtype_bytes=2,
        tokens_per_device=tokens_per_device,
        compute_dtype="fp16",
    )


@dataclass(frozen=True)
class LayoutCase:
    """One Fig. 8 bar: `case` (cluster, model with the case's experts and tokens per GPU),
    the layout SmartMoE chose in the artifact's log (`paper_pp`, `paper_ep`; for the notes, never
    used to price SmartMoE's side) and the bar's FasterMoE / SmartMoE time."""

    case: Case
    global_batch: int  # sequences per iteration
    paper_pp: int
    paper_ep: int
    published: float
    published_text: str

    @property
    def label(self) -> str:
        return self.case.label


def layout_cases() -> tuple[LayoutCase, ...]:
    """Fig. 8's inky naive-gate bars (paper-setups.md §2.3): 16 GPUs (the 1.88x headline;
    SmartMoE chose pp4 dp4 ep2 edp2, 8 experts per GPU) and 32 GPUs (1.765x recomputed from the
    logs; pp8 dp4 ep2 edp2, 16 experts per GPU). Both have experts = GPUs and 16,384 tokens per
    GPU (gbs 256 and 512)."""
    out = []
    for gpus, cluster, gbs, pp, ep, pub, text in (
        (16, "v100-ib50", 256, 4, 2, 1.88, "up to 1.88× (headline: inky, 16 GPUs, naive gate)"),
        (32, "v100-ib50:4", 512, 8, 2, 1.765, "1.77× (Fig. 8 bar: inky, 32 GPUs, naive gate)"),
    ):
        spec = smartmoe_spec(experts=gpus, tokens_per_device=gbs * SEQ // gpus)
        case = Case(f"{gpus} GPUs", cluster, spec, RECIPE)
        out.append(LayoutCase(case, gbs, pp, ep, pub, text))
    return tuple(out)


def fold_experts(counts: np.ndarray, experts: int) -> np.ndarray:
    """`[..., E0]` -> `[..., experts]`: expert e of E0 joins expert e // (E0 / experts), so every
    token-to-expert assignment is kept (E0 a multiple of `experts`)."""
    e0 = counts.shape[-1]
    if e0 % experts:
        raise ConfigError(f"{e0} experts do not fold into {experts}", field="experts")
    return counts.reshape(*counts.shape[:-1], experts, e0 // experts).sum(axis=-1)


def case_counts(lc: LayoutCase, quick: bool, data: Path | None) -> tuple[np.ndarray, str]:
    """The case's loads `[S, L, 16, E]` (module docstring: the sample, folded to the case's
    experts and scaled to its tokens per GPU) and one line saying what they are."""
    spec = lc.case.spec
    sample_case = Case(
        lc.label,
        lc.case.cluster,
        spec.with_(experts=SAMPLE_EXPERTS, tokens_per_device=SAMPLE_TOKENS),
        RECIPE,
    )
    trace, note = build_trace(sample_case, quick, data)
    if spec.tokens_per_device % trace.tokens_per_device:
        raise ConfigError(
            f"{spec.tokens_per_device} tokens per GPU are not a multiple of the trace's "
            f"{trace.tokens_per_device}",
            source=lc.label,
            field="tokens_per_device",
        )
    scale = spec.tokens_per_device // trace.tokens_per_device
    counts = fold_experts(trace.counts.astype(np.int64), spec.experts) * scale
    if spec.experts != SAMPLE_EXPERTS:
        note += f"; {SAMPLE_EXPERTS} experts folded in pairs to {spec.experts}"
    return counts, note + f"; counts x{scale} to {spec.tokens_per_device:,} tokens per GPU"


def layout_settings() -> LayoutSettings:
    """The pool's settings for the case (module docstring): online re-placement off, the sync
    schedule, m from mbs x seq tokens per micro-batch."""
    return LayoutSettings(online=False, micro_batch_tokens=MBS * SEQ)


@dataclass
class LayoutComparison:
    """One case priced: the pool's ranking, its pick and the paper's layout priced on the
    measured steps, and FasterMoE's (and the other policies') mean step on plain EP."""

    ranked: list[LayoutCost]
    chosen: LayoutCost
    paper: LayoutCost | None
    paper_rank: int | None
    policies_s: dict[str, float]
    check: Check

    @property
    def speedup(self) -> float:
        """FasterMoE / SmartMoE: mean step seconds of `shadow` + pipelined(W/2) over the pool's
        pick's."""
        return self.policies_s[FASTERMOE[1]] / self.chosen.step_s


def compare(lc: LayoutCase, counts: np.ndarray, scenario: Scenario) -> LayoutComparison:
    """Price case `lc` on `counts[S, L, D0, E]` (module docstring)."""
    cluster, spec = lc.case.get_cluster(), lc.case.spec
    settings = layout_settings()
    warmup = scenario.warmup_steps
    # Offline stage: the pool ranks the layouts on the case's load distribution.
    search = rank_layouts(counts, cluster, spec, settings)
    measured = counts[min(warmup, len(counts) - 1) :]
    best = search.ranked[0]
    chosen = price_layout(best.layout, cluster, spec, measured, settings, best.homes)
    paper_layout = Layout(
        cluster.num_devices, spec.experts, spec.moe_layers, lc.paper_pp, lc.paper_ep
    )
    names = [c.layout for c in search.ranked]
    paper_rank = names.index(paper_layout) + 1 if paper_layout in names else None
    paper = (
        price_layout(paper_layout, cluster, spec, measured, settings)
        if paper_rank is not None
        else None
    )
    # FasterMoE on plain EP, beside every other policy (and `auto`) on the same replay.
    get_policy("static")  # fills REGISTRY
    policies = list(dict.fromkeys([*sorted(REGISTRY), FASTERMOE[1], "auto"]))
    unbounded = memory_bound_slots(cluster, memory_spec(scenario, spec))
    result = simulate(
        counts,
        cluster,
        spec,
        policies,
        case_schedule(FASTERMOE[0], cluster),
        scenario.replan_every,
        scenario.predictor,
        count_planning=scenario.count_planning,
        background_planning=scenario.background_planning,
        dense_params=spec.dense_params,
        policy_slots={n: unbounded for n in scenario.memory_bound if n in policies},
    )
    charged, priced = {}, {}
    for n in policies:
        c, p = step_times(result, n)
        charged[n], priced[n] = measured_mean(c, warmup), measured_mean(p, warmup)
    check = auto_check(scenario, lc.label, FASTERMOE[0], result, charged, priced)
    means = charged if scenario.count_planning else priced
    return LayoutComparison(search.ranked, chosen, paper, paper_rank, means, check)


def smartmoe_scenario() -> Scenario:
    """The scenario's description (its rows are computed by `run_smartmoe`)."""
    cases = layout_cases()
    figures = tuple(
        Figure(
            "SmartMoE (pool's layout) vs FasterMoE (EP, shadowing + smart schedule)",
            SMARTMOE,
            (FASTERMOE,),
            lc.published,
            lc.published_text,
            SOURCE,
            cases=(lc.label,),
        )
        for lc in cases
    )
    return Scenario(
        name="smartmoe",
        paper="SmartMoE (Zhai et al., USENIX ATC 2023)",
        assumed=(
            "inky's hardware: the paper does not state it; V100 nodes of 8 with one 50 Gb/s NIC "
            "each stand in"
        ),
        summary="Fig. 8's inky naive-gate bars as layout comparisons: GPT-L16-H2560 (16 MoE "
        "layers, expert hidden 5,120, top-2, fp16; 16 experts on 16 GPUs, 32 on 32; 16,384 "
        "tokens per GPU) on V100 nodes of 8 with one 50 Gb/s NIC each (`v100-ib50`, "
        "`v100-ib50:4`; inky's hardware is not stated); SmartMoE = the layout its offline pool "
        "picks (`layouts.rank_layouts`, online re-placement off, sync schedule, m = gbs / (mbs "
        "dp)); FasterMoE = plain EP, one expert per GPU, shadow + pipelined(W/2), re-planned "
        "every step",
        cases=tuple(lc.case for lc in cases),
        runs=(Run(FASTERMOE[0], ("static", FASTERMOE[1])),),
        figures=figures,
        replan_every=REPLAN_EVERY,
        quick_cases=("16 GPUs",),
        runner=run_smartmoe,
        notes=(
            "The SmartMoE-AE sample (a 24-layer, 32-expert model's routing) stands in for the "
            "Fig. 8 model's; iterations 1,001 and 5,001 held 10 steps each, the pool ranks "
            "layouts on all 20 steps (its expected load distribution) and both systems are "
            "timed on the steps after the warm-up.",
            "The auto column is Poise's `auto` policy on FasterMoE's plain EP under "
            "pipelined(W/2): FasterMoE / auto, what Poise's planner reaches without changing the "
            "layout.",
        ),
    )


def run_smartmoe(quick: bool = False, data: Path | None = None) -> ScenarioResult:
    """Price every case (`quick`: the 16-GPU case alone) and build the rows;
    `data`: the folder holding `smartmoe-ae-sample/` (None: a generated stand-in)."""
    started = time.perf_counter()
    scenario = smartmoe_scenario()
    rows: list[Row] = []
    checks: list[Check] = []
    means: dict[str, dict[str, dict[str, float]]] = {}
    notes: dict[str, str] = {}
    kept = {c.label for c in scenario.cases_for(quick)}
    for lc, figure in zip(layout_cases(), scenario.figures, strict=True):
        if lc.label not in kept:
            continue
        counts, note = case_counts(lc, quick, data)
        got = compare(lc, counts, scenario)
        auto = got.policies_s[FASTERMOE[1]] / got.policies_s["auto"]
        layouts = {f"{got.chosen.layout.name} (pool's pick)": got.chosen.step_s}
        paper = "not feasible under the pool's memory rule"
        if got.paper is not None:
            layouts[f"{got.paper.layout.name} (SmartMoE's log)"] = got.paper.step_s
            paper = (
                f"{got.paper.layout.name} ranks {got.paper_rank} of {len(got.ranked)} at "
                f"{got.paper.step_s:.3f} s, {got.policies_s[FASTERMOE[1]] / got.paper.step_s:.2f}x"
            )
        means[lc.label] = {FASTERMOE[0]: got.policies_s, "layout": layouts}
        checks.append(got.check)
        notes[lc.label] = (
            f"{note}. {lc.label}: the pool picks {got.chosen.layout.name} "
            f"({got.chosen.step_s:.3f} s per step, m = {got.chosen.micro_batches}, bubble "
            f"{got.chosen.bubble_s:.3f} s) against FasterMoE's {got.policies_s['shadow']:.3f} s; "
            f"SmartMoE's own choice {paper}"
        )
        ep = lc.case.get_cluster().num_devices
        rows.append(
            Row(
                scenario=scenario.name,
                setup=f"{lc.label}: {got.chosen.layout.name} vs EP{ep}",
                comparison=figure.label,
                ours=got.speedup,
                auto=auto,
                published=figure.published,
                published_text=figure.published_text,
                source=figure.source,
                cases=[lc.label],
                per_case={lc.label: got.speedup},
                per_case_auto={lc.label: auto},
            )
        )
    return ScenarioResult(
        scenario=scenario,
        rows=rows,
        checks=checks,
        means=means,
        wall_s=time.perf_counter() - started,
        quick=quick,
        trace_notes=notes,
    )


__all__ = [
    "FASTERMOE",
    "SMARTMOE",
    "LayoutCase",
    "LayoutComparison",
    "case_counts",
    "compare",
    "fold_experts",
    "layout_cases",
    "layout_settings",
    "run_smartmoe",
    "smartmoe_scenario",
    "smartmoe_spec",
]
