"""Every CUDA check of the project in one run, one JSON line per result.

    python3 benchmarks/gpu_suite.py                  # one GPU: every check, under 8 minutes
    python3 benchmarks/gpu_suite.py --device cpu     # smoke: the same checks at tiny sizes

Checks, each a subprocess of the project's own benchmark or command, with a time limit:

- `layer-2048` and `layer-4096` (`benchmarks/moe_layer.py`): `poise.nn.MoE` forward + backward
  in bf16 against a dense FFN of the same active FLOPs and, where torchtitan imports, its MoE
  layer, eager and under `torch.compile` (inductor), on 16,384 tokens: d_model 2,048 with 64
  experts of 1,408 (top-6, DeepSeek-MoE-16B's widths) and d_model 4,096 with 64 experts of
  2,560 (top-8, Qwen2-57B-A14B's expert width), uniform and Zipf routing.
- `host-waits` (`benchmarks/cuda_syncs.py`): the host synchronisations of one layer.
- `train` (`poise train tiny`): a 1-GPU training run of 30 steps; its step time and losses.
- `calibrate` (`poise calibrate --device cuda`): this GPU's expert rate, small-GEMM curve and
  per-call floor written into a cluster file (a copy of `dgx-h100` with them in place).

Every line carries `"device"` and `"gpu"` (the GPU's name). Without CUDA, `--device cuda`
prints one line saying so and exits 0. `--device cpu` runs the same checks at tiny sizes
(fp32, `torch.compile` with the eager backend, the CPU calibration) so the suite's plumbing is
tested on every machine (`tests/test_gpu_suite.py`); `host-waits` needs CUDA and says so.
A check that fails or runs past its limit is one line with `"ok": false` and the reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@dataclass
class Check:
    """One check: the command, its time limit (s) and how its output becomes lines."""

    name: str
    argv: list[str]
    limit_s: float
    read: str = "json-lines"  # json-lines: the lines it prints; a file name: that JSON file
    fields: tuple[str, ...] = ()  # keys of the JSON file kept on the line
    extra: dict[str, Any] = field(default_factory=dict)


def layer_argv(device: str, size: dict[str, int], tiny: bool) -> list[str]:
    """`moe_layer.py`'s arguments for one size (tiny: the smoke form)."""
    if tiny:
        dims = ["--tokens", "256", "--d-model", "32", "--d-expert", "64", "--experts", "4"]
        return [
            *dims,
            "--top-k", "2", "--reps", "1", "--warmup", "1", "--routing", "zipf",
            "--device", "cpu", "--dtype", "fp32", "--compile", "eager",
            "--no-deepspeed", "--no-torchtitan",
        ]  # fmt: skip
    return [
        "--tokens", "16384", "--d-model", str(size["d_model"]),
        "--d-expert", str(size["d_expert"]), "--experts", str(size["experts"]),
        "--top-k", str(size["top_k"]), "--reps", "5", "--warmup", "2",
        "--device", device, "--dtype", "bf16", "--compile", "inductor", "--no-deepspeed",
    ]  # fmt: skip


SIZES = {
    "layer-2048": {"d_model": 2048, "d_expert": 1408, "experts": 64, "top_k": 6},
    "layer-4096": {"d_model": 4096, "d_expert": 2560, "experts": 64, "top_k": 8},
}


def checks(device: str, work: Path) -> list[Check]:
    """The suite on `device` (cuda: full sizes; cpu: the smoke forms), outputs under `work`."""
    py = sys.executable
    poise = [py, "-m", "poise"]
    tiny = device == "cpu"
    out: list[Check] = []
    for name, size in SIZES.items():
        if tiny and name != "layer-2048":
            continue
        argv = [py, str(BENCH / "moe_layer.py"), *layer_argv(device, size, tiny)]
        out.append(Check(name, argv, 300.0 if tiny else 150.0, extra={} if tiny else size))
    syncs = [py, str(BENCH / "cuda_syncs.py")]
    out.append(Check("host-waits", syncs, 60.0))
    steps = "2" if tiny else "30"
    train_out = work / "train"
    train = [*poise, "train", "tiny", "--steps", steps, "--out", str(train_out), "--quiet"]
    out.append(
        Check(
            "train",
            [*train, "--set", f"device={device}"],
            300.0 if tiny else 120.0,
            read=str(train_out / "summary.json"),
            fields=("steps", "losses", "step_seconds", "tokens_per_s", "device", "world_size"),
        )
    )
    yaml = work / "calibrated.yaml"
    calibrate = [*poise, "calibrate", "--out", str(yaml)]
    calibrate += ["--quick", "--no-host"] if tiny else ["--device", "cuda"]
    keep = ("config", "gemm_fits", "link_fits") if tiny else (
        "gpu", "model", "dtype", "slots", "rows", "seconds", "floor_s", "fit_rows",
        "gemm_flops", "half_rows", "base",
    )  # fmt: skip
    out.append(
        Check(
            "calibrate",
            calibrate,
            120.0,
            read=str(yaml.with_name("calibrated.measurements.json")),
            fields=keep,
        )
    )
    return out


def run_check(check: Check, stamp: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one check; its result lines, each with `stamp` (device, gpu) and the check's name."""
    base = {"bench": "gpu_suite", "check": check.name, **stamp, **check.extra}
    if check.name == "host-waits" and stamp["device"] != "cuda":
        return [{**base, "ok": True, "skipped": "needs a CUDA device (host waits are CUDA's)"}]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            check.argv, capture_output=True, text=True, timeout=check.limit_s, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return [{**base, "ok": False, "error": f"ran past its {check.limit_s:.0f} s limit"}]
    wall = round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return [{**base, "ok": False, "wall_s": wall, "rc": done.returncode, "error": tail[0]}]
    if check.read == "json-lines":
        lines = [json.loads(t) for t in done.stdout.splitlines() if t.startswith("{")]
        return [{**base, "ok": True, "wall_s": wall, **line} for line in lines]
    data = json.loads(Path(check.read).read_text())
    kept = {k: data[k] for k in check.fields if k in data}
    return [{**base, "ok": True, "wall_s": wall, **kept}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--only", nargs="+", default=None, metavar="CHECK", help="run only these")
    p.add_argument("--work", default=None, help="folder for the checks' outputs (default: temp)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        line = {"bench": "gpu_suite", "device": "cuda", "skipped": "no CUDA device here"}
        print(json.dumps(line), flush=True)
        return 0
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    stamp = {"device": args.device, "gpu": gpu, "torch": torch.__version__}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="poise-gpu-suite-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        failed = 0
        for check in checks(args.device, work):
            if args.only and check.name not in args.only:
                continue
            for line in run_check(check, stamp):
                failed += not line["ok"]
                print(json.dumps(line), flush=True)
    total = round(time.perf_counter() - started, 1)
    print(json.dumps({"bench": "gpu_suite", **stamp, "total_s": total, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
