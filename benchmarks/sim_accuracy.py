"""The simulator against measured training steps on this machine.

    .venv/bin/python benchmarks/sim_accuracy.py          # ~2 min on 2 cores (3 runs per policy)

1. `poise calibrate --d-model 128 --d-expert 256 --threads 1`: this machine's GEMM curve at the
   tiny model's expert widths with 1 thread (what each training rank runs with on 2 cores) and
   the gloo all-to-all between 2 local ranks, written as a 2-device cluster YAML.
2. Real training, 2 local gloo ranks (`poise train --nproc 2`'s launcher), the `tiny` GPT-MoE
   without aux loss, `--steps` steps under `static` and under `auto` (re-planning every
   `--replan-every` steps, priced on the calibrated cluster), each recording its routing trace.
3. The simulator (`poise.sim.simulator.simulate`) replays each run's trace under its own policy
   on the calibrated cluster with a `ModelSpec` of the tiny model, the same slots, re-planning
   interval and predictor, synchronous schedule, planning time charged.

Each policy runs `--repeats` times (static and auto alternating, so load from other work on the
machine falls on both: step times here switch between two levels about 1.6x apart when other
jobs run). Per run: the mean step time over the steps after the first `replan_every + 2`
(rank 0's wall time per step, everything included) and the simulator's mean over the same
steps. `measured_ms` and `predicted_ms` are medians over the runs, `abs_error = |predicted -
measured| / measured`. The last
line has `mean_abs_error` over the policies. Target: <= 0.15.

The tiny model's `ModelSpec`: d_model 128, d_expert 256, SwiGLU, 8 experts top-2, 4 MoE layers,
fp32 (4 bytes), AdamW state 8 bytes per parameter, 1,024 tokens per rank and step (8 sequences
of 128), and non-MoE forward FLOPs per token and block counted from the model: attention
projections 8 d^2, causal attention 2 d (T + 1), router 2 d E, and the tied embedding head's
2 V d shared over the layers.

Each policy's JSON line also carries `phases_ms`: [measured (rank 0), predicted] ms per step for
the parts both sides name: the forward pass, its non-MoE part (measured: forward minus the MoE
layers' own gate, dispatch, experts and combine time) and its MoE part, the expert forward
compute, the forward all-to-alls (measured: the dispatcher's dispatch and combine, which include
sorting tokens and waiting for the slower rank), the backward pass, transfers and planning; and
`not_modelled_ms`, measured phases the cost model does not price (dense gradient all-reduce,
clipping, optimizer step, data). A large error shows up there as the phase that is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speedup import run_config, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--replan-every", type=int, default=10)
    p.add_argument("--policies", nargs="+", default=["static", "auto"])
    p.add_argument("--repeats", type=int, default=3, help="runs per policy, alternating order")
    p.add_argument("--cluster", default=None, help="use this cluster YAML instead of calibrating")
    p.add_argument("--out", default=None, help="working folder (default: a temporary folder)")
    return p.parse_args(argv)


def calibrate(out: Path) -> Path:
    path = out / "calibrated.yaml"
    cmd = [
        sys.executable,
        "-m",
        "poise.cli",
        "calibrate",
        "--out",
        str(path),
        "--d-model",
        "128",
        "--d-expert",
        "256",
        "--threads",
        "1",
    ]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return path


def tiny_spec(mcfg: Any, tokens_per_device: int) -> Any:
    """The `ModelSpec` of a GPT-MoE config (see the module docstring for the FLOPs)."""
    from poise.spec import ModelSpec

    d, T, E, V = mcfg.d_model, mcfg.context, mcfg.num_experts, mcfg.vocab_size
    non_moe = 8 * d * d + 2 * d * (T + 1) + 2 * d * E + 2 * V * d / mcfg.moe_layers
    return ModelSpec(
        "tiny",
        d_model=d,
        d_expert=mcfg.d_expert,
        experts=E,
        top_k=mcfg.top_k,
        moe_layers=mcfg.moe_layers,
        dtype_bytes=4,
        tokens_per_device=tokens_per_device,
        non_moe_flops_per_token=float(non_moe),
        optimizer_bytes_per_param=8.0,
        activation="swiglu",
    )


def compare(policy: str, run: Any, cluster: Any, spec: Any, args: argparse.Namespace) -> dict:
    """Replay one run's trace under its policy; measured and predicted seconds of that run."""
    from poise.sim.simulator import simulate
    from poise.trace import Trace

    trace = Trace.load(run.trace_path)
    slots = spec.experts // 2 + (0 if policy == "static" else int(run.config["spare_slots"]))
    res = simulate(
        trace,
        cluster,
        spec,
        [policy],
        "sync",
        args.replan_every,
        run.config["predictor"],
        slots_per_device=slots,
        workers=1,
    )
    pr = res.runs[policy]
    skip = args.replan_every + 2
    w = slice(skip, None)
    measured_s = float(run.step_s[w].mean())
    predicted_s = float(pr.step_s[w].mean())
    # Phases: predicted per step (summed over layers), measured on rank 0.
    ph = {k: float(v[w].sum(axis=1).mean()) for k, v in pr.phases.items()}
    mp = {k: float(v[w].mean()) for k, v in run.phases.items()}
    mm = {k: float(v[w].mean()) for k, v in run.moe_phases.items()}
    pred_fwd = ph["non_moe_fwd_s"] + ph["expert_fwd_s"] + ph["dispatch_s"] + ph["combine_s"]
    pred_bwd = ph["non_moe_bwd_s"] + ph["expert_bwd_s"] + ph["dispatch_s"] + ph["combine_s"]
    pred_bwd += ph["agg_s"]
    moe_fwd = sum(mm.get(k, 0.0) for k in ("gate", "dispatch", "experts", "combine"))
    phases = {
        "forward": [mp.get("forward", 0.0), pred_fwd],
        "non_moe_forward": [mp.get("forward", 0.0) - moe_fwd, ph["non_moe_fwd_s"]],
        "moe_forward": [moe_fwd, ph["expert_fwd_s"] + ph["dispatch_s"] + ph["combine_s"]],
        "expert_forward": [mm.get("experts", 0.0), ph["expert_fwd_s"]],
        "all_to_all_forward": [
            mm.get("dispatch", 0.0) + mm.get("combine", 0.0),
            ph["dispatch_s"] + ph["combine_s"],
        ],
        "backward": [mp.get("backward", 0.0), pred_bwd],
        "transfers_and_planning": [
            mm.get("transfers", 0.0) + mm.get("plan", 0.0),
            ph["trans_s"] + ph["agg_s"] + ph["migrate_s"] + float(pr.plan_s[w].mean()),
        ],
    }
    not_modelled = {k: mp.get(k, 0.0) for k in ("grad_sync", "clip", "optimizer", "data")}
    return {
        "measured_s": measured_s,
        "predicted_s": predicted_s,
        "measured_median_s": float(np.median(run.step_s[w])),
        "phases": phases,
        "not_modelled": not_modelled,
        "plan_changes": run.plan_changes,
        "steps": len(run.step_s),
        "measured_steps": len(run.step_s[w]),
    }


def summarise(policy: str, parts: list[dict]) -> dict:
    """One JSON line from a policy's repeats: medians over the runs."""

    def med(values: Any) -> float:
        return float(np.median(list(values)))

    measured = med(p["measured_s"] for p in parts)
    predicted = med(p["predicted_s"] for p in parts)
    phases = {
        k: [round(med(p["phases"][k][i] for p in parts) * 1e3, 2) for i in (0, 1)]
        for k in parts[0]["phases"]
    }
    return {
        "bench": "sim_accuracy",
        "policy": policy,
        "measured_ms": round(measured * 1e3, 2),
        "predicted_ms": round(predicted * 1e3, 2),
        "abs_error": round(abs(predicted - measured) / measured, 4),
        "measured_ms_runs": [round(p["measured_s"] * 1e3, 1) for p in parts],
        "predicted_ms_runs": [round(p["predicted_s"] * 1e3, 1) for p in parts],
        "measured_median_ms": round(med(p["measured_median_s"] for p in parts) * 1e3, 2),
        "steps": parts[0]["steps"],
        "measured_steps": parts[0]["measured_steps"],
        "phases_ms": phases,
        "not_modelled_ms": {
            k: round(med(p["not_modelled"][k] for p in parts) * 1e3, 2)
            for k in parts[0]["not_modelled"]
        },
        "plan_changes": [p["plan_changes"] for p in parts],
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from poise.topology import get_cluster
    from poise.train.data import build_corpus

    build_corpus(None)
    with tempfile.TemporaryDirectory(prefix="poise-sim-accuracy-") as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        cluster_path = Path(args.cluster) if args.cluster else calibrate(root)
        cluster = get_cluster(str(cluster_path))
        parts: dict[str, list[dict]] = {p: [] for p in args.policies}
        for r in range(args.repeats):
            order = args.policies if r % 2 == 0 else args.policies[::-1]
            for policy in order:
                cfg = run_config(
                    policy,
                    root / f"run-{r}-{policy}",
                    args.steps,
                    args.replan_every,
                    {},
                    cluster=str(cluster_path),
                )
                run = train(cfg)
                mcfg = cfg.model_config()
                spec = tiny_spec(mcfg, cfg.batch // 2 * mcfg.context)
                parts[policy].append(compare(policy, run, cluster, spec, args))
                got = parts[policy][-1]
                print(
                    f"round {r} {policy}: measured {got['measured_s'] * 1e3:.1f} ms, "
                    f"predicted {got['predicted_s'] * 1e3:.1f} ms",
                    file=sys.stderr,
                )
        errors = []
        for policy in args.policies:
            line = summarise(policy, parts[policy])
            errors.append(line["abs_error"])
            print(json.dumps(line), flush=True)
        mean = float(np.mean(errors))
        last = {
            "bench": "sim_accuracy",
            "mean_abs_error": round(mean, 4),
            "target": 0.15,
            "target_met": mean <= 0.15,
            "cluster": cluster.name,
            "gemm_gflops": round(cluster.gemm_flops / 1e9, 2),
            "gemm_half_rows": cluster.gemm_half_rows,
            "a2a_GBps": round(cluster.intra_node.bw_Bps / 1e9, 3),
            "a2a_lat_us": round(cluster.intra_node.lat_s * 1e6, 1),
        }
        print(json.dumps(last), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
