"""Arguments shared by several subcommands: cluster, model, slots, schedule, policy options."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.presets import get_cluster
from poise.core.spec import ModelSpec, get_model
from poise.cost.model import CostModel
from poise.cost.schedule import parse_schedule
from poise.plan.policies.base import PlanContext
from poise.trace.loads import spec_for_trace
from poise.trace.trace import Trace

DEFAULT_MODEL = "smartmoe-gpt"


def add_planning_args(p: argparse.ArgumentParser, *, cluster_default: str) -> None:
    p.add_argument(
        "--cluster",
        default=cluster_default,
        help="preset name, preset:N (nodes or domains) or a cluster YAML "
        f"(default {cluster_default})",
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"model preset or YAML (default: {DEFAULT_MODEL}'s widths with the "
        "trace's experts, top-k and layers)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="expert slots per device (default: ceil(experts/devices) + 1)",
    )
    p.add_argument("--schedule", default="sync", help="sync, pipelined(n) or prophet")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="a policy setting, e.g. vexpert.threshold=1.2 (repeatable)",
    )


def parse_options(items: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        policy, dot, name = key.partition(".")
        if not eq or not dot or not policy or not name:
            raise ConfigError("expected POLICY.KEY=VALUE", source=item, field="--option")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out.setdefault(policy, {})[name] = value
    return out


def planning_context(
    args: argparse.Namespace,
    trace: Trace,
    source: str,
) -> tuple[Cluster, ModelSpec, PlanContext]:
    cluster = get_cluster(args.cluster)
    explicit = args.model is not None
    spec = spec_for_trace(
        get_model(args.model or DEFAULT_MODEL), trace, explicit=explicit, source=source
    )
    slots = args.slots
    if slots is None:
        slots = -(-spec.experts // cluster.num_devices) + 1
    if slots < 1:
        raise ConfigError(f"must be >= 1, got {slots}", source="--slots", field="slots")
    cost = CostModel(cluster, spec, parse_schedule(args.schedule))
    ctx = PlanContext.create(
        cluster, spec, slots_per_device=slots, cost=cost, options=parse_options(args.option)
    )
    return cluster, spec, ctx
