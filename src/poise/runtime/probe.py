"""A start-up probe of the bulk-transfer rate: the self-calibration's first `k_transfer`.

The self-calibration (`poise.runtime.selfcal`) fits `k_transfer`, the measured seconds of
Trans, Agg and migration over the cost model's, from steps that ran replicas. Before any did,
the first plans were priced on the prior cluster's links as they are (k = 1): on CPU gloo ranks
a migration then cost 8-11 times what it was priced (`docs/benchmarks.md`, `many-experts`: 33
homes moved at step 11 for 240 ms of boundary, priced at 11 ms), so the first plan moved homes
that later plans had to move back.

The probe measures one migration's worth of bulk traffic on the Balancer's process group before
training starts: every rank sends `ModelSpec.migration_bytes` (one expert's weights and
optimizer moments) to the next rank and receives as much from the previous one, packed and
unpacked as `poise.runtime.transfers` does (one copy into a flat buffer, one
`all_to_all_single`, one copy out). The cost model prices the same moves on the prior cluster
(`poise.cost.traffic.migration_traffic`, `poise.cost.model.link_time`, times
`HostCosts.transfer_scale`):

    modelled = max over links (bytes on the link / bandwidth) + latency    (`poise.cost.network`)
    k_probe  = median over rounds of (min over ranks of the round's seconds) / modelled

Each round is timed on every rank after a barrier; the rank that waited least gives the
exchange's time (as `selfcal.across_ranks` takes collectives); the first round, which pays the
backend's set-up, is left out. `k_probe` is the centre `selfcal.fit_cluster` starts from and the
guard's price of the first switch; the fits from the run's own steps take over as they come.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.core.spec import ModelSpec
from poise.cost.model import link_time
from poise.cost.traffic import migration_traffic
from poise.nn.comm import comm_device
from poise.runtime.selfcal import SCALE_LIMITS

ROUNDS = 5  # timed rounds after the warm-up one


def modelled_probe_s(cluster: Cluster, spec: ModelSpec) -> float:
    """Seconds the cost model gives the probe's moves on `cluster`: rank r sends one expert's
    migration (`spec.migration_bytes`) to rank (r + 1) mod D, all at once, as one layer."""
    D = cluster.num_devices
    ranks = np.arange(D)
    moves = np.stack([np.zeros(D, int), np.zeros(D, int), ranks, (ranks + 1) % D], axis=1)
    send, recv = migration_traffic(cluster, moves, 1, spec.migration_bytes)
    return float(link_time(cluster, send, recv)[0] * cluster.host.transfer_scale)


def measure_probe_s(
    nbytes: float,
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
    rounds: int = ROUNDS,
) -> float:
    """Measured seconds of the probe's exchange (module docstring) of `nbytes` per rank over
    `group` (collective): the median over `rounds` timed rounds of the fastest rank's time."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = comm_device(group, device)
    n = max(1, int(nbytes // 4))
    source = torch.randn(n, device=dev)
    landed = torch.empty(n, device=dev)
    send, recv = torch.empty(n, device=dev), torch.empty(n, device=dev)
    into, out = [0] * world, [0] * world
    into[(rank - 1) % world], out[(rank + 1) % world] = n, n
    seconds = torch.zeros(rounds + 1, dtype=torch.float64, device=dev)
    for r in range(rounds + 1):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        send.copy_(source)
        dist.all_to_all_single(recv, send, into, out, group=group)
        landed.copy_(recv)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds[r] = time.perf_counter() - t0
    dist.all_reduce(seconds, op=dist.ReduceOp.MIN, group=group)
    return float(seconds[1:].median())


def probe_transfer_scale(
    cluster: Cluster,
    spec: ModelSpec,
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
    rounds: int = ROUNDS,
) -> tuple[float, float, float]:
    """`(k_probe, measured_s, modelled_s)` (module docstring), `k_probe` clipped to
    `selfcal.SCALE_LIMITS`. Collective over `group`, whose size is `cluster.num_devices`."""
    modelled = modelled_probe_s(cluster, spec)
    measured = measure_probe_s(spec.migration_bytes, group, device, rounds)
    k = float(np.clip(measured / modelled, *SCALE_LIMITS)) if modelled > 0 else 1.0
    return k, measured, modelled


__all__ = ["ROUNDS", "measure_probe_s", "modelled_probe_s", "probe_transfer_scale"]
