"""What the live Balancer plans from: the modelled cluster of local ranks (the prior of the
self-calibration, with the host's shared cores), the `ModelSpec` read from the MoE layers, their
slot count and the plan they run now. Each check raises one `ConfigError` naming the field."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.presets import PRESETS, get_cluster
from poise.core.spec import ModelSpec
from poise.nn.moe import MoE
from poise.nn.slots import slot_maps
from poise.runtime.moves.layer_state import LayerState


def default_cluster(world_size: int, ranks_on_host: int | None = None) -> Cluster:
    """A modelled cluster of `world_size` local CPU ranks: the `cpu-2` preset's rates, one node.

    `ranks_on_host` (None: not known, the devices modelled as independent): the processes on
    this host (this group's ranks and any others). Where they want more cores than it gives
    them, the devices share `shared_cores` (`HostCosts.shared_cores`): a waiting rank lends its
    core to the others. Their bulk transfers (Trans, Agg, migration, the token all-to-all) are
    priced on one link all of them share (`Link.shared_by` = `world_size`): processes of one
    host move bytes with the same cores and memory, so bytes crossing in opposite directions add
    up, where the preset's full-duplex link would carry them at once
    (`benchmarks/contended_exchange.py`: one replica each way takes as long as two one way)."""
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
    # CPU processes on this host share its cores
    local = ranks_on_host(dist.get_world_size()) if on_cpu and dist.is_initialized() else None
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
    `threads` threads each (default `torch.get_num_threads()`) share this host's usable cores
    (`os.sched_getaffinity`): cores / threads x world_size / max(ranks_on_host, world_size);
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


def layer_slots(layers: Sequence[LayerState]) -> int:
    """The expert slots each MoE layer holds on this rank (the first dimension of its expert
    tensors), the same in every layer."""
    slots = {int(s.params[0].shape[0]) for s in layers}
    if len(slots) != 1:
        raise ConfigError(f"MoE layers have different slot counts {sorted(slots)}", field="slots")
    return slots.pop()


def initial_plan(
    layers: Sequence[LayerState], slots: int, rank: int, split_tokens: bool, spec: ModelSpec
) -> Plan:
    """The plan `layers` run now (their `routing`: static EP's for fresh layers), `slots` a
    rank, as rank `rank` sees it; its assignment splits replicated experts' tokens by each
    step's counts where `split_tokens`.

    A routing's weights are this rank's source shares, so this assumes plain (not group-local)
    routing, which is all a layer's own default routing uses."""
    routings = [s.layer.routing for s in layers]
    if len({x.num_experts for x in routings}) != 1:
        raise ConfigError("MoE layers have different expert counts", field="num_experts")
    home = np.stack([x.home for x in routings]).astype(np.int64)
    copies = np.stack([x.copies for x in routings]).astype(np.int32)
    placement = Placement(home=home, copies=copies, slots_per_device=slots)
    placement.validate()
    assignment = Assignment(np.stack([x.weights for x in routings]).astype(np.float64))
    assignment = assignment.with_split(split_tokens)
    for state, routing in zip(layers, routings, strict=True):
        mine = slot_maps(placement, state.index, slots)[rank]
        if not np.array_equal(mine.expert, routing.slots.expert):
            raise ConfigError(
                f"MoE layer {state.index}'s slots are not in the order slot_maps derives "
                "from its placement (homes, then replicas, then empty)",
                field="routing.slots",
            )
    transfers = transfers_between(None, placement, spec)
    return Plan(policy="initial", placement=placement, assignment=assignment, transfers=transfers)
