"""`python -m poise.train CONFIG [options]`: the entry point of every training rank.

    torchrun --nproc-per-node 2 -m poise.train configs/tiny.yaml --policy auto
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m poise.train configs/small.yaml

`poise train CONFIG --nproc N` starts N local ranks running this same module. CONFIG is a YAML
file (see `poise.train.config`) or the name of a model preset (`tiny`, `small`, `medium`) with
default settings. `--layout ep=2` trains in a SmartMoE layout (`poise.train.layout`). Bad input,
a bad flag or a number out of range included (`poise.util.argparsing`, as `poise` parses), is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from poise.core.errors import ConfigError, PoiseError
from poise.util.argparsing import PoiseParser, int_in
from poise.util.heap import retain_freed_memory

# command-line option -> config field
OVERRIDES = {
    "policy": "policy",
    "replan_every": "replan_every",
    "steps": "steps",
    "out": "out",
    "data": "data",
    "seed": "seed",
    "layout": "layout",
}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The options `poise train` and `python -m poise.train` share."""
    p.add_argument("config", metavar="CONFIG", help="a YAML config file or a model preset name")
    p.add_argument(
        "--policy",
        default=None,
        help="static, shadow, prophet, vexpert, permute, eplb, hybrid or auto (default: the "
        "config's)",
    )
    p.add_argument(
        "--replan-every",
        type=int_in(1),
        default=None,
        metavar="K",
        help="re-plan every K steps (default: the config's)",
    )
    p.add_argument(
        "--steps", type=int_in(1), default=None, help="training steps (default: the config's)"
    )
    p.add_argument("--out", default=None, help="output folder (default: the config's)")
    p.add_argument("--data", default=None, help="a text file or folder (default: Python stdlib)")
    p.add_argument(
        "--seed", type=int_in(0), default=None, help="random seed (default: the config's)"
    )
    p.add_argument(
        "--layout",
        default=None,
        metavar="LAYOUT",
        help="SmartMoE layout, e.g. ep=2 or pp1-ep2-edp2: EP groups of ep ranks, each holding "
        "every expert, expert gradients summed over the D / ep replicas (`poise layouts` ranks "
        "them; default: expert parallelism over all ranks)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="PATH",
        help="a checkpoint file, or a run / checkpoints folder (its latest)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config field, e.g. --set aux_loss=0 (repeatable)",
    )
    p.add_argument("--quiet", action="store_true", help="no console output")


def config_from_args(args: argparse.Namespace) -> Any:
    """The `TrainConfig` of CONFIG with the command-line overrides applied and checked (each bad
    override is named by its option)."""
    from poise.models.gpt import MODEL_PRESETS
    from poise.train.config import (
        TrainConfig,
        check_value,
        config_from_mapping,
        load_config,
        parse_override,
    )

    path = Path(args.config)
    if path.is_file() or path.suffix in (".yaml", ".yml", ".json"):
        cfg = load_config(path)
    elif args.config in MODEL_PRESETS:
        cfg = TrainConfig(model=args.config)
    else:
        raise ConfigError(
            f"no such config file, nor a model preset ({', '.join(MODEL_PRESETS)})",
            source=args.config,
            field="CONFIG",
        )
    merged = cfg.to_dict()
    for opt, name in OVERRIDES.items():
        value = getattr(args, opt)
        if value is not None:
            merged[name] = check_value(name, value, source=f"--{opt.replace('_', '-')}")
    for item in args.set:
        key, value = parse_override(item)
        merged[key] = check_value(key, value, source=f"--set {key}")
    return config_from_mapping(merged, source=str(args.config))


def rank_label() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"rank {os.environ.get('RANK', '0')}: " if world > 1 else ""


def main(argv: list[str] | None = None) -> int:
    parser = PoiseParser(
        prog="python -m poise.train",
        description="One rank of Poise training (run it under torchrun, or use `poise train`).",
    )
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    retain_freed_memory()  # the rank plans too (`poise.util.heap`)
    try:
        from poise.train.loop import train
        from poise.train.preflight import check_before_start

        cfg = config_from_args(args)
        check_before_start(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        train(cfg, resume=args.resume, quiet=args.quiet)
    except PoiseError as exc:
        print(f"poise: error: {rank_label()}{exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"poise: {rank_label()}interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, dist_errors()) as exc:
        if not peer_failure(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"poise: error: {rank_label()}a collective failed (another rank died or timed out): "
            f"{first[:300]}",
            file=sys.stderr,
        )
        return 1
    return 0


def dist_errors() -> type[BaseException]:
    """torch.distributed's own error base class (`DistError`), or RuntimeError if absent."""
    import torch.distributed as dist

    return getattr(dist, "DistError", RuntimeError)


PEER_FAILURE_WORDS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Timed out",
    "timeout",
)


def peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that broke because another rank died or stalled (gloo's
    connection errors and timeouts, NCCL's watchdog) rather than a bug on this rank."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return any(w in str(exc) for w in PEER_FAILURE_WORDS)


if __name__ == "__main__":
    sys.exit(main())
