r"""Training throughput of `auto` over static expert parallelism, beside the ideal.

    .venv/bin/python benchmarks/train_speedup.py                 # tiny, ~5 min on 2 cores
    .venv/bin/python benchmarks/train_speedup.py --settings all --repeats 2 \
        --peers free static-again                                # ~55 min on 2 cores

Each run is real training (`poise train --nproc N` on local gloo ranks, 1 thread each, the
`tiny` GPT-MoE with the setting's experts, no auxiliary loss, seed 0). A round runs static, auto
and the `--peers` at once, taking their steps in turns (`poise.train.turns`), so the machine's
drift falls on all alike; the order rotates from round to round. The first `replan_every + 2`
steps are warm-up. One JSON line per setting; its fields:

- `speedup`: auto / static tokens/s, per round (`speedup_rounds`), balanced over who went first
  (`poise.report.ideal.position_balanced`); `no_harm`: it is at least 0.99;
- `ideal_speedup`: the static run with its experts balanced for free, `c x` the pairs the
  slowest ranks shed, `c` the expert seconds per token timed in the rounds' own turns
  (`poise.report.ideal`); `gain_fraction`: `(speedup - 1) / (ideal_speedup - 1)`;
- `peers.<name>.speedup` and `auto_gain_share`, auto's gain as a share of the peer's: `free`
  is the ideal measured (EPLB every step, its transfers and planning left out of the step's
  time, `poise.train.instruments`), `free-paced` and `auto-free` its parts (EPLB every
  `--replan-every` steps, auto's own plans, both free), `eplb` DeepSeek's EPLB as published,
  `static-again` static a second time: the comparison's own spread (A/A);
- `auto_decisions`: each auto run's decisions ("11 adopt r4 m0": at step 11 adopted, 4 replica
  slots in force, no home moved); `auto_paired_clock_ms`: its last paired clock `[saving, se,
  probes]`, `auto_modelled_clock_ms` the model's figure for it;
- `gain_accounting`: where the ideal's gain went, step by step (`poise.report.gain_accounting`);
  `shed_pairs_premise`: whether a pair the slowest ranks shed saved `c` (1: as the ideal assumes).

Settings: `tiny` (8 experts top-2), `skewed` (16 top-1, d_expert 1024), `many-experts` (32 top-2),
`skewed-4` (4 ranks on 2 cores), `skewed-micro4` (`skewed` with 4 micro-batches a step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# name: (ranks, model_args over the `tiny` preset, training settings over `run_config`'s)
SETTINGS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "tiny": (2, {}, {}),
    "skewed": (2, {"num_experts": 16, "top_k": 1, "d_expert": 1024}, {}),
    "many-experts": (2, {"num_experts": 32, "top_k": 2, "d_expert": 512}, {}),
    "skewed-4": (4, {"num_experts": 32, "top_k": 1, "d_expert": 1024}, {}),
    "skewed-micro4": (2, {"num_experts": 16, "top_k": 1, "d_expert": 1024}, {"micro_batches": 4}),
}


# peer policies run as their papers and libraries do: re-planned every period, adopted without
# a cost check (`balance_guard` off; `probe_every` then has no effect)
# peer -> (its policy, the training settings it changes)
PEERS: dict[str, tuple[str, dict[str, Any]]] = {
    "eplb": ("eplb", {"balance_guard": False}),
    # the ideal, measured: EPLB's plans from the latest loads at every step, with Agg, planning,
    # migration and Trans at the step boundary and left out of the step's time
    # (`poise.train.instruments.FreeBalancing`)
    "free": ("eplb", {"balance_guard": False, "free_balancing": True, "replan_every": 1}),
    # ... its parts: EPLB at the runs' own re-plan period, and auto's own plans (every one
    # adopted), with free transfers
    "free-paced": ("eplb", {"balance_guard": False, "free_balancing": True}),
    "auto-free": ("auto", {"balance_guard": False, "free_balancing": True}),
    # auto whose replica slots stay on the experts the plan chose (no per-step retargeting)
    # static again, in the same turns: the comparison's own spread beside auto's (A/A)
    "static-again": ("static", {}),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--settings",
        nargs="+",
        default=["tiny"],
        choices=["all", *SETTINGS],
        help="settings to run, or all (default tiny)",
    )
    p.add_argument("--steps", type=int, default=100, help="training steps per run")
    p.add_argument("--repeats", type=int, default=5, help="rounds (static/auto pairs) per setting")
    p.add_argument("--replan-every", type=int, default=10)
    p.add_argument(
        "--window",
        type=int,
        default=100,
        help="with more steps than this, also report the figures of each window of this many "
        "steps (`windows`: past the router's warm-up); the judged figures stay the whole run's",
    )
    p.add_argument("--out", default=None, help="run folders (default: a temporary folder)")
    p.add_argument(
        "--peers",
        nargs="*",
        default=[],
        choices=sorted(PEERS),
        help="peer runs in turns beside static and auto (eplb: DeepSeek's EPLB; "
        "free: the ideal measured, EPLB every step with free transfers; "
        "free-paced, auto-free: EPLB at the re-plan period and auto, free; static-again: "
        "static a second time, the comparison's own spread)",
    )
    args = p.parse_args(argv)
    if "all" in args.settings:
        args.settings = list(SETTINGS)
    args.settings = list(dict.fromkeys(args.settings))
    return args


# ------------------------------------------------------------------------------- training runs
def run_config(
    policy: str, out: Path, steps: int, replan_every: int, model_args: dict, **kw: Any
) -> Any:
    """The `configs/tiny.yaml` settings without aux loss, for a timed run."""
    from poise.train.config import TrainConfig

    base = dict(
        model="tiny",
        model_args=dict(model_args),
        context=128,
        batch=16,
        steps=steps,
        lr=2e-3,
        warmup=min(20, steps // 3),
        aux_loss=0.0,
        policy=policy,
        replan_every=replan_every,
        spare_slots=1,
        seed=0,
        out=str(out),
        eval_every=0,
        checkpoint_every=0,
        log_every=10_000,
        progress=False,
        tensorboard=False,
        threads=1,  # 1 intra-op thread per rank, as the ideal's `shared_cores` assumes
    )
    base.update(kw)
    return TrainConfig(**base)


def train(cfg, world: int) -> Any:
    """Run `cfg` on `world` local ranks as `poise train --nproc world` does; the loaded
    `MeasuredRun`."""
    from poise.commands.train import launch
    from poise.report.runs import MeasuredRun
    from poise.train.config import save_config

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    code = launch(world, out / "config.yaml", quiet=True)
    if code != 0:
        raise SystemExit(f"training {cfg.policy} in {out} failed with status {code}")
    return MeasuredRun.load(out)


def train_in_turns(
    cfgs: list[Any], world: int, turns: Path, clock: Any = None
) -> tuple[list[Any], dict[str, Any] | None]:
    """Run `cfgs` at once, each on `world` local ranks, taking their steps in turns
    (`poise.commands.train.in_turns`, the counter in the fresh file `turns`), with `clock`
    (`clock(turns, slot, slots)`, `expert_clock`) timing `c` in a turn of its own; their
    `MeasuredRun`s and the clock's result (None without one)."""
    from poise.commands.train import in_turns

    companions = [partial(clock, turns)] if clock is not None else []
    done = in_turns(cfgs, turns, lambda cfg: train(cfg, world), companions)
    return done[: len(cfgs)], (done[-1] if clock is not None else None)


def expert_clock(model: Any, world: int, steps: int, skip: int) -> Any:
    """`clock(turns, slot, slots)`: `model`'s experts (`experts // world` per rank) timed in
    turns beside the runs (`poise.commands.expert_clock`) over their measured steps."""
    from poise.commands.expert_clock import expert_seconds_in_turns

    return partial(
        expert_seconds_in_turns,
        steps=steps,
        d_model=model.d_model,
        d_expert=model.d_expert,
        experts_per_rank=model.num_experts // world,
        activation=model.activation,
        skip=min(skip, steps - 1),
    )


# ----------------------------------------------------------------------------------- figures
def measured(run: Any, skip: int) -> slice:
    from poise.report.ideal import measured_steps

    return measured_steps(run.step_s, skip)


def tok_s(run: Any, skip: int) -> float:
    from poise.report.ideal import tokens_per_s

    return tokens_per_s(run, skip)


def phase_ms(run: Any, skip: int) -> dict[str, float]:
    w = measured(run, skip)
    return {k: float(v[w].mean() * 1e3) for k, v in run.phases.items()}


def window_figures(
    static: list[Any], auto: list[Any], c_rounds: list[float], skip: int, window: int,
    cores: float = 0.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """The benchmark's figures over each window of `window` steps (the first from `skip` to
    `window`, then `window` to `2 window`, ...; run lengths as `static[0]`'s): per round the
    speedup (static's summed step time over auto's, tokens being equal a step) and the ideal
    (`ideal_of` over the same steps at the round's `c`), then their medians over the rounds
    and the gain fraction of those (`judge`). Empty where the runs are no longer than one
    window."""
    from poise.report.ideal import ideal_of, judge

    steps = len(static[0].step_s)
    if steps <= window:
        return []
    out = []
    for lo in range(0, steps, window):
        start, stop = max(lo, skip), min(lo + window, steps)
        if stop <= start:
            continue
        speedups = [
            float(np.sum(s.step_s[start:stop]) / np.sum(a.step_s[start:stop]))
            for s, a in zip(static, auto, strict=True)
        ]
        ideals = [
            ideal_of(s, c, start, cores=cores, stop=stop)["ideal_speedup"]
            for s, c in zip(static, c_rounds, strict=True)
        ]
        speedup, ideal = statistics.median(speedups), statistics.median(ideals)
        out.append(
            {
                "steps": [start + 1, stop],
                "speedup": round(speedup, 4),
                "ideal_speedup": round(ideal, 4),
                "gain_fraction": judge(speedup, ideal)["gain_fraction"],
                "speedup_rounds": [round(x, 4) for x in speedups],
            }
        )
    return out


def round_order(sides: list[str], r: int) -> tuple[str, ...]:
    """The order of round `r`'s runs in their turns: `sides` rotated by `r // 2`, reversed in
    odd rounds. Each pair of rounds puts every two sides at opposite slot distances (static,
    auto, free then free, auto, static); with two sides the first slot alternates static, auto,
    auto, static, and every run takes every slot over each pair of rounds. With three, a cost
    of the slot itself (the last ran fastest on `skewed-4`) cancels only over six rounds
    (`slots_balanced`)."""
    k = (r // 2) % len(sides)
    order = sides[k:] + sides[:k]
    return tuple(reversed(order) if r % 2 else order)


def slots_balanced(orders: list[tuple[str, ...]]) -> bool:
    """Whether every run took every slot of the turns equally often over `orders`. The slot
    itself weighs: on `skewed-4` with three runs the last slot ran up to 4% faster whichever
    run held it (docs/benchmarks.md), so only such a set of rounds cancels it; with two runs
    any even number of rounds does, with three a multiple of six."""
    sides = orders[0]
    slots = range(len(sides))
    per = [sum(o.index(side) == slot for o in orders) for side in sides for slot in slots]
    return len(set(per)) == 1  # (a slot a run never took counts 0, others more)


def bench_setting(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from poise.calibrate.experts import expert_seconds_per_token
    from poise.models.gpt import model_config
    from poise.report.gain_accounting import gain_accounting
    from poise.report.ideal import ideal_of, judge, position_balanced, shed_pairs_worth
    from poise.runtime.plan_inputs import shared_cores

    world, model_args, setting = SETTINGS[name]
    mcfg = model_config("tiny", dict(model_args), source=name)
    skip = args.replan_every + 2
    load_before = os.getloadavg()[0]
    shape = (mcfg.d_model, mcfg.d_expert, mcfg.num_experts // world)
    c_before = expert_seconds_per_token(*shape)["c_s"]
    sides = ["static", "auto", *args.peers]
    runs: dict[str, list[Any]] = {side: [] for side in sides}
    clocked: list[dict[str, Any]] = []  # the expert clock's result per round (in turns)
    policy_of = {side: PEERS[side][0] if side in PEERS else side for side in sides}
    orders: list[tuple[str, ...]] = []  # per round, the sides in the order they ran
    for r in range(args.repeats):
        order = round_order(sides, r)
        orders.append(order)
        cfgs = {
            side: run_config(
                policy_of[side], root / f"{name}-{r}-{side}", args.steps, model_args=model_args,
                **{
                    "replan_every": args.replan_every,
                    **setting,
                    **PEERS.get(side, ("", {}))[1],
                },
            )
            for side in order
        }  # fmt: skip
        t0 = time.perf_counter()
        clock = expert_clock(mcfg, world, args.steps, skip)
        trained, timed = train_in_turns(
            [cfgs[p] for p in order], world, root / f"{name}-{r}.turns", clock
        )
        done = dict(zip(order, trained, strict=True))
        clocked.append(timed)
        for policy in order:
            runs[policy].append(done[policy])
        print(
            f"{name} round {r}: "
            + ", ".join(f"{p} {tok_s(done[p], skip):,.0f} tok/s" for p in order)
            + (f", c {clocked[-1]['c_s'] * 1e6:.1f} us" if clocked else "")
            + f" ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )
    balanced = slots_balanced(orders)
    if not balanced:
        print(
            f"{name}: the runs did not take every slot of the turns equally often "
            f"({args.repeats} rounds of {len(sides)} runs); the slot's cost is not cancelled",
            file=sys.stderr,
        )
    c_after = expert_seconds_per_token(*shape)["c_s"]
    c_alone = min(c_before, c_after)  # a timing is only ever slowed by the machine's other work
    # each round's ideal prices its static run at the c timed in its own turns
    c_rounds = [t["c_s"] for t in clocked] if clocked else [c_alone] * args.repeats
    c = statistics.median(c_rounds)
    cores = shared_cores(world, world, threads=1)  # each rank runs 1 thread
    static_tok = [tok_s(x, skip) for x in runs["static"]]
    auto_tok = [tok_s(x, skip) for x in runs["auto"]]
    ideals = [
        ideal_of(x, c_r, skip, cores=cores) for x, c_r in zip(runs["static"], c_rounds, strict=True)
    ]
    shed = [
        shed_pairs_worth(s, a, c_r, skip, cores=cores)
        for s, a, c_r in zip(runs["static"], runs["auto"], c_rounds, strict=True)
    ]
    premises = [x["premise"] for x in shed if x["premise"] is not None]
    accounts = [
        gain_accounting(s, a, c_r, skip, cores=cores)
        for s, a, c_r in zip(runs["static"], runs["auto"], c_rounds, strict=True)
    ]
    static_tok_s = statistics.median(static_tok)
    auto_tok_s = statistics.median(auto_tok)
    paired = [a / b for a, b in zip(auto_tok, static_tok, strict=True)]  # per round
    auto_second = [o.index("auto") > o.index("static") for o in orders]
    speedup = position_balanced(paired, auto_second)
    ideal_speedup = statistics.median(i["ideal_speedup"] for i in ideals)
    verdict = judge(speedup, ideal_speedup)
    # Cross-check of c from the runs: rank 0's forward expert seconds against its own load,
    # times 3 (backward is twice forward).
    st = runs["static"][0]
    w = measured(st, skip)
    fwd = st.moe_phases.get("experts", np.zeros(len(st.step_s)))[w]
    own = st.device_tokens[w][:, :, 0].sum(axis=1)
    varies = len(own) > 2 and np.ptp(own) > 0
    c_run = 3.0 * float(np.polyfit(own, fwd, 1)[0]) if varies else float("nan")
    static_ph = {
        k: statistics.median(phase_ms(x, skip)[k] for x in runs["static"])
        for k in runs["static"][0].phases
    }
    auto_ph = {
        k: statistics.median(phase_ms(x, skip)[k] for x in runs["auto"])
        for k in runs["auto"][0].phases
    }
    return {
        "bench": "train_speedup",
        "setting": name,
        "static_tok_s": round(static_tok_s, 1),
        "auto_tok_s": round(auto_tok_s, 1),
        "speedup": round(speedup, 4),
        "speedup_median": round(statistics.median(paired), 4),
        "speedup_of_medians": round(auto_tok_s / static_tok_s, 4),
        "speedup_rounds": [round(x, 4) for x in paired],
        "auto_second_rounds": auto_second,
        "slots_balanced": balanced,
        "ideal_speedup": round(ideal_speedup, 4),
        "gain_fraction": verdict["gain_fraction"],
        "target_met": verdict["target_met"],
        "judged_gain": verdict["judged_gain"],
        "no_harm": verdict["no_harm"],
        "rule": verdict["rule"],
        "fraction_of_ideal": verdict["fraction_of_ideal"],
        "ranks": world,
        "shared_cores": cores,
        "model": {
            "experts": mcfg.num_experts,
            "top_k": mcfg.top_k,
            "d_model": mcfg.d_model,
            "d_expert": mcfg.d_expert,
            "layers": mcfg.moe_layers,
        },
        "steps": args.steps,
        "measured_steps": args.steps - skip,
        "windows": window_figures(
            runs["static"], runs["auto"], c_rounds, skip, args.window, cores=cores
        ),
        "repeats": args.repeats,
        "replan_every": args.replan_every,
        "static_tok_s_runs": [round(x, 1) for x in static_tok],
        "auto_tok_s_runs": [round(x, 1) for x in auto_tok],
        "ideal_speedup_runs": [round(i["ideal_speedup"], 4) for i in ideals],
        "static_max_over_mean": round(statistics.median(i["max_over_mean"] for i in ideals), 3),
        "auto_max_over_mean": round(statistics.median(x.max_over_mean for x in runs["auto"]), 3),
        "expert_us_per_token": round(c * 1e6, 3),
        "expert_us_per_token_rounds": [round(x * 1e6, 3) for x in c_rounds],
        "expert_us_per_token_timed": "in turns" if clocked else "alone, before and after",
        # per round, the quartiles of the clock's per-sweep slopes (the spread within a run)
        "expert_us_per_token_quartiles": [
            [round(float(q) * 1e6, 2) for q in np.percentile(t["c_sweeps_s"], [25, 50, 75])]
            for t in clocked
        ],
        "expert_us_per_token_before_after": [round(c_before * 1e6, 3), round(c_after * 1e6, 3)],
        "expert_us_per_token_from_run": round(c_run * 1e6, 3),
        "non_expert_ms": round(statistics.median(i["non_expert_ms"] for i in ideals), 1),
        "slowest_expert_ms": round(statistics.median(i["slowest_expert_ms"] for i in ideals), 1),
        "balanced_expert_ms": round(statistics.median(i["balanced_expert_ms"] for i in ideals), 1),
        # the ideal's premise per round (`poise.report.ideal.shed_pairs_worth`): over the later
        # half of the steps, (ms saved + ms auto paid to shed pairs) / (the shed pairs at c);
        # 1 where each pair the slowest ranks shed saved c, as the ideal assumes
        "shed_pairs_premise": round(statistics.median(premises), 3) if premises else None,
        "shed_pairs_rounds": shed,
        # where the ideal's gain went, per round (`poise.report.gain_accounting`): the shares
        # of it auto achieved and lost on the static layout, to probe and switch steps, and,
        # under its plans, to the imbalance left, its transfers and the rest; their medians
        "gain_accounting": accounting_medians(accounts),
        "gain_accounting_rounds": accounts,
        "static_phase_ms": {k: round(v, 1) for k, v in static_ph.items()},
        "auto_extra_phase_ms": {k: round(auto_ph[k] - static_ph[k], 1) for k in static_ph},
        "auto_moe_ms": {
            k: round(statistics.median(x.moe_phase_mean(k) for x in runs["auto"]) * 1e3, 1)
            for k in ("transfers", "plan")
        },
        # each auto run's own paired clock (probe steps against their neighbours, in-run: the
        # drift between runs cancels): ms a step the replicas saved, its standard error, probes
        "auto_paired_clock_ms": [paired_clock_ms(x) for x in runs["auto"]],
        # ... and what the run's fitted cost model predicted it would measure, ms a step
        "auto_modelled_clock_ms": [modelled_clock_ms(x) for x in runs["auto"]],
        # what each auto run decided, in order: "step decision rN mM" (N replica slots in
        # force after it, M homes moved), so a round's harm can be read off its decisions
        "auto_decisions": [decisions_text(x) for x in runs["auto"]],
        # peers in the same turns: their speedup over static and auto's over them, per round
        "peers": {
            peer: peer_figures(
                runs[peer],
                runs["static"],
                runs["auto"],
                ideal_speedup,
                skip,
                [o.index(peer) > o.index("static") for o in orders],
            )
            for peer in args.peers
        },
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def peer_figures(
    peer: list[Any],
    static: list[Any],
    auto: list[Any],
    ideal_speedup: float,
    skip: int,
    second: list[bool],
) -> dict[str, Any]:
    """A peer policy's runs against the same rounds' static and auto runs: `speedup` (peer /
    static tokens/s per round, `position_balanced` by `second[r]`: whether the peer ran after
    static in round r), its `gain_fraction` against the same ideal,
    `auto_over_peer` (median over rounds of auto / peer), `auto_gain_share` (median over
    rounds of auto's gain over static as a share of the peer's: against `free`, auto's gain
    fraction of the measured ideal), the peer's slowest/mean load and its plan changes per
    run."""
    from poise.report.ideal import judge, position_balanced

    peer_tok = [tok_s(x, skip) for x in peer]
    over_static = [p / tok_s(s, skip) for p, s in zip(peer_tok, static, strict=True)]
    auto_over = [tok_s(a, skip) / p for a, p in zip(auto, peer_tok, strict=True)]
    speedup = position_balanced(over_static, second)
    # auto's gain over static as a share of the peer's, per round (None where the peer gained
    # nothing): against `free`, auto's gain fraction of the measured ideal
    shares = [
        (tok_s(a, skip) / tok_s(s, skip) - 1) / (g - 1) if g > 1 else None
        for a, s, g in zip(auto, static, over_static, strict=True)
    ]
    judged = [x for x in shares if x is not None]
    return {
        "tok_s_runs": [round(x, 1) for x in peer_tok],
        "speedup": round(speedup, 4),
        "speedup_rounds": [round(x, 4) for x in over_static],
        "gain_fraction": judge(speedup, ideal_speedup)["gain_fraction"],
        "auto_over_peer": round(statistics.median(auto_over), 4),
        "auto_over_peer_rounds": [round(x, 4) for x in auto_over],
        "auto_gain_share": round(statistics.median(judged), 3) if judged else None,
        "auto_gain_share_rounds": [None if x is None else round(x, 3) for x in shares],
        "max_over_mean": round(statistics.median(x.max_over_mean for x in peer), 3),
        "plan_changes": [x.plan_changes for x in peer],
    }


def decisions_text(run: Any) -> list[str]:
    """`run`'s decisions (`MeasuredRun.decisions`) as "step decision rN mM" strings."""
    return [
        f"{d['step']} {d['decision']} r{d['replicas']} m{d['moved_homes']}"
        for d in getattr(run, "decisions", [])
    ]


def accounting_medians(accounts: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per share of `poise.report.gain_accounting` (`achieved`, then each cause lost), its
    median over the rounds (None where no round had a gain to share)."""
    from poise.report.gain_accounting import CAUSES

    def median(values: list[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return round(statistics.median(kept), 3) if kept else None

    out = {"achieved": median([a["achieved"] for a in accounts])}
    out.update({k: median([a["lost"][k] for a in accounts]) for k in CAUSES})
    return out


def paired_clock_ms(run: Any) -> list[float] | None:
    """`[saving, standard error, probes]` of an auto run's last verdict with probe steps (ms a
    step; `poise.runtime.control.clock.paired_clock`), None when it never had one."""
    v = getattr(run, "last_evidence", {}) or {}
    if not v.get("probes") or v.get("clock_s") is None:
        return None
    return [round(v["clock_s"] * 1e3, 1), round(v["clock_se_s"] * 1e3, 1), int(v["probes"])]


def modelled_clock_ms(run: Any) -> float | None:
    """The model's prediction of the same last verdict's paired clock (ms a step;
    `poise.runtime.control.clock.modelled_clock_parts`), None when the run never probed."""
    v = getattr(run, "last_evidence", {}) or {}
    if not v.get("probes") or v.get("modelled_clock_s") is None:
        return None
    return round(v["modelled_clock_s"] * 1e3, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from poise.train.data import build_corpus

    build_corpus(None)  # the corpus cache, once, before any rank starts
    with tempfile.TemporaryDirectory(prefix="poise-train-speedup-") as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        for name in args.settings:
            print(json.dumps(bench_setting(name, args, root)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
