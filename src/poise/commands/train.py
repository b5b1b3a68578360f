"""`poise train CONFIG [--nproc N]`: train a GPT-MoE with live expert-parallel balancing.

With `--nproc 1` (the default) the run happens in this process. With N > 1 it checks the config
and builds the corpus cache here (so bad input fails once, as one line), then starts N local
ranks, each running `python -m poise.train <out>/config.yaml`'s `main` with torchrun's
environment variables and a free port: the same entry point `torchrun -m poise.train` runs, so
multi-node runs use torchrun's rendezvous instead. The local ranks are forked from a fork
server that imported torch and `torch._dynamo` once (`poise.runtime.launch.start_forked`,
`warm_fork_server`): a fresh interpreter spends about 7 s of CPU importing them (3 s torch,
3 s `torch._dynamo`, which `torch.optim.AdamW` imports), so ranks that outnumber the cores
(`poise demo`'s 4 on 2) waited for each other's imports. If a rank fails, the others are
stopped and its exit status is returned; with `--max-restarts N` all ranks start again from
the last complete checkpoint, up to N times
(see `launch`). `--fail-at-step S --fail-rank R [--fail-phase P]` kills a rank on purpose
(`poise.train.faults`), to test exactly that. `--layout ep=K` trains in a SmartMoE layout; the
world must be a multiple of K and K divide the experts (checked here, one line).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from poise.train.config import TrainConfig
    from poise.train.faults import Fault

T = TypeVar("T")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from poise.train.__main__ import add_train_arguments
    from poise.util.argparsing import int_in

    p = sub.add_parser(
        "train",
        help="train a GPT-MoE with expert parallelism, balanced live",
        description="Train a GPT-MoE on real text with expert parallelism over N local ranks "
        "(gloo on the CPU, NCCL on GPUs), balanced live by a Poise policy.",
    )
    add_train_arguments(p)
    p.add_argument(
        "--nproc", type=int_in(1, 4096), default=1, metavar="N", help="local ranks (default 1)"
    )
    p.add_argument(
        "--max-restarts",
        type=int_in(0, 1000),
        default=0,
        metavar="N",
        help="when a rank dies, restart all ranks from the last complete checkpoint, up to N "
        "times (like torchrun's elastic agent; default 0)",
    )
    fault = p.add_argument_group("fault injection (tests; also POISE_FAIL_* variables)")
    fault.add_argument(
        "--fail-at-step", type=int_in(1), default=None, metavar="S", help="1-based step"
    )
    fault.add_argument(
        "--fail-rank", type=int_in(0), default=0, metavar="R", help="rank to kill (default 0)"
    )
    fault.add_argument(
        "--fail-phase",
        default="step",
        help="step, forward, backward, agg, trans, migrate or checkpoint (default step)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poise.core.errors import ConfigError
    from poise.core.outputs import check_output_dir, output_lock
    from poise.train.__main__ import config_from_args
    from poise.train.config import resolve_layout
    from poise.train.data import shard_rows
    from poise.train.faults import Fault
    from poise.train.preflight import check_before_start

    cfg = config_from_args(args)
    check_output_dir(cfg.out, "--out")
    n = args.nproc
    if n < 1:
        raise ConfigError(f"must be >= 1, got {n}", source="--nproc", field="nproc")
    if args.max_restarts < 0:
        raise ConfigError(
            f"must be >= 0, got {args.max_restarts}", source="--max-restarts", field="max_restarts"
        )
    fault = None
    if args.fail_at_step is not None:
        fault = Fault(args.fail_at_step, args.fail_rank, args.fail_phase)
        if fault.rank >= n:
            raise ConfigError(f"rank {fault.rank} of {n}", source="--fail-rank", field="rank")
    resolve_layout(cfg, n, source=f"--nproc {n}")  # the world fits the experts / the layout
    shard_rows(cfg.batch, 0, n)
    check_before_start(cfg, n)  # memory, the corpus cache: before any rank starts
    if args.resume:
        from poise.train.checkpoint import resolve

        args.resume = str(resolve(args.resume))
    with output_lock(cfg.out, "--out"):  # a second run into this folder is refused
        return _start(args, cfg, n, fault)


def _start(args: argparse.Namespace, cfg: TrainConfig, n: int, fault: Fault | None) -> int:
    """Run the checked training (in this process, or on `n` launched ranks), its output folder
    locked."""
    from poise.train.config import save_config
    from poise.train.data import build_corpus

    if not args.quiet:  # the corpus and model take seconds to build: say what is starting
        print(
            f"poise train: model {cfg.model}, policy {cfg.policy}, {cfg.steps} steps on {n} "
            f"rank(s), output {cfg.out}; preparing the corpus and the model...",
            file=sys.stderr,
            flush=True,
        )
    supervised = args.max_restarts > 0 or fault is not None
    if n == 1 and not supervised and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from poise.train.loop import train

        train(cfg, resume=args.resume, quiet=args.quiet)
        return 0
    from poise.runtime.launch import warm_fork_server

    warm_fork_server()  # its imports overlap the corpus's preparation
    build_corpus(
        cfg.data, glob=cfg.data_glob, cache_dir=cfg.cache_dir, val_fraction=cfg.val_fraction
    )
    config_path = Path(cfg.out) / "config.yaml"
    save_config(cfg, config_path)
    return launch(
        n,
        config_path,
        resume=args.resume,
        quiet=args.quiet,
        threads=cfg.threads,
        max_restarts=args.max_restarts,
        checkpoints=Path(cfg.out) / "checkpoints",
        extra_env=fault.env() if fault else None,
    )


def launch(
    nproc: int,
    config_path: str | Path,
    *,
    resume: str | None = None,
    quiet: bool = False,
    threads: int = 0,
    max_restarts: int = 0,
    checkpoints: str | Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> int:
    """Start `nproc` local ranks of `python -m poise.train CONFIG` and wait for them all.

    When a rank fails, the others are stopped; then, as torchrun's elastic agent does, all ranks
    start again (up to `max_restarts` times) from the newest complete checkpoint in
    `checkpoints` (or from `resume`, or from the start, if there is none yet), with
    `POISE_RESTART_COUNT` set to the attempt. Bad input (exit status 2) is not retried: it would
    fail the same way. Returns 0, or the last failing rank's exit status."""
    from poise.train.faults import ENV_RESTART

    attempt = 0
    while True:
        env = {**(extra_env or {}), ENV_RESTART: str(attempt)}
        code = _launch_once(nproc, config_path, resume, quiet, threads, env)
        if code in (0, 2) or attempt >= max_restarts:
            return code
        attempt += 1
        latest = _latest_checkpoint(checkpoints)
        resume = latest or resume
        where = f"checkpoint {latest}" if latest else (resume or "the start")
        print(
            f"poise: a rank failed (exit status {code}); restart {attempt}/{max_restarts} "
            f"from {where}",
            file=sys.stderr,
            flush=True,
        )


def in_turns(
    cfgs: Sequence[TrainConfig],
    turns: Path,
    run: Callable[[TrainConfig], T],
    companions: Sequence[Callable[[int, int], T]] = (),
) -> list[T]:
    """`run(cfg)` for every one of `cfgs` at once, each in its own thread, with `cfg` given
    its slot in the counter file `turns` (`TrainConfig.turns`, `turns_slot`, `turns_of`), so
    that the runs `run` starts (`launch`, typically) take their steps in turns
    (`poise.train.turns`). Each of `companions` is called as `companion(slot, slots)` in a
    thread of its own with the slots after the runs' (it takes its turns in the same file:
    `expert_clock.expert_seconds_in_turns`). The file is made fresh before and removed after.
    Returns the results in the order of `cfgs`, then the companions'; where one raised (a failed
    launch's `SystemExit` included), the file is marked abandoned so that the others stop
    waiting for it (even one that failed before it opened the file), and the first exception is
    raised again once all have ended."""
    turns.parent.mkdir(parents=True, exist_ok=True)
    turns.unlink(missing_ok=True)
    slots = len(cfgs) + len(companions)
    slotted = [
        cfg.replace(turns=str(turns), turns_slot=i, turns_of=slots) for i, cfg in enumerate(cfgs)
    ]
    jobs: list[Callable[[], T]] = [partial(run, cfg) for cfg in slotted]
    jobs += [partial(c, len(cfgs) + j, slots) for j, c in enumerate(companions)]
    results: list[T | None] = [None] * len(jobs)
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # raised again once every run has ended
            failures.append(exc)
            _abandon_turns(turns, i, slots)  # the others stop waiting for this one

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    turns.unlink(missing_ok=True)
    if failures:
        raise failures[0]
    return results  # type: ignore[return-value]


def _latest_checkpoint(checkpoints: str | Path | None) -> str | None:
    """The newest complete checkpoint in the folder, or None."""
    from poise.train.checkpoint import CheckpointError, resolve

    if checkpoints is None or not Path(checkpoints).is_dir():
        return None
    try:
        return str(resolve(checkpoints))
    except CheckpointError:
        return None


def _launch_once(
    nproc: int,
    config_path: str | Path,
    resume: str | None,
    quiet: bool,
    threads: int,
    extra_env: dict[str, str],
) -> int:
    """One attempt: start the ranks, wait for all; 0, or the first failing rank's exit status
    (the others are then stopped)."""
    from poise.runtime.launch import free_port, start_forked

    port = free_port()
    per_rank = threads or max(1, (os.cpu_count() or 1) // nproc)
    argv = [str(config_path)]
    if resume:
        argv += ["--resume", str(resume)]
    if quiet:
        argv.append("--quiet")
    procs: list[BaseProcess] = []
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
                **extra_env,
            )
            name = f"poise-rank{rank}"
            procs.append(start_forked(_rank_main, argv, per_rank, name=name, environ=env))
        while True:
            codes = [p.exitcode for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return _first_failure(failed)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        raise


def _rank_main(argv: list[str], threads: int) -> int:
    """One local rank (in a forked process): `python -m poise.train ARGV` at `threads` intra-op
    threads (`OMP_NUM_THREADS` is read when torch loads, which the fork server did before)."""
    import torch

    from poise.train.__main__ import main

    torch.set_num_threads(threads)
    return main(argv)


def _first_failure(codes: list[int]) -> int:
    """The status to report for the ranks that failed together: a death by signal first (the
    cause; its peers fail after it), then any status but 2, and 2 (bad input) only if every
    failing rank said so."""
    killed = sorted((c for c in codes if c < 0), key=lambda c: c != -9)  # SIGKILL: the cause
    if killed:
        return _exit_status(killed[0])
    other = [c for c in codes if c != 2]
    return other[0] if other else 2


def _abandon_turns(turns: Path, slot: int, slots: int) -> None:
    """Mark the counter file `turns` abandoned by `slot` (`StepTurns.abandon`)."""
    from poise.train.turns import StepTurns, TurnsError

    try:
        turn = StepTurns.open(turns, slot, slots, rank=0)
    except TurnsError:  # the file cannot be opened: nobody can be waiting on it
        return
    try:
        turn.abandon()
    finally:
        turn.close()


def _exit_status(code: int) -> int:
    """A process's exit status as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def _stop(procs: list[BaseProcess]) -> None:
    """Terminate the ranks this launch started that still run (then kill after 10 s)."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
