"""Soak: a long run's memory, plans that agree on every rank, and no checkpoint lost to 20 kills.

    .venv/bin/python benchmarks/soak.py                 # 2,000 steps + 20 kills, ~15 min
    .venv/bin/python benchmarks/soak.py --steps 300 --kills 4     # a quick look

Part 1 (memory, plans): 2 gloo ranks train the `tiny` model (context 32, global batch 8) for
`--steps` steps with `auto` re-planning every 5. Each rank samples its resident memory (VmRSS)
after every step and records a digest of the plan in force. `rss_growth_pct_per_1k_steps` is the
least-squares slope of RSS over the steps after the first quarter (allocator and caches warm up
first), per 1,000 steps, as a percentage of the RSS at the start of that span; the larger of the
two ranks. `plans_identical`: both ranks held the same plan at every step (the Balancer would
also have raised `PlanMismatchError` otherwise).

Part 2 (kills): `poise train --nproc 2` (real processes) continues one run (checkpoint every 3
steps, all kept) from its latest checkpoint for 8 more steps, and one rank is killed by SIGKILL
at a random step and phase (`poise.train.faults`: between steps, inside Agg, Trans, a migration
or half-way through writing a checkpoint). After each kill, every checkpoint that existed before
it must still load; `checkpoints_lost` counts those that do not, and `latest` must name a
loadable one. Rounds whose fault phase does not occur (no migration in those 8 steps, say)
finish and do not count; rounds go on until `--kills` kills.

One JSON line: `bench` ("soak"), `steps`, `rss_growth_pct_per_1k_steps`, `plans_identical`,
`kills`, `checkpoints_lost`, plus `rss_mib` (start, end), `seconds`, `kill_phases`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from poise.runtime.launch import run_ranks

ROUND_STEPS = 8  # steps per kill round
FAULT_PHASES = ("step", "forward", "backward", "agg", "trans", "migrate", "checkpoint")
SETTINGS = {
    "context": 32,
    "batch": 8,
    "eval_every": 0,
    "aux_loss": 0.0,
    "spare_slots": 2,
    "warmup": 10,
    "lr": 1e-3,
    "tensorboard": False,
    "progress": False,
    "record_trace": False,
    "log_every": 1000,
}


def rss_bytes() -> int:
    """This process's resident set size (VmRSS from /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _soak_rank(rank: int, world: int, root: str, steps: int) -> dict[str, Any]:
    """Train `steps` steps; after each, this rank's RSS and the digest of the plan in force."""
    from poise.runtime.balancer import Balancer
    from poise.train import TrainConfig, train

    rss: list[int] = []
    plans: list[int] = []
    original = Balancer.step

    def step(self: Balancer) -> Any:
        stats = original(self)
        rss.append(rss_bytes())
        plans.append(self.plan.digest())
        return stats

    Balancer.step = step  # type: ignore[method-assign]
    cfg = TrainConfig(
        model="tiny",
        steps=steps,
        policy="auto",
        replan_every=5,
        checkpoint_every=0,
        cache_dir=f"{root}/cache",
        out=f"{root}/soak",
        **SETTINGS,
    )
    result = train(cfg, quiet=True)
    return {"rss": rss, "plans": plans, "losses": result.losses}


def growth_pct_per_1k(rss: list[int]) -> float:
    """Least-squares slope of RSS over the steps after the first quarter, per 1,000 steps, in
    percent of the RSS where that span starts."""
    y = np.asarray(rss, dtype=np.float64)
    start = len(y) // 4
    x = np.arange(start, len(y), dtype=np.float64)
    slope = np.polyfit(x, y[start:], 1)[0]
    return float(slope * 1000.0 / y[start] * 100.0)


def _argv(root: Path, steps: int, extra: list[str]) -> list[str]:
    argv = ["train", "tiny", "--nproc", "2", "--steps", str(steps), "--policy", "auto"]
    argv += ["--replan-every", "2", "--out", str(root / "killed"), "--quiet"]
    sets = {
        **SETTINGS,
        "checkpoint_every": 3,
        "keep_checkpoints": 10_000,
        "cache_dir": str(root / "cache"),
    }
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv + extra


def _loadable(path: Path) -> bool:
    from poise.core.errors import PoiseError
    from poise.train.checkpoint import read_file

    try:
        read_file(path)
    except (PoiseError, OSError, RuntimeError, EOFError):
        return False
    return True


def kill_rounds(root: Path, kills: int, seed: int) -> tuple[int, int, list[str]]:
    """`(kills done, checkpoints lost, phases)`: continue one run until a rank has been killed
    `kills` times, each round `ROUND_STEPS` steps long with a rank killed at a random step and
    phase inside it (a fault whose phase does not occur in the round, e.g. no migration, lets the
    round finish; the next round goes on from there), checking the checkpoints after each kill."""
    from poise.cli import main
    from poise.train.checkpoint import resolve

    rng = random.Random(seed)
    folder = root / "killed" / "checkpoints"
    done, lost, phases = 0, 0, []
    for _ in range(4 * kills):
        if done >= kills:
            break
        before = sorted(folder.glob("step-*.pt")) if folder.is_dir() else []
        resume = ["--resume", str(folder)] if before else []
        start = int(before[-1].stem.split("-")[1]) if before else 0
        phase = rng.choice(FAULT_PHASES)
        step = start + rng.randint(1, ROUND_STEPS)
        fault = ["--fail-at-step", str(step), "--fail-rank", str(rng.randint(0, 1))]
        fault += ["--fail-phase", phase]
        code = main(_argv(root, start + ROUND_STEPS, resume + fault))
        if code == 0:
            print(f"{phase} at step {step} did not occur in this round", file=sys.stderr)
            continue
        if code == 2:
            raise RuntimeError(f"bad input in a kill round (exit 2), {phase} at step {step}")
        done += 1
        phases.append(phase)
        lost += sum(1 for p in before if not (p.exists() and _loadable(p)))
        if folder.is_dir() and any(folder.glob("step-*.pt")) and not _loadable(resolve(folder)):
            lost += 1
        print(f"kill {done}: {phase} at step {step} (exit {code}), lost {lost}", file=sys.stderr)
    return done, lost, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="poise-soak-") as d:
        root = Path(d)
        ranks = run_ranks(_soak_rank, 2, str(root), args.steps, timeout_s=6 * 3600)
        growth = max(growth_pct_per_1k(r["rss"]) for r in ranks)
        print(f"part 1: RSS growth {growth:.3f}% per 1k steps", file=sys.stderr, flush=True)
        identical = ranks[0]["plans"] == ranks[1]["plans"] and len(ranks[0]["plans"]) == args.steps
        kills, lost, phases = kill_rounds(root, args.kills, args.seed)
    print(
        json.dumps(
            {
                "bench": "soak",
                "steps": args.steps,
                "rss_growth_pct_per_1k_steps": round(growth, 3),
                "plans_identical": identical,
                "kills": kills,
                "checkpoints_lost": lost,
                "rss_mib": [
                    round(ranks[0]["rss"][0] / 2**20, 1),
                    round(ranks[0]["rss"][-1] / 2**20, 1),
                ],
                "plan_changes": int(np.sum(np.diff(ranks[0]["plans"]) != 0)),
                "kill_phases": phases,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
