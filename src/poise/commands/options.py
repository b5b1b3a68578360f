"""Arguments shared by several subcommands: cluster, model, slots, schedule, policy options."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from poise.core.budget import check_fits
from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.fields import read_set_value
from poise.core.presets import PRESETS, get_cluster
from poise.core.spec import ModelSpec, get_model
from poise.cost.model import CostModel
from poise.cost.schedule import parse_schedule
from poise.plan.policies.base import PlanContext
from poise.trace.loads import require_tokens, spec_for_trace
from poise.trace.trace import Trace
from poise.util.argparsing import int_in

DEFAULT_MODEL = "smartmoe-gpt"
DEFAULT_CLUSTER = "v100-ib50"


def add_cluster_arg(p: argparse.ArgumentParser) -> None:
    """`--cluster`, default none: the cluster the trace recorded if it is a preset, else
    `DEFAULT_CLUSTER` (`cluster_for_trace`)."""
    p.add_argument("--cluster", default=None, help=CLUSTER_HELP)


def add_planning_args(p: argparse.ArgumentParser) -> None:
    add_cluster_arg(p)
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument(
        "--slots",
        type=int_in(1, MAX_SLOTS),
        default=None,
        help="expert slots per device (default: ceil(experts/devices) + 1)",
    )
    p.add_argument("--schedule", default="sync", help=SCHEDULE_HELP)
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help=OPTION_HELP,
    )


MAX_SLOTS = 4096  # expert slots per device; more is no placement any cluster holds
CLUSTER_HELP = (
    "preset name, preset:N (nodes or domains) or a cluster YAML (default: the cluster recorded "
    f"in the trace if it is a preset, else {DEFAULT_CLUSTER})"
)
MODEL_HELP = (
    "model preset or YAML (default: the model recorded in the trace, else "
    f"{DEFAULT_MODEL}'s widths; either with the trace's experts, top-k and layers)"
)
SCHEDULE_HELP = "sync, pipelined(n), prophet, hybrid or padded (default sync)"
OPTION_HELP = (
    "a policy setting, e.g. vexpert.threshold=1.2 (repeatable; an unknown policy or key is an "
    "error listing the known ones)"
)


def model_for_trace(model: str | None, trace: Trace, source: str) -> ModelSpec:
    """The model to price `trace` with: `--model` if given (a warning on stderr if the trace
    recorded another), else the model the trace recorded (`meta["model"]`, as `poise train`
    and `poise trace generate --model` write it), else `DEFAULT_MODEL`; each with the trace's
    experts, top-k and layers (an explicit model must agree on experts)."""
    recorded = trace.meta.get("model") if isinstance(trace.meta, dict) else None
    recorded = recorded if isinstance(recorded, str) and recorded else None
    if model is not None:
        if recorded is not None and recorded != model:
            print(
                f"poise: warning: {source}: the trace was recorded with model {recorded!r}; "
                f"pricing it as --model {model!r}",
                file=sys.stderr,
            )
        return spec_for_trace(get_model(model), trace, explicit=True, source=source)
    if recorded is not None:
        try:
            base = get_model(recorded)
        except ConfigError:
            print(
                f"poise: note: {source}: the trace's recorded model {recorded!r} is not a Poise "
                f"model preset; priced with {DEFAULT_MODEL}'s widths (--model chooses)",
                file=sys.stderr,
            )
        else:
            return spec_for_trace(base, trace, explicit=False, source=source)
    return spec_for_trace(get_model(DEFAULT_MODEL), trace, explicit=False, source=source)


def recorded_cluster(trace: Trace) -> str | None:
    """The cluster `trace` recorded (`meta["cluster"]`, as `poise train` and `poise trace
    generate --cluster` write it), or None."""
    recorded = trace.meta.get("cluster") if isinstance(trace.meta, dict) else None
    return recorded if isinstance(recorded, str) and recorded else None


def _preset_cluster(name: str) -> Cluster | None:
    """`name` as a preset or `preset:N`, or None (a YAML path or an unknown name)."""
    if name.partition(":")[0] not in PRESETS:
        return None
    try:
        return get_cluster(name)
    except ConfigError:
        return None


def _same_cluster(a: str, b: str) -> bool:
    if a == b:
        return True
    ca, cb = _preset_cluster(a), _preset_cluster(b)
    if ca is None or cb is None:
        return False
    return dataclasses.replace(ca, name="") == dataclasses.replace(cb, name="")


def cluster_for_trace(cluster: str | None, trace: Trace, source: str) -> Cluster:
    """The cluster to model `trace` on: `--cluster` if given (a one-line warning on stderr if the
    trace recorded another), else the cluster the trace recorded if it is a preset (saying so),
    else `DEFAULT_CLUSTER`. Checked for size (`check_cluster_size`)."""
    recorded = recorded_cluster(trace)
    if cluster is not None:
        if recorded is not None and not _same_cluster(recorded, cluster):
            print(
                f"poise: warning: {source}: the trace was recorded on cluster {recorded!r}; "
                f"modelling it on --cluster {cluster!r}",
                file=sys.stderr,
            )
        chosen = get_cluster(cluster)
    elif recorded is not None and (preset := _preset_cluster(recorded)) is not None:
        print(
            f"poise: note: {source}: modelled on the cluster the trace recorded, {recorded!r} "
            "(--cluster chooses another)",
            file=sys.stderr,
        )
        chosen = preset
    else:
        if recorded is not None:
            print(
                f"poise: note: {source}: the trace's recorded cluster {recorded!r} is not a "
                f"Poise cluster preset; modelled on {DEFAULT_CLUSTER} (--cluster chooses)",
                file=sys.stderr,
            )
        chosen = get_cluster(DEFAULT_CLUSTER)
    check_cluster_size(chosen, "--cluster")
    return chosen


def parse_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """`POLICY.KEY=VALUE` items -> `{policy: {key: value}}`, each policy, key and value checked
    (`poise.plan.policies.options.check_option`): a typo is an error, never silently ignored."""
    from poise.plan.policies.options import check_option

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        policy, dot, name = key.strip().partition(".")
        if not eq or not dot or not policy or not name:
            raise ConfigError(
                f"expected POLICY.KEY=VALUE, got {item!r}", source="--option", field=item
            )
        value = read_set_value(raw, item, "--option")
        out.setdefault(policy, {})[name.strip()] = check_option(policy, name.strip(), value)
    return out


def planning_context(
    args: argparse.Namespace,
    trace: Trace,
    source: str,
) -> tuple[Cluster, ModelSpec, PlanContext]:
    options = parse_options(args.option)
    if args.cluster is not None:  # a bad --cluster fails before the trace is examined
        check_cluster_size(get_cluster(args.cluster), "--cluster")
    require_tokens(trace, source)
    cluster = cluster_for_trace(args.cluster, trace, source)
    spec = model_for_trace(args.model, trace, source)
    slots = args.slots
    if slots is None:
        slots = -(-spec.experts // cluster.num_devices) + 1
    if slots < 1:
        raise ConfigError(f"must be >= 1, got {slots}", source="--slots", field="slots")
    check_plan_size(trace.layers, cluster.num_devices, slots, spec.experts)
    cost = CostModel(cluster, spec, parse_schedule(args.schedule))
    ctx = PlanContext.create(cluster, spec, slots_per_device=slots, cost=cost, options=options)
    return cluster, spec, ctx


MAX_DEVICES = 65536  # modelled devices: beyond this no run is planned here in useful time


def check_cluster_size(cluster: Cluster, option: str) -> None:
    """Refuse clusters too large to model (planning is at least linear in devices per layer)."""
    if cluster.num_devices > MAX_DEVICES:
        raise ConfigError(
            f"{cluster.num_devices} devices; at most {MAX_DEVICES} can be modelled",
            source=option,
            field="devices",
        )


def check_plan_size(layers: int, devices: int, slots: int, experts: int, steps: int = 1) -> None:
    """Refuse a problem whose per-step arrays (`[L, D, slots]` placements, `[L, D, E]` loads and
    routing, a few copies each) cannot fit in memory, with the estimate."""
    cells = layers * devices * (slots + experts) * max(1, steps)
    check_fits(
        cells * 8 * 16,
        f"planning {layers} layers x {devices} devices x {slots} slots for {experts} experts",
        source="--slots" if slots > experts else "--cluster",
        field="size",
        hint="use a smaller --cluster or fewer --slots",
    )
