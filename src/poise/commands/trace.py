"""`poise trace`: inspect, convert and generate routing traces.

poise trace stats FILE [--json] [--layout-devices D]
poise trace convert SRC DST.npz [--format smartmoe|eplb|expert-counts|megatron|auto] [options]
poise trace generate KIND OUT.npz --steps S --layers L --devices D --experts E
                     [--top-k K] [--tokens-per-device T] [--seed N] [--param key=value ...]
                     [--model MODEL] [--cluster CLUSTER]  (recorded in the trace's metadata)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from poise.commands.options import MAX_DEVICES, check_cluster_size
from poise.core.budget import check_fits, human_bytes
from poise.core.errors import ConfigError
from poise.core.finite import json_text
from poise.core.outputs import check_output_file
from poise.core.presets import get_cluster
from poise.trace.generate import (
    DEFAULT_TOKENS_PER_DEVICE,
    DEFAULT_TOP_K,
    GENERATORS,
    generate,
)
from poise.trace.importers import FORMATS, load_any
from poise.trace.loads import require_tokens
from poise.trace.stats import stats_table, trace_stats
from poise.trace.trace import Trace
from poise.util.argparsing import int_in

DEFAULT_DEVICES = 8  # `trace generate`'s source devices without --devices or --cluster


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "trace",
        help="inspect, convert and generate routing traces",
        description="Routing traces: counts[step, layer, src_device, expert] stored as .npz.",
    )
    sub = parser.add_subparsers(dest="trace_command", required=True, metavar="ACTION")

    stats = sub.add_parser(
        "stats",
        help="skew, drift and static-placement imbalance of a trace",
        description="Print a trace's skew per layer (max/mean, Gini, top share), its drift "
        "between rows recorded 1, 10 and 100 iterations apart, and the imbalance of the static "
        "contiguous placement. An all-zero trace is refused.",
    )
    stats.add_argument("file", help="a .npz trace, or any source `convert` reads")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.add_argument(
        "--layout-devices",
        type=int_in(1, MAX_DEVICES),  # the devices any cluster may have (`check_cluster_size`)
        default=None,
        metavar="D",
        help="devices of the static contiguous placement (default: trace devices)",
    )
    _add_import_options(stats)

    convert = sub.add_parser(
        "convert",
        help="import SmartMoE-AE / EPLB / expert-count / Megatron-Core router-trace data",
        description="Convert a SmartMoE-AE folder, an EPLB weight matrix, expert-count JSON or "
        "Megatron-Core router traces into a Poise trace (.npz). The output path is checked "
        "before reading.",
    )
    convert.add_argument(
        "src",
        help="SmartMoE-AE folder, EPLB weight .npy/.json, expert-count .json, Megatron-Core "
        "router-trace folder (router_trace_rank<N>.jsonl), or a .npz trace",
    )
    convert.add_argument("dst", help="output trace (.npz)")
    _add_import_options(convert)

    gen = sub.add_parser(
        "generate",
        help="write a synthetic trace",
        description="Write a seeded synthetic routing trace [steps, layers, devices, experts] as "
        ".npz. Memory is estimated first: a trace that cannot fit is refused.",
    )
    gen.add_argument("kind", help=f"generator: one of {', '.join(GENERATORS)}")
    gen.add_argument("out", help="output trace (.npz)")
    gen.add_argument("--steps", type=int_in(1), default=100, help="training steps (rows)")
    gen.add_argument("--layers", type=int_in(1), default=4, help="MoE layers")
    gen.add_argument(
        "--devices",
        type=int_in(1),
        default=None,
        help=f"source devices (ranks) (default: the --cluster's devices, else {DEFAULT_DEVICES})",
    )
    gen.add_argument("--experts", type=int_in(1), default=32, help="experts per layer")
    gen.add_argument("--top-k", type=int_in(1), default=DEFAULT_TOP_K, help="experts per token")
    gen.add_argument(
        "--tokens-per-device",
        type=int_in(1),
        default=DEFAULT_TOKENS_PER_DEVICE,
        help="tokens each device routes per step and layer",
    )
    gen.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="random seed")
    gen.add_argument("--name", default=None, help="trace name (default: the generator's)")
    gen.add_argument(
        "--model",
        default=None,
        help="model preset recorded in the trace's metadata, used by simulate/plan/layouts "
        "(default: none recorded)",
    )
    gen.add_argument(
        "--cluster",
        default=None,
        help="cluster recorded in the trace's metadata (preset, preset:N or YAML; its devices "
        "are the trace's), used by simulate/plan/layouts (default: none recorded)",
    )
    gen.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a generator parameter, e.g. s=1.2 (repeatable)",
    )

    parser.set_defaults(run=run)
    return parser


def _add_import_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("importer options (only those the format uses)")
    g.add_argument(
        "--format", choices=FORMATS, default="auto", help="source format (default: auto-detect)"
    )
    g.add_argument("--top-k", type=int_in(1), default=None, help="experts per token")
    g.add_argument(
        "--tokens-per-device",
        type=int_in(1),
        default=None,
        help="tokens per source per step (default: inferred from the counts)",
    )
    g.add_argument(
        "--devices",
        type=int_in(1),
        default=None,
        help="eplb/expert-counts: source devices to spread loads over (default 1)",
    )
    g.add_argument("--model", default=None, help="expert-counts: model (default olmoe)")
    g.add_argument("--kind", default=None, help="expert-counts: kind (default expert_counts)")
    g.add_argument(
        "--domain",
        default=None,
        help="expert-counts: domain(s), comma-separated (default: all, one per step)",
    )
    g.add_argument(
        "--experts", type=int_in(1), default=None, help="megatron: experts (default: max index + 1)"
    )
    g.add_argument("--name", default=None, help="trace name")


def _load(args: argparse.Namespace, path: str) -> Trace:
    opts = {
        "top_k": args.top_k,
        "tokens_per_device": args.tokens_per_device,
        "devices": args.devices,
        "model": args.model,
        "kind": args.kind,
        "domain": args.domain,
        "experts": args.experts,
    }
    trace = load_any(path, format=args.format, **opts)
    if args.name:
        trace.name = args.name
    return trace


def _check_npz(path: str, option: str) -> None:
    if Path(path).suffix != ".npz":
        raise ConfigError("output must end in .npz", source=path, field=option)
    check_output_file(path, option)


TRACE_BYTES_PER_CELL = 8 * 3  # int64 counts, plus the generator's float work arrays


LONG_BYTES = 2**26  # from this estimate (or input, or output) on, say that the work takes a while


def check_trace_size(steps: int, layers: int, devices: int, experts: int, field: str) -> None:
    """Refuse a `[S, L, D, E]` trace that cannot fit in memory, with the estimate; announce
    one that fits but is large (it takes seconds to minutes)."""
    cells = steps * layers * devices * experts
    need = cells * TRACE_BYTES_PER_CELL
    check_fits(
        need,
        f"a trace of {steps} steps x {layers} layers x {devices} devices x {experts} experts",
        source="trace",
        field=field,
        hint="use fewer steps, layers, devices or experts",
    )
    if need >= LONG_BYTES:
        _announce(f"generating {cells:,} counts (about {human_bytes(need)} of memory)")


def parse_param(text: str) -> tuple[str, Any]:
    """`key=value` -> (key, int | float | str)."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ConfigError(f"expected KEY=VALUE, got {text!r}", field="--param")
    raw = raw.strip()
    for cast in (int, float):
        try:
            return key, cast(raw)
        except ValueError:
            pass
    return key, raw


def _run_stats(args: argparse.Namespace) -> int:
    trace = _load(args, args.file)
    require_tokens(trace, args.file)
    stats = trace_stats(trace, args.layout_devices)
    if args.json:
        sys.stdout.write(json_text(stats, args.file, indent=2))
    else:
        Console().print(stats_table(stats))
    return 0


def input_bytes(path: str | Path) -> int:
    """Bytes a conversion reads: the file's size, or the sum over a folder's files."""
    p = Path(path)
    try:
        if p.is_dir():
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        return p.stat().st_size if p.is_file() else 0
    except OSError:
        return 0  # unreadable: the importer says why


def _announce(text: str) -> None:
    print(f"poise: {text}; this takes a while", file=sys.stderr, flush=True)


def _run_convert(args: argparse.Namespace) -> int:
    _check_npz(args.dst, "dst")
    size = input_bytes(args.src)
    if size >= LONG_BYTES:  # parsing JSON / JSONL runs at tens of MB/s
        _announce(f"converting {args.src} ({human_bytes(size)} to read)")
    trace = _load(args, args.src)
    if trace.counts.nbytes >= LONG_BYTES:  # compressing the counts runs at tens of MB/s too
        _announce(
            f"writing {trace.counts.size:,} counts ({human_bytes(trace.counts.nbytes)} before "
            f"compression) to {args.dst}"
        )
    trace.save(args.dst)
    print(
        f"wrote {args.dst}: {trace.steps} steps x {trace.layers} layers x {trace.devices} "
        f"devices x {trace.experts} experts (top-{trace.top_k}, "
        f"{trace.tokens_per_device} tokens/device)"
    )
    return 0


def _generate_devices(args: argparse.Namespace) -> int:
    """`--devices`, else the `--cluster`'s devices, else `DEFAULT_DEVICES`; a `--cluster` of
    another size is refused (the trace records the cluster it was generated for)."""
    if args.cluster is None:
        return DEFAULT_DEVICES if args.devices is None else args.devices
    cluster = get_cluster(args.cluster)
    check_cluster_size(cluster, "--cluster")
    if args.devices is not None and args.devices != cluster.num_devices:
        raise ConfigError(
            f"{args.cluster} has {cluster.num_devices} devices but --devices is {args.devices} "
            "(leave --devices out to use the cluster's)",
            source="--cluster",
            field="devices",
        )
    return cluster.num_devices


def _run_generate(args: argparse.Namespace) -> int:
    _check_npz(args.out, "out")
    params = dict(parse_param(p) for p in args.param)
    devices = _generate_devices(args)
    check_trace_size(args.steps, args.layers, devices, args.experts, "--steps")
    if args.model is not None:
        from poise.core.spec import get_model

        get_model(args.model)  # an unknown model fails before any work
    trace = generate(
        args.kind,
        steps=args.steps,
        layers=args.layers,
        devices=devices,
        experts=args.experts,
        top_k=args.top_k,
        tokens_per_device=args.tokens_per_device,
        seed=args.seed,
        name=args.name,
        **params,
    )
    if args.model is not None:
        trace.meta["model"] = args.model
    if args.cluster is not None:
        trace.meta["cluster"] = args.cluster
    trace.save(args.out)
    print(
        f"wrote {args.out}: {trace.meta['generator']} trace, {trace.steps} steps x "
        f"{trace.layers} layers x {trace.devices} devices x {trace.experts} experts"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    actions = {"stats": _run_stats, "convert": _run_convert, "generate": _run_generate}
    return actions[args.trace_command](args)
