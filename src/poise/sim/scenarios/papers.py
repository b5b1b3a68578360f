"""The six published setups (FasterMoE, Pro-Prophet, SmartMoE, FlexMoE, HybridEP, 1,000
datacentres) as `Scenario`s with their published figures, and the registry."""

from __future__ import annotations

import dataclasses

from poise.core.cluster import Cluster, PeakFlops
from poise.core.errors import ConfigError
from poise.core.presets import get_cluster
from poise.core.spec import ModelSpec
from poise.sim.scenarios.core import (
    FASTERMOE_PIPELINE,
    MB,
    Case,
    Figure,
    Run,
    Scenario,
    TraceRecipe,
)
from poise.sim.scenarios.parm import parm_scenario
from poise.sim.scenarios.smartmoe import smartmoe_scenario

# --------------------------------------------------------------------------- the scenarios

FASTMOE = ("sync", "static")
# DeepSpeed-MoE without token dropping: the static placement on its padded dispatcher (every
# (rank, expert) buffer at the world's largest count: `cost.traffic.padded_counts`).
DEEPSPEED = ("padded", "static")
TUTEL = ("pipelined(4)", "static")
FASTERMOE = (FASTERMOE_PIPELINE, "shadow")
# DeepSpeed-MoE moving only the real tokens (static + sync). Neither Pro-Prophet nor FlexMoE
# names its DeepSpeed settings: both scenarios score `DEEPSPEED` (DeepSpeed's dispatcher pads
# every buffer to its capacity) and report this variant beside it, unscored.
DS_UNPADDED = ("sync", "static")
# Dynamic shadowing alone (no smart schedule), Pro-Prophet's FasterMoE baseline (§V-A).
SHADOWING = ("sync", "shadow")
SMARTMOE = ("sync", "permute")
FLEXMOE = ("sync", "vexpert")
PROPHET = ("prophet", "prophet")
HYBRIDEP = ("hybrid", "hybrid")
# Steps replayed from the generated drifting traces: 19 re-planning windows after the warm-up
# (re-planning every 10 steps). Steps under one plan share its forecast error, so the windows
# are the independent samples of a comparison between policies; with 40 steps (3 windows) a
# difference of 0.1% between two policies was forecast luck (0.3-0.8 standard errors), and the
# losses that only build up over many re-plans (an `auto` stuck in another policy's placement,
# 3.8% over 200 steps of FlexMoE's BERT-MoE before `auto` followed its rivals' own trails) did
# not show. The quick forms keep their short replays.
REPLAY_STEPS = 200


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
            TraceRecipe(steps=REPLAY_STEPS, quick_steps=20, seed=11),
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
            (FASTERMOE_PIPELINE, "static"),
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
        "MoE-BERT-Deep/-Deep-L (16 experts, top-2, fp32); FastMoE = static + sync; MoE layers "
        "timed alone, as Fig. 13 does",
        cases=cases,
        runs=(Run("sync", ("static", "shadow")), Run(FASTERMOE_PIPELINE, ("static", "shadow"))),
        figures=figures,
        # §5.2 and the artifact: Fig. 13 times the forward and backward of each MoE layer on the
        # recorded traces, one layer at a time; attention, the optimizer and the gradient
        # all-reduce are outside the timed span.
        timed="moe",
        # §4 (dynamic shadowing): the shadows are chosen every iteration from that iteration's
        # counts, in FasterMoE's runtime (its planning time is not Poise's).
        replan_every=1,
        count_planning=False,
        planning_note="planning not charged: FasterMoE decides its shadows every iteration in "
        "its own runtime; Poise's Python planner time is not its",
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
    """Pro-Prophet's LPWNV: "same as HPWNV except GPU type": 2 nodes of 4 RTX 2080 Ti (11 GiB),
    links, efficiency and small-GEMM curve as the RTX 3090 preset's. fp32 peak 13.45 TFLOP/s,
    derived: 2 FLOPs x 4,352 CUDA cores x 1,545 MHz boost (the 2080 Ti's core count and boost
    clock as reported from NVIDIA's Turing editor's day, wccftech, August 2018). Its tensor-core
    rates were not found in our sources: left out (the fp32 rate applies); the scenario trains
    in fp32."""
    base = get_cluster("rtx3090-ib100:2")
    return dataclasses.replace(
        base,
        name="rtx2080ti-ib100:2",
        peak_flops=PeakFlops(fp32=2 * 4352 * 1545e6),
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
                    TraceRecipe(steps=REPLAY_STEPS, quick_steps=20, seed=21 + k),
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
                    SHADOWING,
                    (DEEPSPEED,),
                    faster,
                    f"{faster:.2f}×",
                    src,
                    cases=(label,),
                )
            )
        figures.append(
            Figure(
                f"Pro-Prophet vs DeepSpeed-MoE unpadded (Table {table})",
                PROPHET,
                (DS_UNPADDED,),
                None,
                "not published: the DeepSpeed variant beside the scored one",
                src,
                cases=tuple(c.label for c in cases if c.label.startswith(f"{gpus} GPUs")),
                aggregate="mean",
            )
        )
    return Scenario(
        name="pro-prophet",
        paper="Pro-Prophet (Wang et al., arXiv 2411.10003)",
        summary="Table IV: 16 RTX 3090 (4 nodes of 4, PCIe, 100 Gb/s IB: `rtx3090-ib100`; the "
        "paper's HPNV nodes also bridge GPU pairs with NVLink), 16,384 tokens per iteration; "
        "Table V: 8 RTX 2080 Ti (LPWNV, 2 nodes), 4,096 tokens; MoE-GPT-S/M/L/DS/DM, experts = "
        "GPUs, k = 1, 2, fp32; DeepSpeed-MoE = static on its padded dropless dispatcher "
        "(`padded`), FasterMoE = dynamic shadowing alone (shadow + sync, §V-A), both systems "
        "planning every iteration",
        cases=tuple(cases),
        runs=(
            Run("padded", ("static",)),
            Run("sync", ("static", "shadow")),
            Run("prophet", ("prophet",)),
        ),
        figures=tuple(figures),
        # §IV-B: Pro-Prophet's planner runs every iteration (under the all-to-all); FasterMoE
        # decides its shadows every iteration from the actual counts (FasterMoE §4).
        replan_every=1,
        count_planning=False,
        planning_note="planning not charged: both published systems plan every iteration in "
        "their own runtimes (Pro-Prophet under the all-to-all, FasterMoE's shadow choice in its "
        "C++ runtime); Poise's Python planner time is not theirs",
        quick_cases=("16 GPUs, GPT-S, k=1", "8 GPUs, GPT-S, k=2"),
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
                compute_dtype="fp16",
            ),
            TraceRecipe(steps=REPLAY_STEPS, quick_steps=20, seed=31),
        )
        for name, layers, h in models
    )
    figures = (
        Figure("FlexMoE vs DeepSpeed-MoE, mean", FLEXMOE, (DEEPSPEED,), 1.70, "1.70× on average",
               src, aggregate="mean"),
        Figure("FlexMoE vs DeepSpeed-MoE, max", FLEXMOE, (DEEPSPEED,), 2.10, "up to 2.10×", src,
               aggregate="max"),
        Figure("FlexMoE vs DeepSpeed-MoE unpadded", FLEXMOE, (DS_UNPADDED,), None,
               "not published: the DeepSpeed variant beside the scored one", src,
               aggregate="mean"),
        Figure("FlexMoE vs FasterMoE, mean", FLEXMOE, (FASTERMOE,), 1.30, "1.30× on average", src,
               aggregate="mean"),
        Figure("FlexMoE vs FasterMoE, max", FLEXMOE, (FASTERMOE,), 1.45, "up to 1.45×", src,
               aggregate="max"),
    )  # fmt: skip
    return Scenario(
        name="flexmoe",
        paper="FlexMoE (Nie et al., SIGMOD 2023)",
        assumed=(
            "the cluster (64 V100, 16 nodes of 4), both models and the imbalance threshold: the "
            "paper's are not published beyond its abstract"
        ),
        summary="FlexMoE's cluster and models were not found (abstract only): ours is 64 V100 "
        "(16 nodes of 4, NVLink, 100 Gb/s IB: `v100-nvlink-ib100`), a GPT- and a BERT-shaped "
        "MoE (d_model 1024, FFN 4 h, 64 experts, top-2, fp16, 4,096 tokens per GPU); "
        "DeepSpeed-MoE = static on its padded dispatcher (`padded`; its settings are not "
        "published: the unpadded variant, static + sync, beside it)",
        cases=cases,
        runs=(
            Run("padded", ("static",)),
            Run("sync", ("static", "vexpert")),
            Run(FASTERMOE_PIPELINE, ("shadow",)),
        ),
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
        compute_dtype="fp16",
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
                    TraceRecipe(steps=REPLAY_STEPS, quick_steps=12, seed=41),
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
        "pipelined(W/2) (the artifact's groups of 2), SmartMoE = permute + sync",
        cases=tuple(cases),
        runs=(
            Run("pipelined(4)", ("static",)),
            Run(FASTERMOE_PIPELINE, ("shadow",)),
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
        compute_dtype="fp16",
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
            ("s-ed-4", "hybrid"),
            (("s-ed-4", "static"),),
            1.45,
            "1.05-1.45×",
            src,
            aggregate="max",
        ),
        # Withdrawn from the score: Fig. 17's p-fixed curve needs what §V-G does not give: the
        # gate (even or skewed), the expert count and size, the slots a GPU holds and the
        # wide-area bandwidth per curve (the scenario's notes).
        Figure(
            "HybridEP vs EP (p fixed)",
            HYBRIDEP,
            (("hybrid", "static"),),
            None,
            "1.31-3.76× (not scored: see the scenario's notes)",
            src,
            aggregate="max",
        ),
    )
    return Scenario(
        name="cross-dc-1000",
        paper="HybridEP large-scale simulation (arXiv 2510.19470 §V-G)",
        assumed=(
            "the SimAI run's bandwidths, latency, GPU, expert count and trace: §V-G does not state "
            "them (10 Gb/s links 20 ms apart, 32 experts on 8,000 H100, a generated trace)"
        ),
        summary="1,000 datacentres of one 8-GPU node (`cross-dc-1000`: 8,000 H100, NVLink "
        "inside, 10 Gb/s wide-area links 20 ms apart); a drifting trace generated on 64 ranks "
        "and resampled to 8,000 devices; GPT-Medium widths, 32 experts (so DeepSpeed's static "
        "placement is 250 expert-parallel groups of 32 devices, 4 DCs each, every token staying "
        "in its group, and 250 expert-data-parallel copies of each expert), top-2, 4 MoE "
        "layers; `hybrid` "
        "free to gather any expert into any DC (p fixed), and with the expert domain fixed at 4 "
        "DCs (`s-ed-4`: `--option hybrid.expert_domain=4`)",
        cases=(case,),
        runs=(
            Run("hybrid", ("static", "hybrid")),
            # §V-G's first curve fixes the expert domain S_ED while the DCs grow: S_ED = 4 DCs,
            # the largest expert domain the paper trained with (Cluster-L, whose domain "includes
            # all DCs", §V-A and §V-D); the figure's own S_ED is not given.
            Run("hybrid", ("static", "hybrid"), {"hybrid": {"expert_domain": 4}}, key="s-ed-4"),
        ),
        figures=figures,
        replan_every=2,
        count_planning=False,
        planning_note="planning not charged: the published figures come from a SimAI "
        "simulation of communication and compute, with no planner in the loop",
        notes=(
            "The p-fixed row is not scored: Fig. 17 needs what §V-G does not give: the gate, the "
            "expert count and size, the slots a GPU holds and the wide-area bandwidth of each "
            "curve. HybridEP fixes p before training, so `hybrid` plans once, on the even split "
            "(the paper's gate), with slots bounded by memory alone.",
        ),
    )


def _registry() -> dict[str, Scenario]:
    out = {}
    for make in (
        _fastermoe,
        _pro_prophet,
        smartmoe_scenario,
        _flexmoe,
        _hybridep,
        _cross_dc,
        parm_scenario,
    ):
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
