"""`poise train CONFIG [--nproc N]`: train a GPT-MoE with live expert-parallel balancing.

With `--nproc 1` (the default) the run happens in this process. With N > 1 it checks the config
and builds the corpus cache here (so bad input fails once, as one line), then starts N local
ranks, each `python -m poise.train <out>/config.yaml` with torchrun's environment variables and a
free port: the same entry point `torchrun -m poise.train` runs, so multi-node runs use torchrun's
rendezvous instead. If a rank fails, the others are stopped and its exit status is returned.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from poise.train.__main__ import add_train_arguments

    p = sub.add_parser(
        "train",
        help="train a GPT-MoE with expert parallelism, balanced live",
        description="Train a GPT-MoE on real text with expert parallelism over N local ranks "
        "(gloo on the CPU, NCCL on GPUs), balanced live by a Poise policy.",
    )
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=1, metavar="N", help="local ranks (default 1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poise.errors import ConfigError
    from poise.nn.moe import check_world
    from poise.train.__main__ import config_from_args
    from poise.train.config import save_config
    from poise.train.data import build_corpus, shard_rows

    cfg = config_from_args(args)
    n = args.nproc
    if n < 1:
        raise ConfigError(f"must be >= 1, got {n}", source="--nproc", field="nproc")
    check_world(cfg.model_config().num_experts, n)
    shard_rows(cfg.batch, 0, n)
    if args.resume:
        from poise.train.checkpoint import resolve

        args.resume = str(resolve(args.resume))
    if n == 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from poise.train.loop import train

        train(cfg, resume=args.resume, quiet=args.quiet)
        return 0
    build_corpus(
        cfg.data, glob=cfg.data_glob, cache_dir=cfg.cache_dir, val_fraction=cfg.val_fraction
    )
    config_path = Path(cfg.out) / "config.yaml"
    save_config(cfg, config_path)
    return launch(n, config_path, resume=args.resume, quiet=args.quiet, threads=cfg.threads)


def launch(
    nproc: int,
    config_path: str | Path,
    *,
    resume: str | None = None,
    quiet: bool = False,
    threads: int = 0,
    extra_env: dict[str, str] | None = None,
) -> int:
    """Start `nproc` local ranks of `python -m poise.train CONFIG` and wait for them all.
    Returns 0, or the first failing rank's exit status (the others are then stopped)."""
    from poise.runtime.launch import free_port

    port = free_port()
    per_rank = threads or max(1, (os.cpu_count() or 1) // nproc)
    cmd = [sys.executable, "-m", "poise.train", str(config_path)]
    if resume:
        cmd += ["--resume", str(resume)]
    if quiet:
        cmd.append("--quiet")
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(per_rank),
                **(extra_env or {}),
            )
            procs.append(subprocess.Popen(cmd, env=env))
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return 2 if 2 in failed else int(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        raise


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the ranks this launch started that still run (then kill after 10 s)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
