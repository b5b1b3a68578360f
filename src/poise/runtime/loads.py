"""Each step's loads: what every rank of the Balancer's group saw in the step, in one collective.

At `Balancer.reduce_replicas`, each rank packs one int64 row

    [counts of every layer [L * E], non-finite flag [1], rows computed [L], seconds [M] as ns]

(its layers' `last_counts` summed over the step's forwards, whether any layer saw NaN or
infinity, the rows its expert slots computed, and its seconds per `MEASURED` column),
and one `all_gather` over the group gives every rank the same table `[D, L * E + 1 + L + M]`.
A non-finite flag on any rank raises `NonFiniteInputError` on every rank, before the optimizer
steps. The seconds are reduced across ranks as `across_ranks` takes them and, with a
vote group (several EP groups that must decide alike), to their maximum over it, so that every
group's planner sees the same figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from poise.nn import comm
from poise.nn.comm import comm_device
from poise.nn.moe import nonfinite_error
from poise.runtime.moves.layer_state import LayerState
from poise.runtime.selfcal.fit import EXPERTS, across_ranks


@dataclass(frozen=True)
class GatheredStep:
    """The gathered table, unpacked: `counts[L, D, E]` (tokens each rank routed to each expert),
    `computed[L, D]`, `rank_seconds[D, M]` (every rank's own), `measured[M]` (across ranks; over
    the vote group too) and `rank_experts[D]` (every rank's expert seconds; likewise)."""

    counts: np.ndarray
    computed: np.ndarray
    rank_seconds: np.ndarray
    measured: np.ndarray
    rank_experts: np.ndarray


def gather_step(
    layers: Sequence[LayerState],
    num_experts: int,
    seconds: Sequence[float],
    group: dist.ProcessGroup | None,
    world_size: int,
    step: int,
    vote_group: dist.ProcessGroup | None = None,
) -> GatheredStep:
    """Gather the step (module docstring; collective over `group`, and over `vote_group` where
    given). `seconds`: this rank's figures in `MEASURED` order; `step`: the step's number, for
    the error a non-finite flag raises. Resets each layer's step counts and rows, and takes its
    non-finite flag (`MoE.take_nonfinite`)."""
    L, E, D = len(layers), num_experts, world_size
    device = layers[0].params[0].device
    zeros = torch.zeros(E, dtype=torch.long, device=device)  # a layer that saw no forward
    counts = torch.stack([s.counts.to(device) if s.counts.numel() else zeros for s in layers])
    rows = torch.tensor([s.rows for s in layers], dtype=torch.long, device=device)
    for s in layers:
        s.counts = torch.zeros(0, dtype=torch.long)
        s.rows = 0
    flag = torch.stack([s.layer.take_nonfinite().to(device) for s in layers]).any()
    ns = torch.tensor([round(x * 1e9) for x in seconds], dtype=torch.long, device=device)
    local = torch.cat([counts.long().reshape(-1), flag.long().reshape(1), rows, ns])
    if D > 1:
        local = local.to(comm_device(group, local.device))
        parts = [torch.empty_like(local) for _ in range(D)]
        comm.all_gather(parts, local, group=group)
        table = torch.stack(parts).cpu().numpy()  # [D, n]
    else:
        table = local.cpu().numpy()[None, :]
    bad = np.flatnonzero(table[:, L * E])
    if bad.size:
        raise nonfinite_error(bad.tolist(), step)
    gathered = table[:, : L * E].reshape(D, L, E).transpose(1, 0, 2)  # [L, D, E]
    computed = table[:, L * E + 1 : L * E + 1 + L].T.astype(np.float64)  # [L, D]
    per_rank = table[:, L * E + 1 + L :].astype(np.float64) / 1e9  # [D, MEASURED]
    measured = across_ranks(per_rank)
    rank_experts = per_rank[:, EXPERTS]
    if vote_group is not None and D > 1:
        both = max_over_group(np.concatenate([measured, rank_experts]), vote_group)
        measured, rank_experts = both[: len(measured)], both[len(measured) :]
    return GatheredStep(np.ascontiguousarray(gathered), computed, per_rank, measured, rank_experts)


def max_over_group(seconds: np.ndarray, group: dist.ProcessGroup) -> np.ndarray:
    """`seconds[n]` at their element-wise maximum over `group` (collective; exchanged as ns)."""
    ns = torch.as_tensor(np.round(seconds * 1e9).astype(np.int64))
    ns = ns.to(comm_device(group, "cpu"))
    comm.all_reduce(ns, op=dist.ReduceOp.MAX, group=group)
    return ns.cpu().numpy().astype(np.float64) / 1e9
