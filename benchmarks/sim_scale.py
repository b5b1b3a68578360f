"""Simulator scaling: wall time and peak memory of a replay from 16 to 8,192 devices.

A drifting Zipf trace recorded on 16 devices (64 experts, top-2, 12 MoE layers, 100 steps) is
replayed on `dgx-h100:N` (N nodes of 8 H100) with 16, 128, 1,024 and 8,192 devices, the trace's
source rows resampled onto the modelled devices (`sim.scaling`), re-planning every 10 steps, with
policies static, shadow, prophet and auto (which prices every other policy). Each size runs in a
fresh process so that its peak RSS is its own.

Keys: bench ("sim_scale"), devices, experts, layers, steps, wall_s, peak_rss_mb, plus
mean_step_s per policy (a sanity check: the figures the replay produced).

Run from the repository root: .venv/bin/python benchmarks/sim_scale.py [--devices 16 128 ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

EXPERTS, LAYERS, STEPS, REPLAN = 64, 12, 100, 10
POLICIES = ["static", "shadow", "prophet", "auto"]


def one(devices: int, steps: int) -> dict[str, object]:
    from poise.core.presets import get_cluster
    from poise.core.spec import MODELS
    from poise.sim.simulator import simulate
    from poise.trace.generate import generate

    spec = MODELS["gpt-m"].with_(experts=EXPERTS, moe_layers=LAYERS, top_k=2)
    trace = generate(
        "drift",
        steps=steps,
        layers=LAYERS,
        devices=16,
        experts=EXPERTS,
        top_k=2,
        tokens_per_device=spec.tokens_per_device,
        seed=0,
        s=1.0,
        rate=0.05,
    )
    cluster = get_cluster(f"dgx-h100:{devices // 8}")
    t0 = time.perf_counter()
    result = simulate(trace, cluster, spec, POLICIES, "sync", REPLAN, "ema")
    wall = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "bench": "sim_scale",
        "devices": devices,
        "experts": EXPERTS,
        "layers": LAYERS,
        "steps": steps,
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "mean_step_s": {k: round(r.mean_step_s, 5) for k, r in result.runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="*", default=[16, 128, 1024, 8192])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.steps)), flush=True)
        return
    for devices in args.devices:
        cmd = [sys.executable, __file__, "--one", str(devices), "--steps", str(args.steps)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
