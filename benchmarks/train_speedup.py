"""Training throughput of `auto` balancing over static expert parallelism, against the ideal.

    .venv/bin/python benchmarks/train_speedup.py                      # tiny, ~4 min on 2 cores
    .venv/bin/python benchmarks/train_speedup.py --settings all       # every setting, ~50 min
    .venv/bin/python benchmarks/train_speedup.py --settings skewed --steps 60 --repeats 1

Each run is real training: `python -m poise.train` on the setting's local gloo ranks (2 or 4,
1 thread each), started by `poise train --nproc N`'s launcher, the `tiny` GPT-MoE (with the
setting's expert shapes) on the Python standard library, no auxiliary loss, seed 0, `--steps`
steps. A round runs static and auto at once, taking their steps in turns (`poise.train.turns`:
static's step k, then auto's step k, then static's step k + 1, ...; each run's ranks sleep
while the other's step runs, auto's planner is stopped then and its Trans has landed), so the
machine's drift falls on both within a second; the order of the runs changes from round to
round (`round_order`: static, auto[, peer], then reversed, then the next rotation and its
reverse): with two runs each takes each slot over every pair of rounds, with a peer over six
rounds (`slots_balanced` in the line; a note on stderr where the rounds do not balance them).
`--sequential` runs them one after the other instead, as before: on the shared 2-core machine
identical static runs made one after the other differ by 10-15% in tokens/s, and identical runs
in turns by about 1%
(docs/benchmarks.md).
`--peers eplb` runs DeepSeek's EPLB in the same turns as a third run of every round (the
runtime's `eplb` policy, re-planned every `--replan-every` steps and adopted without a cost
check, as published: `balance_guard` off); its line under `peers` gives its speedup over static,
its gain fraction against the same ideal, and `auto_over_peer`, auto / EPLB per round. EPLB
balances nearly perfectly and pays the replicas' transfers, so it also measures what balance
nets on this machine once those are paid. `--peers auto-link` runs `auto` with the host link
(`host_link: true`: Trans, Agg and migrations through shared memory) as the third run, so
`auto_over_peer` compares the two paths of the same policy in the same turns. `--peers free`
runs the ideal for real (`free_balancing: true`, `poise.train.instruments`): EPLB's plans
from the latest loads at every step, with its Agg, planning, migration and Trans done at the
step boundary and left out of the step's time, so it balances as well as the spare slots and
the per-step split allow with every transfer free, and pays what balance itself costs (the
busy neighbours, the smaller GEMMs, the all-to-all's other routes, the split); its
`auto_gain_share` is auto's gain fraction against that measured ideal. Its parts:
`--peers free-paced` (EPLB re-planned every `--replan-every` steps, free) and `auto-free`
(auto's own plans, every one adopted, free) show what re-planning less often and auto's choice
of replicas cost apart from the transfers' seconds.
`--peers static-again` runs static a second time in the same turns: its `speedup` is the
comparison's own spread in the rounds auto was measured in (A/A), the floor under which an
auto/static figure near 1 says nothing, and its `auto_over_peer` auto against that second
static run. `--identical`
runs static on both sides (the "auto" fields then describe the second static run): the spread
of the comparison itself.
`--auto-set KEY=VALUE` (repeatable) changes a training setting of the auto side only, e.g.
`probe_every=0` to see what the guard's probe steps cost; the line lists them under
`auto_settings`.

Per run, the first `replan_every + 2` steps are warm-up; over the rest,
`tok_s = tokens per step * steps / seconds` (the steps where auto re-plans and migrates count
with their full cost; a step's seconds leave out the turns it waited). A round is one static
and one auto run; the machine's speed drifts between rounds by more than balance changes a
step (other processes, frequency), so the speedup is paired: per round auto_tok_s /
static_tok_s of the same round (`speedup_rounds`), and going first costs a run a few per cent
on shared cores (static against static on `skewed-4`: 1.023 and 0.964 by order), so `speedup`
is `poise.report.ideal.position_balanced` of them: the geometric mean of the median ratio of
the rounds where auto ran second (`auto_second_rounds`) and of those where it ran first (the
median of all rounds with `--repeats 1`); a peer's speedup alike. `speedup_median` is the plain
median over rounds (the judged figure before this), `static_tok_s`, `auto_tok_s` the medians
over the rounds, and `speedup_of_medians` their ratio, for comparison.
With more `--steps` than `--window` (default 100), `windows` also gives the speedup, ideal and
gain fraction of each window of that many steps (`window_figures`): a run from scratch spends
its first tens of steps in the router's warm-up, where loads move faster than plans follow,
and later windows show what balancing nets past it (`skewed` over 300 steps: gain fraction
0.32-0.33 over steps 13-100, 0.43-0.61 a window after; docs/benchmarks.md). The judged
figures stay the whole run's.

The ideal (`poise.report.ideal`) comes from the static runs' recorded loads: each MoE layer
costs its slowest rank's expert compute, perfectly balanced experts the mean rank's. With
`n[s, l, r]` the token-expert pairs rank r computes in layer l at step s and `c` the seconds per
routed token of one expert's forward and backward: the setting's `poise.nn.Experts` at 1
thread, forward + backward at 1,024 and 4,096 rows, the slope of a least-squares line, timed
*in the round's own turns* (`poise.commands.expert_clock`: a third or fourth participant of the
counter file that times one sweep every 5th measured step while the runs wait, so its samples
meet the machine the steps meet, within seconds of them; each round's ideal uses its own `c`).
Timed alone before the first round and after the last instead, as before, `c` read 15-32 us
within one day for the same experts and moved the ideal by about 30%; both of those timings are
still in the JSON line (`expert_us_per_token_before_after`), and with `--sequential` (no turns)
the smaller of them is used:

    excess[s]   = c * sum_l (max_r n[s, l, r] - mean_r n[s, l, r])
    ideal[s]    = step_static[s] - excess[s]          (the non-expert part as measured)
    ideal_speedup = sum_s step_static[s] / sum_s ideal[s]       (per static run; median)

The ideal is balance for free: no Trans, Agg, migration or planning. Its premise, that each
pair the slowest ranks shed saves `c`, is tested per round (`shed_pairs_rounds`, median
`shed_pairs_premise`; `poise.report.ideal.shed_pairs_worth`): over the later half of the steps,
the ms auto saved plus what it paid to shed pairs (its transfers inside forward and backward,
and its extra `balance`, which holds the boundary's), over the shed pairs at `c`; 1 where the
premise holds. `gain_accounting` charges the ideal's gain step by step
(`poise.report.gain_accounting`): the shares auto achieved and lost on the static layout, on
probe and switch steps, and under its plans to the imbalance left, its transfers and the rest
(medians over the rounds; `gain_accounting_rounds` per round). With more ranks than
cores (4 ranks on 2 cores) a rank waiting at an all-to-all sleeps and leaves its core to the
others, so a layer's expert work takes max(slowest rank, total / C), C the cores' worth the
ranks get (`poise.runtime.plan_inputs.shared_cores`), balanced or not: the ideal then uses
max(max_r n, sum_r n / C) and max(mean_r n, sum_r n / C) (`poise.report.ideal`), as the cost
model does (`HostCosts.shared_cores`); `shared_cores` in the JSON line gives C (0: none).

Judged (`poise.report.ideal.judge`): `gain_fraction = (speedup - 1) / (ideal_speedup - 1)`, the
share of the possible gain achieved, must be >= 0.75 where `ideal_speedup >= 1.10`; in every
setting `speedup >= 0.99` (do no harm). `target_met` is both. `fraction_of_ideal = speedup /
ideal_speedup` is printed but not judged: it rewards doing nothing when the ideal is small.
The JSON line also gives the measured parts: non-expert ms per step, slowest-rank expert ms per
step, the mean slowest/mean rank load, and auto's extra ms per step by phase over static; and
`auto_paired_clock_ms`, per auto run, the guard's last paired clock (`[saving ms a step,
standard error, probes]`: probe steps against their neighbours within the run, which the
machine's drift between runs does not reach; None where the run never probed) and
`auto_modelled_clock_ms`, what the run's fitted cost model predicted that clock would measure
(`poise.runtime.paired_clock.modelled_clock`; None where the run never probed);
`auto_decisions`, per auto run, its Balancer's decisions in order ("11 adopt r5 m0": at step
11 it adopted a plan with 5 replica slots, moving no home).

Settings (one JSON line each; `--settings all` runs every one):

- `tiny`, 2 ranks: the preset (8 experts top-2, d_expert 256): little imbalance, experts about
  a third of the step; only "do no harm" is judged when its ideal is below 1.10;
- `skewed`, 2 ranks: 16 experts top-1, d_expert 1024: fewer, larger expert choices per token,
  so the router's skew weighs more in the step;
- `many-experts`, 2 ranks: 32 experts top-2, d_expert 512: 16 experts per rank, so a plan can
  move load in small pieces;
- `skewed-4`, 4 ranks: 32 experts top-1, d_expert 1024 (8 per rank): the slowest of 4 ranks
  sets each layer;
- `skewed-micro4`, 2 ranks: `skewed` with 4 micro-batches of 16 sequences a step (gradient
  accumulation, `micro_batches: 4`): the replicas' Trans and Agg run once a step for four
  micro-batches of compute, as where a step holds many micro-batches (pipeline schedules,
  large global batches). Its ideal is taken from the step's counts, summed over the
  micro-batches, so it leaves out the imbalance that cancels between them: on `skewed`'s static
  runs, groups of 4 consecutive steps summed lose 2.1% of the steps' own excess
  (docs/benchmarks.md), an upper bound for 4 micro-batches of one step.
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
    "auto-link": ("auto", {"host_link": True}),
    # the ideal, measured: EPLB's plans from the latest loads at every step, with Agg, planning,
    # migration and Trans at the step boundary and left out of the step's time
    # (`poise.train.instruments.FreeBalancing`)
    "free": ("eplb", {"balance_guard": False, "free_balancing": True, "replan_every": 1}),
    # ... its parts: EPLB at the runs' own re-plan period, and auto's own plans (every one
    # adopted), with free transfers
    "free-paced": ("eplb", {"balance_guard": False, "free_balancing": True}),
    "auto-free": ("auto", {"balance_guard": False, "free_balancing": True}),
    # auto whose replica slots stay on the experts the plan chose (no per-step retargeting)
    "auto-fixed": ("auto", {"retarget": False}),
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
        "--identical",
        action="store_true",
        help="run static on both sides (A/A): the spread of the comparison itself",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=[],
        choices=sorted(PEERS),
        help="peer runs in turns beside static and auto (eplb: DeepSeek's EPLB; auto-link: auto "
        "with the host link; free: the ideal measured, EPLB every step with free transfers; "
        "free-paced, auto-free: EPLB at the re-plan period and auto, free; static-again: "
        "static a second time, the comparison's own spread)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="run a round's static and auto one after the other, not step by step in turns",
    )
    p.add_argument(
        "--auto-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a training setting for the auto side only, its value as YAML (e.g. probe_every=0);"
        " repeatable",
    )
    args = p.parse_args(argv)
    args.auto_settings = auto_settings(p, args.auto_set)
    if "all" in args.settings:
        args.settings = list(SETTINGS)
    args.settings = list(dict.fromkeys(args.settings))
    return args


def auto_settings(parser: argparse.ArgumentParser, pairs: list[str]) -> dict[str, Any]:
    """`["probe_every=0", ...]` -> `{"probe_every": 0}` (values read as YAML); a pair without
    `=`, or a key that is no `TrainConfig` field, is a usage error. The values themselves are
    checked by `TrainConfig`."""
    import dataclasses

    import yaml

    from poise.train.config import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            parser.error(f"--auto-set expects KEY=VALUE, got {pair!r}")
        if key not in known:
            parser.error(f"--auto-set: {key!r} is not a training setting (poise.train.config)")
        out[key] = yaml.safe_load(value)
    return out


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
    # the side called "auto" runs `static` too with --identical: the instrument's own spread
    policy_of = {side: PEERS[side][0] if side in PEERS else side for side in sides}
    policy_of["auto"] = "static" if args.identical else "auto"
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
                    **(args.auto_settings if side == "auto" else {}),
                },
            )
            for side in order
        }  # fmt: skip
        t0 = time.perf_counter()
        if args.sequential:
            done = {policy: train(cfgs[policy], world) for policy in order}
        else:
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
    if not balanced and not args.sequential:
        print(
            f"{name}: the runs did not take every slot of the turns equally often "
            f"({args.repeats} rounds of {len(sides)} runs); the slot's cost is not cancelled",
            file=sys.stderr,
        )
    c_after = expert_seconds_per_token(*shape)["c_s"]
    c_alone = min(c_before, c_after)  # a timing is only ever slowed by the machine's other work
    # each round's ideal prices its static run at the c timed in its own turns (in turns), or
    # at the smaller of the timings alone before and after (--sequential)
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
        "compared": "static against static (--identical)" if args.identical else "auto/static",
        "in_turns": not args.sequential,
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
        "auto_settings": args.auto_settings,
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
    step; `poise.runtime.paired_clock.paired_clock`), None when it never had one."""
    v = getattr(run, "last_evidence", {}) or {}
    if not v.get("probes") or v.get("clock_s") is None:
        return None
    return [round(v["clock_s"] * 1e3, 1), round(v["clock_se_s"] * 1e3, 1), int(v["probes"])]


def modelled_clock_ms(run: Any) -> float | None:
    """The model's prediction of the same last verdict's paired clock (ms a step;
    `poise.runtime.paired_clock.modelled_clock`), None when the run never probed."""
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
