"""The simulated part of `poise demo`: real routing replayed on clusters with at least as many
experts as devices.

Each `SimCase` is one replay: a routing trace, the model whose widths price it, a modelled
cluster and why the case is there. `sim_cases` builds them from what it finds:

- the demo's own recorded routing (the measured model's experts, one per H100 of `dgx-h100:2`,
  priced at the SmartMoE GPT's widths);
- the SmartMoE-AE sample (16 real ranks, 24 layers, 32 experts, top-2, no balance loss): each
  micro-batch of iterations 1001 and 5001 one step, on `dgx-h100:4` (32 H100, one expert each);
- OLMoE's routing (64 experts, top-8, layers 0, 7 and 15; one step per text domain, cycled:
  batches of arxiv, books, c4, github, wikipedia in turn) on `dgx-h100:8` (64 H100);
- the same OLMoE routing with every expert split into 4 (DeepSeekMoE's fine-grained expert
  segmentation: 256 experts, top-8), priced at DeepSeek-V3's widths, on `dgx-h100:8` (64 H100,
  4 experts each) and, in the full demo, `dgx-h100:32` (256 H100).

The real data comes from `--data`, `$POISE_SHARED_DATA` or `../shared/data` (see
`find_shared_data`); cases whose data is missing are left out and `missing` says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from poise.core.errors import ConfigError
from poise.core.spec import MODELS, ModelSpec

SMARTMOE_DIR = "smartmoe-ae-sample"
OLMOE_FILE = Path("olmoe-expert-counts") / "expert_counts.json"
OLMOE_DOMAINS = ("arxiv", "book", "c4", "github", "wikipedia")
SPLIT = 4  # OLMoE's 64 experts -> 256 fine-grained experts

# OLMoE-1B-7B (Muennighoff et al. 2024, Table 1): d_model 2048, expert FFN 1024, 64 experts
# top-8, 16 MoE layers; the trace holds 3 of them (0, 7, 15). bf16.
OLMOE_SPEC = ModelSpec(
    "olmoe-1b-7b (3 of 16 MoE layers)",
    d_model=2048,
    d_expert=1024,
    experts=64,
    top_k=8,
    moe_layers=3,
    dtype_bytes=2,
    tokens_per_device=8192,
    activation="swiglu",
    compute_dtype="bf16",
)
# DeepSeek-V3 (DeepSeek-AI 2024, sect. 4.2): d_model 7168, routed expert FFN 2048, 256 routed
# experts top-8 (58 MoE layers; the trace holds 3). bf16 here (the paper trains in FP8).
DSV3_SPEC = ModelSpec(
    "deepseek-v3 widths (3 MoE layers)",
    d_model=7168,
    d_expert=2048,
    experts=256,
    top_k=8,
    moe_layers=3,
    dtype_bytes=2,
    tokens_per_device=8192,
    activation="swiglu",
    compute_dtype="bf16",
)


@dataclass
class SimCase:
    """One replay of the demo's simulated part."""

    key: str
    title: str
    trace: Any  # poise.trace.trace.Trace
    spec: ModelSpec
    cluster: str
    replan_every: int
    why: str
    steps: int | None = None


@dataclass
class SimCases:
    cases: list[SimCase] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # what real data was not found, in words


def find_shared_data(explicit: str | None) -> Path | None:
    """The first of `explicit`, `$POISE_SHARED_DATA`, `../shared/data` and the `shared/data`
    beside this checkout that holds the SmartMoE-AE sample or OLMoE's counts; None if none.
    A folder named explicitly (`--data`) that holds neither is an error, not replaced."""
    if explicit:
        root = Path(explicit)
        if not ((root / SMARTMOE_DIR).is_dir() or (root / OLMOE_FILE).is_file()):
            raise ConfigError(
                f"holds neither {SMARTMOE_DIR}/ nor {OLMOE_FILE}",
                source=str(explicit),
                field="--data",
            )
        return root
    candidates = [
        os.environ.get("POISE_SHARED_DATA"),
        "../shared/data",
        str(Path(__file__).resolve().parents[3].parent / "shared" / "data"),
    ]
    for c in candidates:
        if c and ((Path(c) / SMARTMOE_DIR).is_dir() or (Path(c) / OLMOE_FILE).is_file()):
            return Path(c)
    return None


def split_parents(layers: int, experts: int, parts: int, seed: int = 0) -> np.ndarray:
    """Which coarse expert each fine-grained expert comes from when each of `experts` is split
    into `parts`: `[L, experts * parts]`, every coarse expert `parts` times per layer, in an
    order drawn at random per layer (seeded). A trained DeepSeekMoE's expert numbers say nothing
    of its load, so a hot expert's parts are not numbered side by side; numbered so, static
    EP's contiguous blocks would put them all on one device and flatter every balancer."""
    rng = np.random.default_rng([seed, 1])
    base = np.repeat(np.arange(experts), parts)  # [E * P]
    return np.stack([rng.permutation(base) for _ in range(layers)])


def split_experts(trace: Any, parts: int, seed: int = 0) -> Any:
    """`trace` with every expert split into `parts` fine-grained experts, as DeepSeekMoE
    segments its experts; top-k kept. Fine expert j of layer l comes from coarse expert
    `split_parents(L, E, parts, seed)[l, j]` (numbered at random per layer).

    Each expert's count is shared among its parts by fixed weights per (layer, expert), drawn
    once from Dirichlet(4) (the parts of a hot expert stay hot together, unevenly), by the
    largest remainder so that every count is conserved. Counts `[S, L, D, E * parts]`."""
    from poise.trace.trace import Trace

    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    rng = np.random.default_rng(seed)
    counts = np.asarray(trace.counts, dtype=np.int64)
    S, L, D, E = counts.shape
    w = rng.dirichlet(np.full(parts, 4.0), size=(L, E))  # [L, E, P]
    exact = counts[..., None] * w[None, :, None]  # [S, L, D, E, P]
    out = np.floor(exact).astype(np.int64)
    short = counts - out.sum(axis=-1)  # [S, L, D, E], 0 <= short < parts
    order = np.argsort(-(exact - out), axis=-1, kind="stable")
    rank = np.argsort(order, axis=-1, kind="stable")
    out += rank < short[..., None]
    grouped = out.reshape(S, L, D, E * parts)  # fine expert e * parts + p, parent e
    parents = split_parents(L, E, parts, seed)  # [L, E * P]
    fine = np.empty_like(grouped)
    for layer in range(L):
        # the k-th fine expert numbered with parent e takes e's k-th part, e * parts + k
        fine[:, layer][..., np.argsort(parents[layer], kind="stable")] = grouped[:, layer]
    meta = dict(trace.meta)
    meta["split_experts"] = parts
    return Trace(
        fine,
        trace.step_ids,
        trace.top_k,
        trace.tokens_per_device,
        name=f"{trace.name} split x{parts}",
        meta=meta,
    )


def one_batch(trace: Any, tokens_per_device: int) -> Any:
    """`trace`'s routing as one device's batch: each step and layer's counts, summed over the
    sources, scaled to `tokens_per_device * top_k` assignments (largest remainder, so rows sum
    exactly). Counts `[S, L, 1, E]`; the simulator gives every modelled device this row.

    OLMoE's counts are about 209k tokens of a domain at once; priced as one step they would
    make each device route 25 times a training batch."""
    from poise.trace.trace import Trace

    c = np.asarray(trace.counts, dtype=np.float64).sum(axis=2)  # [S, L, E]
    want = int(tokens_per_device) * int(trace.top_k)
    exact = c / np.maximum(c.sum(axis=-1, keepdims=True), 1.0) * want
    out = np.floor(exact).astype(np.int64)
    short = want - out.sum(axis=-1)  # [S, L]
    order = np.argsort(-(exact - out), axis=-1, kind="stable")
    rank = np.argsort(order, axis=-1, kind="stable")
    out += rank < short[..., None]
    meta = dict(trace.meta)
    meta["one_batch_tokens"] = int(tokens_per_device)
    return Trace(
        out[:, :, None, :],
        trace.step_ids,
        trace.top_k,
        int(tokens_per_device),
        name=trace.name,
        meta=meta,
    )


def cycle_steps(trace: Any, steps: int) -> Any:
    """`trace`'s steps repeated in order until there are `steps` of them."""
    from poise.trace.trace import Trace

    idx = np.arange(steps) % trace.steps
    return Trace(
        trace.counts[idx],
        np.arange(steps),
        trace.top_k,
        trace.tokens_per_device,
        name=trace.name,
        meta=dict(trace.meta),
    )


def sim_cases(own: Any, data_dir: str | None, *, quick: bool, sim_steps: int) -> SimCases:
    """The demo's simulated cases: the run's own trace `own`, then the real routing found under
    `data_dir` (see the module docstring). `sim_steps` bounds the steps of each replay."""
    from poise.trace.importers import import_expert_counts, import_smartmoe

    out = SimCases()
    experts = int(own.experts)
    own_cluster = f"dgx-h100:{max(1, experts // 8)}"
    out.cases.append(
        SimCase(
            "own",
            f"this run's routing, {experts} experts on {own_cluster}",
            own,
            MODELS["smartmoe-gpt"].with_(
                name="smartmoe-gpt widths",
                experts=experts,
                top_k=int(own.top_k),
                moe_layers=int(own.layers),
            ),
            own_cluster,
            4 if quick else 10,
            f"The routing the static run just recorded on {own.devices} ranks, its "
            f"{experts} experts one per H100 of {own_cluster}, priced at the widths of the "
            "SmartMoE GPT (the tiny model's own widths would take microseconds on an H100). "
            "Its rows are resampled onto the modelled devices.",
            steps=min(sim_steps, int(own.steps)),
        )
    )
    root = find_shared_data(data_dir)
    sample = root / SMARTMOE_DIR if root is not None else None
    if sample is not None and sample.is_dir():
        trace = import_smartmoe(sample, micro_batches="steps")
        micro = int(trace.meta.get("micro_batches", 1))
        first = int(np.searchsorted(trace.step_ids, 1001 * micro))  # after the first snapshot
        trace = trace.slice_steps(min(first, trace.steps - 1))
        out.cases.append(
            SimCase(
                "smartmoe",
                "SmartMoE-AE routing, 32 experts on dgx-h100:4",
                trace,
                MODELS["smartmoe-gpt"],
                "dgx-h100:4",
                2,
                "Real routing of a GPT-MoE trained without a balance loss (SmartMoE-AE, 16 "
                "ranks, 24 MoE layers, 32 experts top-2): each of the 4 micro-batches of "
                "iterations 1001 and 5001 is one step, every rank's own counts, one expert per "
                "H100 of dgx-h100:4 (each trace rank feeds 2 devices). The skew is heavy "
                "(slowest expert 8 to 16 times the mean) and stable within an iteration, so a "
                "plan made from the last micro-batches fits the next.",
            )
        )
    else:
        out.missing.append(f"the SmartMoE-AE sample ({SMARTMOE_DIR}/)")
    olmoe = root / OLMOE_FILE if root is not None else None
    if olmoe is not None and olmoe.is_file():
        base = import_expert_counts(olmoe, model="olmoe", domain=list(OLMOE_DOMAINS))
        n = min(sim_steps, 12 if quick else 30)
        trace = cycle_steps(one_batch(base, OLMOE_SPEC.tokens_per_device), n)
        out.cases.append(
            SimCase(
                "olmoe",
                "OLMoE routing, 64 experts top-8 on dgx-h100:8",
                trace,
                OLMOE_SPEC,
                "dgx-h100:8",
                5,
                "Real routing of OLMoE-1B-7B on text (its layers 0, 7 and 15; 64 experts "
                "top-8, trained with a balance loss): each step is one domain's counts "
                f"({', '.join(OLMOE_DOMAINS)} in turn) scaled to a batch of "
                f"{OLMOE_SPEC.tokens_per_device:,} tokens per H100, the same on every one of "
                "the 64 (the data has no per-device counts). The hot experts differ by "
                "domain, so a plan is made for the mixture and each step deviates from it.",
            )
        )
        fine = split_experts(trace, SPLIT, seed=0)
        clusters = ["dgx-h100:8"] if quick else ["dgx-h100:8", "dgx-h100:32"]
        for cl in clusters:
            devices = 8 * int(cl.split(":")[1])
            out.cases.append(
                SimCase(
                    f"dsv3-{devices}",
                    f"256 experts top-8 (DeepSeek-V3 widths) on {cl}",
                    fine,
                    DSV3_SPEC,
                    cl,
                    5,
                    f"A DeepSeek-V3-sized layer (d_model 7168, 256 routed experts of width "
                    f"2048, top-8) on {devices} H100 ({256 // devices} experts each). No public "
                    "256-expert routing is at hand, so OLMoE's real routing above is split "
                    f"as DeepSeekMoE segments experts: each of the 64 experts into {SPLIT}, "
                    "its tokens shared among them by fixed random weights (Dirichlet(4) per "
                    "layer and expert), top-8 kept, and the 256 numbered at random per layer "
                    "(a trained model's expert numbers say nothing of load: numbered side by "
                    "side, a hot expert's parts would share one device under static EP).",
                )
            )
    else:
        out.missing.append(f"OLMoE's expert counts ({OLMOE_FILE})")
    return out


__all__ = [
    "DSV3_SPEC",
    "OLMOE_SPEC",
    "SimCase",
    "SimCases",
    "cycle_steps",
    "find_shared_data",
    "one_batch",
    "sim_cases",
    "split_experts",
    "split_parents",
]
