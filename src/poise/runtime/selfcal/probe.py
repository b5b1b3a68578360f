"""Start-up probes: the self-calibration's first `k_transfer` and the first switch's price.

Before any replica ran, the fit has no transfers to measure. Two collective probes on the
Balancer's process group, before training, give the first scales (`selfcal.fit`):

- *the exchange*: every rank sends `ModelSpec.migration_bytes` (one expert's weights and
  moments) to the next rank, packed and unpacked as `moves.transfers` does;
- *the switch*: `transfers.migrate` itself on a synthetic layer shaped as the model's experts,
  `switch_probe_homes` homes a rank moving to the next rank and back, through the run's own
  channel and kept buffers, so that what a migration does beyond its bytes is priced too.

Each is priced by the cost model on the prior cluster (`cost.traffic.migration_traffic`,
`cost.model.link_time`, times `HostCosts.transfer_scale`) and timed as

    k = median over rounds of (min over ranks of the round's seconds) / modelled

after a left-out warm-up round, each round from a barrier (the rank that waited least, as
`selfcal.fit.across_ranks` takes collectives). The exchange's `k` is the fit's first centre;
the switch's prices a switch until the run measures one (`control.pricing.SwitchPrice`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from poise.core.cluster import Cluster
from poise.core.placement import Placement
from poise.core.spec import ModelSpec
from poise.cost.model import link_time
from poise.cost.traffic import migration_messages, migration_traffic
from poise.nn import comm
from poise.nn.comm import comm_device
from poise.nn.slots import slot_maps
from poise.runtime.moves.exchange import Scratch
from poise.runtime.moves.host_link import Channel
from poise.runtime.moves.transfers import migrate
from poise.runtime.selfcal.fit import SCALE_LIMITS

ROUNDS = 5  # timed rounds after the warm-up one
SWITCH_PROBE_BYTES = 64 * 2**20  # the most one rank's synthetic homes hold (weights + moments)


def modelled_probe_s(cluster: Cluster, spec: ModelSpec, homes: int = 1) -> float:
    """Seconds the cost model gives the probe's moves on `cluster`: rank r sends `homes`
    experts' migrations (`spec.migration_bytes` each) to rank (r + 1) mod D, all at once, as
    one layer."""
    D = cluster.num_devices
    src = np.repeat(np.arange(D), homes)
    moves = np.stack([np.zeros(src.size, int), np.arange(src.size), src, (src + 1) % D], axis=1)
    send, recv = migration_traffic(cluster, moves, 1, spec.migration_bytes)
    messages = migration_messages(cluster, moves, 1)  # one message to the next rank
    return float(link_time(cluster, send, recv, messages)[0] * cluster.host.transfer_scale)


def timed_rounds(
    round_: Callable[[int], None],
    group: dist.ProcessGroup | None,
    device: torch.device,
    rounds: int = ROUNDS,
) -> float:
    """The median over `rounds` timed rounds of the fastest rank's seconds of `round_(r)`
    (collective), after a warm-up round `r` = 0 that is left out: each round starts at a
    barrier, and ends on a CUDA device once its kernels are done."""
    seconds = torch.zeros(rounds + 1, dtype=torch.float64, device=comm_device(group, device))
    for r in range(rounds + 1):
        comm.barrier(group=group)
        t0 = time.perf_counter()
        round_(r)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[r] = time.perf_counter() - t0
    comm.all_reduce(seconds, op=dist.ReduceOp.MIN, group=group)
    return float(seconds[1:].median())


def scale_of(measured_s: float, modelled_s: float) -> float:
    """`measured_s / modelled_s` clipped to `SCALE_LIMITS`, 1 where nothing was
    modelled."""
    return float(np.clip(measured_s / modelled_s, *SCALE_LIMITS)) if modelled_s > 0 else 1.0


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

    def exchange(_: int) -> None:
        send.copy_(source)
        comm.all_to_all_single(recv, send, into, out, group=group)
        landed.copy_(recv)

    return timed_rounds(exchange, group, dev, rounds)


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
    return scale_of(measured, modelled), measured, modelled


def switch_probe_homes(spec: ModelSpec, world: int) -> int:
    """The homes each rank moves in the switch probe (module docstring): half a rank's
    experts, at most `SWITCH_PROBE_BYTES` of weights and moments, at least one."""
    by_bytes = int(SWITCH_PROBE_BYTES // max(spec.migration_bytes, 1.0))
    return max(1, min(spec.experts // max(world, 1) // 2, by_bytes))


def _synthetic_layer(
    spec: ModelSpec, homes: int, device: torch.device
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """`homes` slots of the expert tensors (`[homes, d_model, d_expert]` in, `[homes, d_expert,
    d_model]` out) and an optimizer with `optimizer_bytes_per_param` bytes of moments each."""
    dtype = {2: torch.bfloat16, 8: torch.float64}.get(int(spec.dtype_bytes), torch.float32)
    M, H = spec.d_model, spec.d_expert
    shapes = [(homes, M, H)] * (spec.expert_matrices - 1) + [(homes, H, M)]
    params = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    optimizer = torch.optim.SGD(params, lr=0.0)  # holds the state `migrate` moves
    moments = max(0, round(spec.optimizer_bytes_per_param / spec.dtype_bytes))
    for p in params:
        optimizer.state[p] = {f"moment{i}": torch.zeros_like(p) for i in range(moments)}
    return params, optimizer


def measure_switch_probe_s(
    spec: ModelSpec,
    homes: int,
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
    rounds: int = ROUNDS,
    *,
    link: Channel | None = None,
    scratch: Scratch | None = None,
) -> float:
    """Measured seconds of the switch probe (module docstring): `transfers.migrate` moving
    every rank's `homes` synthetic homes to the next rank, then back, round by round; the
    median over `rounds` timed rounds (after a warm-up one, which also sizes the reused
    buffers) of the fastest rank's time. `link`, `scratch`: the path the run's migrations take
    (`transfers.migrate`'s; default: through `group`, in buffers of the probe's own).
    Collective over `group`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = torch.device(device)
    params, optimizer = _synthetic_layer(spec, homes, dev)
    home = np.repeat(np.arange(world), homes)
    layouts = [Placement.from_homes(h[None], world, homes) for h in (home, (home + 1) % world)]
    start = slot_maps(layouts[0], 0, homes)
    maps = (start, slot_maps(layouts[1], 0, homes, previous=start))
    scratch = Scratch() if scratch is None else scratch

    def switch(r: int) -> None:  # there on even rounds, back on odd ones
        old, new = maps if r % 2 == 0 else maps[::-1]
        migrate(params, optimizer, old, new, rank, group=group, fill_replicas=False,
                link=link, scratch=scratch)  # fmt: skip

    return timed_rounds(switch, group, dev, rounds)


def probe_switch_scale(
    cluster: Cluster,
    spec: ModelSpec,
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
    rounds: int = ROUNDS,
    *,
    link: Channel | None = None,
    scratch: Scratch | None = None,
) -> tuple[float, float, float, int]:
    """`(k_switch, measured_s, modelled_s, homes)` of the switch probe (module docstring),
    `k_switch` clipped to `SCALE_LIMITS`; `link`, `scratch` as for
    `measure_switch_probe_s`. Collective over `group`, whose size is `cluster.num_devices`."""
    homes = switch_probe_homes(spec, cluster.num_devices)
    modelled = modelled_probe_s(cluster, spec, homes)
    measured = measure_switch_probe_s(
        spec, homes, group, device, rounds, link=link, scratch=scratch
    )
    return scale_of(measured, modelled), measured, modelled, homes


def start_up_probes(
    cluster: Cluster,
    spec: ModelSpec,
    group: dist.ProcessGroup | None,
    device: torch.device | str,
    *,
    link: Channel | None = None,
    scratch: Scratch | None = None,
) -> tuple[tuple[float, float, float], tuple[float, float, float, int]]:
    """The Balancer's start-up probes, in order: the exchange's (`probe_transfer_scale`, the
    fit's first `k_transfer`) and the switch's (`probe_switch_scale`, the first switch's
    price), the latter on the switches' own path (`link`, `scratch`: its channel and its kept
    buffers, which this sizes). Collective over `group`."""
    exchange = probe_transfer_scale(cluster, spec, group, device)
    switch = probe_switch_scale(cluster, spec, group, device, link=link, scratch=scratch)
    return exchange, switch
