"""Each rank's expert compute under uniform routing, static EP and `ep_step`'s ideal.

    .venv/bin/python benchmarks/expert_shapes.py --data ../shared/data      # ~40 s

Why `benchmarks/ep_step.py`'s ideal is the trace's own loads dealt evenly to the ranks' homes
(`ideal_trace`) and not uniform routing: the two give the ranks the same number of rows, but
not the same GEMMs. Per trace of `ep_step` (`--traces`; its shapes and flags) and per layer,
each rank's home experts at the trace's first step, each source rank's counts scaled to its
tokens as `ReplayRouter` scales them, three ways: `uniform` (every expert the mean load);
`static` (the contiguous homes of static EP); `balanced` (the homes of `ep_step`'s ideal,
`poise.report.ideal_homes.balanced_order`). Each rank's experts are `poise.nn.Experts` (SwiGLU,
fp32, one intra-op thread) forward and backward, the median of `--repeats` interleaved timings
(`calibrate.experts.interleaved_medians`).

One JSON line per trace: `*_ms`, the sum over the layers of the slowest rank's expert time (a
layer lasts as long as its slowest rank's experts); `rank_ms` and `rank_rows`, each rank's sums;
`balanced_over_uniform`, what the balanced trace's GEMMs cost over as many rows in equal ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_step
from poise.calibrate.experts import interleaved_medians
from poise.nn.experts import Experts
from poise.nn.router import scaled_counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--traces", nargs="+", default=["smartmoe-5001", "zipf-1.2"])
    known, rest = p.parse_known_args(argv)
    shapes = ep_step.parse_args(rest)  # --data, --experts, --d-model, ... as ep_step takes them
    for key, value in vars(known).items():
        setattr(shapes, key, value)
    return shapes


def routed_rows(trace: Any, args: argparse.Namespace) -> np.ndarray:
    """`[L, D, P]`: the rows each rank's P home experts compute per layer at the trace's first
    step, each source rank's counts scaled to its tokens as `ReplayRouter` scales them."""
    rows = np.stack([
        np.stack([scaled_counts(trace.counts[0, layer, src], args.tokens * args.top_k,
                                args.tokens) for src in range(trace.devices)]).sum(axis=0)
        for layer in range(trace.layers)
    ])  # fmt: skip
    return rows.reshape(trace.layers, trace.devices, -1)


def timed_ms(rows: np.ndarray, args: argparse.Namespace) -> np.ndarray:
    """`[L, D]` ms: forward + backward of `Experts` over each rank's `rows[L, D, P]`, the
    median of `args.repeats` timings."""
    out = np.zeros(rows.shape[:2])
    gen = torch.Generator().manual_seed(0)
    for (layer, rank), counts in np.ndenumerate(rows.sum(axis=2)):
        per = [int(c) for c in rows[layer, rank]]
        experts = Experts(len(per), args.d_model, args.d_expert, "swiglu")
        x = torch.randn(int(counts), args.d_model, generator=gen, requires_grad=True)
        gy = torch.randn(int(counts), args.d_model, generator=gen)

        def run(_: int, experts=experts, x=x, gy=gy, per=per) -> None:
            experts(x, per).backward(gy)
            experts.zero_grad(set_to_none=True)
            x.grad = None

        out[layer, rank] = interleaved_medians(run, [int(counts)], args.repeats)[0] * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    for name in args.traces:
        load = round(os.getloadavg()[0], 2)
        balanced = routed_rows(ep_step.load_trace(f"ideal:{name}", args), args)
        rows = {
            "uniform": np.full_like(balanced, args.tokens * args.top_k // args.experts
                                    * balanced.shape[1]),
            "static": routed_rows(ep_step.load_trace(name, args), args),
            "balanced": balanced,
        }  # fmt: skip
        ms = {k: timed_ms(v, args) for k, v in rows.items()}
        # a layer lasts as long as its slowest rank's experts
        slowest = {k: float(v.max(axis=1).sum()) for k, v in ms.items()}
        line = {
            "bench": "expert_shapes",
            "trace": name,
            **{f"{k}_ms": round(v, 1) for k, v in slowest.items()},
            "rank_ms": {k: v.sum(axis=0).round(1).tolist() for k, v in ms.items()},
            "rank_rows": {k: v.sum(axis=(0, 2)).tolist() for k, v in rows.items()},
            "balanced_over_uniform": round(slowest["balanced"] / slowest["uniform"], 3),
            "static_over_balanced": round(slowest["static"] / slowest["balanced"], 3),
            "load_avg_1min": [load, round(os.getloadavg()[0], 2)],
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
