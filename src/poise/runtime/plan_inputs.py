"""What the live Balancer plans for: the modelled cluster of local ranks (the prior of the
self-calibration, with the host's shared cores) and the `ModelSpec` read from the MoE layers.
The planning itself, with the `PlanContext` a plan is made in, is `poise.runtime.planning_job`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.presets import PRESETS, get_cluster
from poise.core.spec import ModelSpec
from poise.nn.moe import MoE


def default_cluster(world_size: int, ranks_on_host: int | None = None) -> Cluster:
    """A modelled cluster of `world_size` local CPU ranks: the `cpu-2` preset's rates, one node.

    `ranks_on_host` (None: not known, the devices are modelled as independent): the processes
    running on this host (this group's ranks and any others), each with `torch.get_num_threads()`
    threads. Where they want more cores than the host gives them (`os.sched_getaffinity`), the
    cluster's devices share `shared_cores` = cores / threads x world_size / ranks_on_host cores'
    worth of compute (`HostCosts.shared_cores`): a waiting rank lends its core to the others.

    Where the host is known, its ranks' bulk transfers (Trans, Agg, migration, and the token
    all-to-all) are priced on one link all of them share (`Link.shared_by` = `world_size`):
    processes of one host move their bytes with the same cores and memory, so bytes that cross
    in opposite directions add up, where a device's own full-duplex link (the preset's) would
    carry them at once. Measured (`benchmarks/contended_exchange.py --worlds 2 --layouts single
    ring pair`, docs/benchmarks.md): one replica's Trans and Agg between 2 gloo ranks took
    4.8 ms one way, 6.8-7.0 ms for two replicas one way, and 7.2-7.6 ms for one replica each
    way, as for two one way; a full-duplex model prices that last as one replica. Under it a
    second replica in a layer with one each way (a hot expert's and a cold one's) cost nothing,
    and `auto` kept such replicas, moving twice the bytes the split needed."""
    base = PRESETS["cpu-2"]
    if world_size != base.num_devices:
        base = dataclasses.replace(base, name=f"cpu-{world_size}", devices_per_node=world_size)
    if ranks_on_host is None:
        return base
    one_link = dataclasses.replace(base.intra_node, shared_by=world_size)
    base = dataclasses.replace(base, intra_node=one_link)
    shared = shared_cores(world_size, ranks_on_host)
    if shared == 0.0:
        return base
    host = dataclasses.replace(base.host, shared_cores=shared)
    return dataclasses.replace(base, name=f"{base.name}-on-{shared:g}-cores", host=host)


def prior_cluster(cluster: Cluster | str | None, world_size: int, on_cpu: bool) -> Cluster:
    """The cluster plans are priced on before the run fits its own constants: `cluster` (a
    preset's name or a `Cluster`), else `default_cluster` for `world_size` ranks (CPU processes
    of one host sharing its cores); a cluster of another size than the run is a `ConfigError`."""
    if isinstance(cluster, str):
        cluster = get_cluster(cluster)
    local = None  # CPU processes on this host share its cores
    if on_cpu and dist.is_initialized():
        local = ranks_on_host(dist.get_world_size())
    prior = cluster or default_cluster(world_size, ranks_on_host=local)
    if prior.num_devices != world_size:
        raise ConfigError(
            f"cluster has {prior.num_devices} devices but {world_size} ranks run",
            source=prior.name,
            field="cluster",
        )
    return prior


def ranks_on_host(world_size: int) -> int:
    """The training processes on this host: torchrun's (and `poise train --nproc`'s)
    `LOCAL_WORLD_SIZE`, else `world_size` (every rank local, as the launchers of one machine
    start them)."""
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None:
        return int(world_size)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"must be a positive integer, got {text!r}", source="environment",
            field="LOCAL_WORLD_SIZE",
        )  # fmt: skip
    return value


def shared_cores(world_size: int, ranks_on_host: int, threads: int | None = None) -> float:
    """The cores' worth of compute `world_size` ranks get when `ranks_on_host` processes of
    `threads` threads each (default `torch.get_num_threads()`) share this host's usable cores;
    0.0 when every rank gets its threads' cores (no sharing to model)."""
    threads = max(1, int(torch.get_num_threads() if threads is None else threads))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = max(1, int(cores or 1))
    if ranks_on_host * threads <= cores:
        return 0.0
    return cores / threads * world_size / max(ranks_on_host, world_size)


def spec_from_layers(layers: Sequence[MoE], tokens_per_device: int = 1) -> ModelSpec:
    """The `ModelSpec` the planner prices: shapes of the first layer's experts (`w_in [P, M, H]`),
    its expert count and top-k, the number of layers, the parameters' dtype (its compute dtype:
    fp32, bf16 or fp16 as the weights are; tf32 is not inferred), AdamW's two moments
    in the parameters' dtype, `tokens_per_device` tokens entering a layer per rank and step."""
    first = layers[0]
    w_in = first.experts.w_in
    dtype_bytes = w_in.element_size()
    return ModelSpec(
        name="live",
        d_model=int(w_in.shape[1]),
        d_expert=int(w_in.shape[2]),
        experts=first.num_experts,
        top_k=first.top_k,
        moe_layers=len(layers),
        dtype_bytes=dtype_bytes,
        tokens_per_device=max(1, int(tokens_per_device)),
        optimizer_bytes_per_param=2.0 * dtype_bytes,
        activation=first.experts.activation,
        compute_dtype=_COMPUTE_DTYPES.get(str(w_in.dtype)),
    )


# torch dtype names -> compute dtypes (`core.cluster.DTYPES`); others: from the element size
_COMPUTE_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


__all__ = [
    "default_cluster",
    "prior_cluster",
    "ranks_on_host",
    "shared_cores",
    "spec_from_layers",
]
