"""`auto`'s planner time in turns: this tree, this tree again (the A/A spread) and optionally
another checkout; one JSON line per case.

The cases are `planner.py`'s (`planner_cases`). Each turn runs every variant in a fresh process,
one after the other, so a busy spell of the machine falls on all of them; a variant's figure is
its fastest turn. A process times `--plans` calls of `auto` in CPU milliseconds a layer (its
least), each call on a new forecast: the cost model's kept pricers are forgotten before it,
where the checkout keeps them (an older one keeps none). With `--replan` each call plans against
a plan in force (`auto`'s on another step's loads), as a live re-plan does: its migrations are
priced; without it, against none (a run's first plan).

Keys: bench, case, replan, turns, plans, this_ms, aa_ms (this tree again), against_ms and ratio
(this_ms / against_ms; only with --against).

Run from the repository root:
    .venv/bin/python benchmarks/planner_turns.py [--turns 10] [--plans 20] [--data ../shared/data]
    git worktree add /tmp/ref 65e85b4 && \\
    .venv/bin/python benchmarks/planner_turns.py --against /tmp/ref/src   # ~2 min
    .venv/bin/python benchmarks/planner_turns.py --against /tmp/ref/src --replan
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OWN_SRC = HERE.parent / "src"
VARIANTS = ("this", "aa")


def time_auto(case: str, plans: int, data: Path, replan: bool) -> float:
    """Least CPU ms a layer of `plans` calls of `auto` on `case`, each on a new forecast;
    with `replan`, against a plan in force (`auto`'s on the case's earlier loads)."""
    sys.path.insert(0, str(HERE))
    from planner import planner_cases  # this tree's cases, on whichever poise is imported
    from poise.plan.policies.registry import make_plan
    from poise.util.heap import retain_freed_memory

    retain_freed_memory()
    _, loads, earlier, ctx = next(c for c in planner_cases(data) if c[0] == case)

    def new_forecast() -> None:
        pricers = getattr(ctx.cost, "pricers", None)  # (older checkouts keep none)
        if pricers is not None:
            pricers._pricers.clear()  # (`PricerCache.clear`, which older checkouts lack)

    new_forecast()
    in_force = make_plan("auto", earlier, None, ctx) if replan else None
    new_forecast()
    make_plan("auto", loads, in_force, ctx)  # warm-up
    best = float("inf")
    for _ in range(plans):
        new_forecast()
        t0 = time.process_time()
        make_plan("auto", loads, in_force, ctx)
        best = min(best, time.process_time() - t0)
    return best * 1e3 / loads.shape[0]


def run_variant(case: str, variant: str, src: Path, args: argparse.Namespace) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, __file__, "--child", case, variant, "--plans", str(args.plans)]
    cmd += ["--data", str(args.data)] + (["--replan"] if args.replan else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--plans", type=int, default=20)
    default_data = os.environ.get("POISE_SHARED_DATA", "../shared/data")
    parser.add_argument("--data", type=Path, default=Path(default_data))
    parser.add_argument("--against", type=Path, help="another checkout's src/ folder")
    parser.add_argument(
        "--replan", action="store_true", help="plan against a plan in force (as live re-plans do)"
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(time_auto(args.child[0], args.plans, args.data, args.replan))
        return
    variants = {v: OWN_SRC for v in VARIANTS}
    if args.against is not None:
        variants["against"] = args.against.resolve()
    for case in ("zipf-256x32", "smartmoe-sample"):
        best = {v: float("inf") for v in variants}
        for turn in range(args.turns):
            for v, src in variants.items():
                best[v] = min(best[v], run_variant(case, v, src, args))
            print(f"{case}: turn {turn + 1}/{args.turns}", file=sys.stderr, flush=True)
        row = {"bench": "planner_turns", "case": case, "replan": args.replan}
        row |= {"turns": args.turns, "plans": args.plans}
        row |= {f"{v}_ms": round(t, 3) for v, t in best.items()}
        if "against" in best:
            row["ratio"] = round(best["this"] / best["against"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
