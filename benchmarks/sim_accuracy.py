"""The simulator against measured training steps on this machine.

    .venv/bin/python benchmarks/sim_accuracy.py          # ~3 min on 2 cores (3 runs per policy)

1. `poise calibrate` measures this machine as a 2-device cluster (`HostCosts` included): the
   collectives between 2 gloo ranks, the tiny model's experts and non-MoE block at their rates,
   the dispatcher's host work per row, AdamW and clipping, the all-reduce after compute; before
   each round (`--calibrate-every round`), since a shared host's speed moves within minutes.
2. Real training on 2 gloo ranks, the `tiny` GPT-MoE without aux loss, `--steps` steps under
   `static` and `auto` (re-planning every `--replan-every`), recording the routing traces.
3. The simulator replays each run's trace under its own policy on the round's calibration, with
   the same slots, interval and predictor, the synchronous schedule, planning charged and the
   work outside the layers priced (`poise.cost.step_overheads`).

Per run the error is |predicted - measured| / measured of the mean step over the steps after
`replan_every + 2`; per policy, `abs_error` is the median over its `--repeats` runs (static and
auto alternating), `measured_ms` and `predicted_ms` the medians, `busy_before_run` the share of
the cores other work kept busy before each run, and `phases_ms` measured against predicted ms a
step for the phases both sides name (`not_modelled_ms`: measured phases the simulator does not
price). The last line has `mean_abs_error` over the policies (target: <= 0.15). `--ablation`
also replays every run with the simulator's terms added one at a time (`ablation_ms`).
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
    p.add_argument(
        "--calibrate-every",
        choices=("once", "round"),
        default="round",
        help="calibrate once, or before each round of runs (the machine's speed drifts)",
    )
    p.add_argument("--out", default=None, help="working folder (default: a temporary folder)")
    p.add_argument(
        "--ablation",
        action="store_true",
        help="also replay each run with the simulator's terms added one at a time",
    )
    return p.parse_args(argv)


CALIBRATE_TRIES = 3  # gloo ranks on a machine shared with other jobs' ranks can fail to start


def busy_fraction() -> float | None:
    """Share of this machine's cores busy over half a second (other jobs, before a run)."""
    from poise.calibrate.outputs import cpu_busy_fraction

    busy = cpu_busy_fraction(0.5)
    return None if busy is None else round(busy, 2)


def calibrate(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
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
        "--model",
        "tiny",
    ]
    for attempt in range(CALIBRATE_TRIES):
        done = subprocess.run(cmd, stdout=sys.stderr)
        if done.returncode == 0:
            return path
        print(
            f"calibration failed (attempt {attempt + 1}), status {done.returncode}", file=sys.stderr
        )
    raise SystemExit(f"poise calibrate failed {CALIBRATE_TRIES} times")


def tiny_spec(mcfg: Any, tokens_per_device: int) -> Any:
    """The `ModelSpec` of a GPT-MoE config (see the module docstring for the FLOPs)."""
    from poise.core.spec import ModelSpec
    from poise.cost.host import gpt_non_moe_flops_per_token

    non_moe = gpt_non_moe_flops_per_token(
        mcfg.d_model, mcfg.context, mcfg.num_experts, mcfg.vocab_size, mcfg.moe_layers
    )
    return ModelSpec(
        "tiny",
        d_model=mcfg.d_model,
        d_expert=mcfg.d_expert,
        experts=mcfg.num_experts,
        top_k=mcfg.top_k,
        moe_layers=mcfg.moe_layers,
        dtype_bytes=4,
        tokens_per_device=tokens_per_device,
        non_moe_flops_per_token=float(non_moe),
        optimizer_bytes_per_param=8.0,
        activation="swiglu",
    )


def dense_params(mcfg: Any) -> int:
    """The replicated (non-expert) parameters of a GPT-MoE config, counted on the model."""
    from poise.models.gpt import GPTMoE

    return int(GPTMoE(mcfg).num_parameters()["dense"])


def replay(
    policy: str, run: Any, cluster: Any, spec: Any, dense: int | None, args: argparse.Namespace
) -> Any:
    """The simulator's `PolicyRun` of one run's trace under its policy on `cluster`."""
    from poise.sim.simulator import simulate
    from poise.trace.trace import Trace

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
        dense_params=dense,
    )
    return res.runs[policy]


ABLATION = ("gemm_ffn_and_links", "+model_experts", "+non_moe_rate", "+dispatcher", "+outside")


def ablation_variants(cluster_path: Path, cluster: Any, dense: int) -> dict[str, tuple]:
    """The calibrated cluster with the simulator's terms added one at a time (`ABLATION`):
    the expert FFN's GEMM curve and the links only (the cost model before host costs), then
    the model's own experts' GEMM curve, the non-MoE rate, the dispatcher's host work, and
    the work outside the layers (the full prediction). Values: (cluster, dense_params)."""
    import dataclasses

    from poise.calibrate import measurements_path
    from poise.core.cluster import HostCosts, PeakFlops

    ffn = json.loads(measurements_path(cluster_path).read_text())["gemm_fits"]["forward+backward"]
    h = cluster.host
    dense_only = HostCosts(
        dense_fwd_flops=h.dense_fwd_flops,
        dense_fwd_half_tokens=h.dense_fwd_half_tokens,
        dense_bwd_flops=h.dense_bwd_flops,
        dense_bwd_half_tokens=h.dense_bwd_half_tokens,
    )
    with_dispatch = dataclasses.replace(
        dense_only,
        dispatch_fwd_s=h.dispatch_fwd_s,
        dispatch_fwd_s_per_row=h.dispatch_fwd_s_per_row,
        dispatch_bwd_s=h.dispatch_bwd_s,
        dispatch_bwd_s_per_row=h.dispatch_bwd_s_per_row,
    )
    bare = dataclasses.replace(cluster, host=HostCosts())
    return {
        ABLATION[0]: (
            dataclasses.replace(
                bare,
                peak_flops=PeakFlops.uniform(ffn["gemm_flops"]),
                gemm_efficiency=1.0,
                gemm_half_rows=ffn["half_rows"],
            ),
            None,
        ),
        ABLATION[1]: (bare, None),
        ABLATION[2]: (dataclasses.replace(cluster, host=dense_only), None),
        ABLATION[3]: (dataclasses.replace(cluster, host=with_dispatch), None),
        ABLATION[4]: (cluster, dense),
    }


def compare(
    policy: str,
    run: Any,
    cluster: Any,
    spec: Any,
    dense: int,
    args: argparse.Namespace,
    variants: dict[str, tuple] | None = None,
) -> dict:
    """Replay one run's trace under its policy; measured and predicted seconds of that run
    (and under each of `variants`, the predicted mean step)."""
    pr = replay(policy, run, cluster, spec, dense, args)
    skip = args.replan_every + 2
    w = slice(skip, None)
    measured_s = float(run.step_s[w].mean())
    predicted_s = float(pr.step_s[w].mean())
    ablation = {
        name: float(replay(policy, run, c, spec, d, args).step_s[w].mean())
        for name, (c, d) in (variants or {}).items()
    }
    # Phases: predicted per step (summed over layers), measured on rank 0.
    ph = {k: float(v[w].sum(axis=1).mean()) for k, v in pr.phases.items()}
    ph.update({k: float(v[w].sum(axis=1).mean()) for k, v in pr.host_phases.items()})
    out = {k: float(v[w].mean()) for k, v in pr.outside_s.items()}
    mp = {k: float(v[w].mean()) for k, v in run.phases.items()}
    mm = {k: float(v[w].mean()) for k, v in run.moe_phases.items()}
    links = ph["dispatch_s"] + ph["combine_s"]
    pred_moe_fwd = ph["expert_fwd_s"] + links + ph["dispatch_host_fwd_s"]
    pred_bwd = ph["non_moe_bwd_s"] + ph["expert_bwd_s"] + links + ph["dispatch_host_bwd_s"]
    pred_bwd += ph["agg_s"]
    moe_fwd = sum(mm.get(k, 0.0) for k in ("dispatch", "experts", "combine"))
    phases = {
        "forward": [mp.get("forward", 0.0), ph["non_moe_fwd_s"] + pred_moe_fwd],
        "non_moe_forward": [mp.get("forward", 0.0) - moe_fwd, ph["non_moe_fwd_s"]],
        "moe_forward": [moe_fwd, pred_moe_fwd],
        "expert_forward": [mm.get("experts", 0.0), ph["expert_fwd_s"]],
        "dispatch_combine_forward": [
            mm.get("dispatch", 0.0) + mm.get("combine", 0.0),
            links + ph["dispatch_host_fwd_s"],
        ],
        "backward": [mp.get("backward", 0.0), pred_bwd],
        "grad_sync": [mp.get("grad_sync", 0.0), out["grad_allreduce_s"]],
        "balance": [mp.get("balance", 0.0), out["counts_s"]],
        "clip": [mp.get("clip", 0.0), out["clip_s"]],
        "optimizer": [mp.get("optimizer", 0.0), out["optimizer_s"]],
        "transfers_and_planning": [
            mm.get("transfers", 0.0) + mm.get("plan", 0.0),
            ph["trans_s"] + ph["agg_s"] + ph["migrate_s"] + float(pr.plan_s[w].mean()),
        ],
    }
    not_modelled = {k: mp.get(k, 0.0) for k in ("data",)}
    return {
        "measured_s": measured_s,
        "predicted_s": predicted_s,
        "measured_median_s": float(np.median(run.step_s[w])),
        "phases": phases,
        "not_modelled": not_modelled,
        "ablation": ablation,
        "plan_changes": run.plan_changes,
        "steps": len(run.step_s),
        "measured_steps": len(run.step_s[w]),
    }


def summarise(policy: str, parts: list[dict]) -> dict:
    """One JSON line from a policy's repeats: medians over the runs; `abs_error` the median of
    the runs' own errors (each run predicted from its round's calibration)."""

    def med(values: Any) -> float:
        return float(np.median(list(values)))

    def err(p: dict, predicted_s: float) -> float:
        return abs(predicted_s - p["measured_s"]) / p["measured_s"]

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
        "abs_error": round(med(err(p, p["predicted_s"]) for p in parts), 4),
        "abs_error_runs": [round(err(p, p["predicted_s"]), 4) for p in parts],
        "abs_error_of_medians": round(abs(predicted - measured) / measured, 4),
        "measured_ms_runs": [round(p["measured_s"] * 1e3, 1) for p in parts],
        "predicted_ms_runs": [round(p["predicted_s"] * 1e3, 1) for p in parts],
        "busy_before_run": [p["busy_before"] for p in parts],
        "measured_median_ms": round(med(p["measured_median_s"] for p in parts) * 1e3, 2),
        "steps": parts[0]["steps"],
        "measured_steps": parts[0]["measured_steps"],
        "phases_ms": phases,
        "not_modelled_ms": {
            k: round(med(p["not_modelled"][k] for p in parts) * 1e3, 2)
            for k in parts[0]["not_modelled"]
        },
        "plan_changes": [p["plan_changes"] for p in parts],
        **(
            {
                "ablation_ms": {
                    k: round(med(p["ablation"][k] for p in parts) * 1e3, 2)
                    for k in parts[0]["ablation"]
                },
                "ablation_abs_error": {
                    k: round(med(err(p, p["ablation"][k]) for p in parts), 4)
                    for k in parts[0]["ablation"]
                },
            }
            if parts[0]["ablation"]
            else {}
        ),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }


def cluster_summary(cluster: Any, busy: float | None = None) -> dict[str, Any]:
    """The calibrated figures of one cluster file (rounded for the JSON line) and how busy
    the machine was just before its calibration."""

    def g(v: float) -> float:
        return float(f"{v:.4g}")

    return {
        "gemm_gflops": round(cluster.gemm_flops("fp32") / 1e9, 2),  # calibrated in fp32
        "gemm_half_rows": round(cluster.gemm_half_rows, 2),
        "a2a_GBps": round(cluster.intra_node.bw_Bps / 1e9, 3),
        "a2a_lat_us": round(cluster.intra_node.lat_s * 1e6, 1),
        "host": {k: g(v) for k, v in cluster.host.to_dict().items()},
        "busy_before": busy,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from poise.core.presets import get_cluster
    from poise.train.data import build_corpus

    build_corpus(None)
    with tempfile.TemporaryDirectory(prefix="poise-sim-accuracy-") as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        busy_cal = busy_fraction()
        cluster_path = Path(args.cluster) if args.cluster else calibrate(root)
        clusters: list[tuple[Any, float | None]] = []
        parts: dict[str, list[dict]] = {p: [] for p in args.policies}
        for r in range(args.repeats):
            if r and args.cluster is None and args.calibrate_every == "round":
                busy_cal = busy_fraction()
                cluster_path = calibrate(root / f"round-{r}")
            cluster = get_cluster(str(cluster_path))
            if not clusters or cluster != clusters[-1][0]:
                clusters.append((cluster, busy_cal))
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
                busy = busy_fraction()
                run = train(cfg, 2)
                mcfg = cfg.model_config()
                spec = tiny_spec(mcfg, cfg.batch // 2 * mcfg.context)
                dense = dense_params(mcfg)
                variants = None
                if args.ablation and args.cluster is None:
                    variants = ablation_variants(cluster_path, cluster, dense)
                parts[policy].append(compare(policy, run, cluster, spec, dense, args, variants))
                parts[policy][-1]["busy_before"] = busy
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
            "calibrate_every": "given" if args.cluster else args.calibrate_every,
            "clusters": [cluster_summary(c, busy) for c, busy in clusters],
        }
        print(json.dumps(last), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
