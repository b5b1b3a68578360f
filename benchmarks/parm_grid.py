"""Parm's grid: speedups of S1, S2 and the automatic choice over DeepSpeed-MoE's schedule.

1,296 MoE-layer configurations (`poise.sim.parm_grid.AXES`: B, L, M, H, E, k, f, N_MP = N_ESP)
on each cluster: `parm-8gpu` (one 8-GPU server) and `parm-32gpu` (8 nodes of 4 GPUs, one
100 Gb/s NIC per node), Parm's two testbeds, plus `parm-32gpu-nic-per-gpu` (one NIC per GPU, not
Parm's), where S2 can win. Every configuration is priced under each schedule by the event model
(`poise.sim.parm_events`, the "truth"); the choice uses Parm's alpha-beta condition
(`poise.layouts.parm.choose_schedule`).

One JSON line per cluster. Keys: bench ("parm_grid"), cluster, devices, configs, s1, s2, choice,
oracle (each: min, p10, median, p90, max of truth(baseline) / truth(schedule); oracle = the
faster of S1 and S2), choice_accuracy (fraction of configurations where the choice is the truly
faster of S1 and S2), choice_loss (median and max of truth(chosen) / truth(faster)), chosen and
truly_faster (counts of s1 / s2), published_speedup ([1.13, 5.77]: Parm's range over DeepSpeed-
MoE on its 1,296 layers), parm_testbed (false for the extra cluster), wall_s.

Run from the repository root: .venv/bin/python benchmarks/parm_grid.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

from poise.sim.parm_grid import EXTRA_CLUSTERS, PARM_CLUSTERS, PUBLISHED_SPEEDUP, run_grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced grid (seconds)")
    args = parser.parse_args()
    clusters = [(c, True) for c in PARM_CLUSTERS.values()]
    clusters += [(c, False) for c in EXTRA_CLUSTERS.values()]
    for cluster, testbed in clusters:
        t0 = time.perf_counter()
        result = run_grid(cluster, quick=args.quick)
        line = {"bench": "parm_grid", **result.summary()}
        line["published_speedup"] = list(PUBLISHED_SPEEDUP)
        line["parm_testbed"] = testbed
        line["wall_s"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
