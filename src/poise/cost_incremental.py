"""Exact incremental pricing of one layer when one expert's copies change.

`CostModel.price` prices whole plans (`[L, D, E]` at once). A planner that searches move by move
needs the price of *one layer* after a small change: one expert gains or loses copies, its
tokens are re-routed. Every term of the cost model (`cost.py`) is a sum over experts of
per-device, per-link-level quantities followed by a max over devices, so a layer can be kept as
per-device sums and a change applied as the difference of the changed expert's terms. The
pricers here keep those sums and evaluate batches of candidate changes; their results equal
`CostModel.price` on the changed layer (up to float rounding, tested in
`tests/test_cost_incremental.py`).

- `LayerState`: replicas that serve only their own device's tokens (`Assignment.to_home`,
  Pro-Prophet, HybridEP); the caller builds the per-candidate deltas.
"""

from __future__ import annotations

import numpy as np

from poise.cost import CostModel, PhaseTimes, level_traffic, replica_traffic
from poise.placement import Assignment, Placement


class LayerState:
    """One layer's per-device quantities, enough to price a lightweight placement change.

    `comp[D]` forward expert seconds, `tok_send/tok_recv[3, D]` dispatch tokens per link level,
    `par_send/par_recv[3, D]` Trans bytes per level, `R[D, E]` computed tokens."""

    def __init__(self, cost: CostModel, placement: Placement, counts: np.ndarray) -> None:
        self.cost = cost
        cluster, spec = cost.cluster, cost.spec
        assignment = Assignment.to_home(placement)
        self.R = assignment.received(placement, counts[None])[0]
        self.comp = self.comp_s(self.R).sum(axis=1)
        send, recv = level_traffic(cluster, placement, assignment, counts[None])
        self.tok_send, self.tok_recv = send[:, 0], recv[:, 0]
        p_send, p_recv = replica_traffic(cluster, placement, spec.expert_bytes)
        self.par_send, self.par_recv = p_send[:, 0], p_recv[:, 0]
        self.fnec = spec.tokens_per_device * spec.non_moe_flops_fwd / cluster.gemm_flops
        links = cluster.links()
        self.inv_bw = np.array([1.0 / k.per_device_bw_Bps for k in links])[:, None]
        self.lat = np.array([k.lat_s for k in links])[:, None]

    def comp_s(self, rows: np.ndarray) -> np.ndarray:
        """Forward seconds of one expert GEMM over `rows` tokens (elementwise), as in
        `CostModel.expert_compute_s`."""
        spec, cluster = self.cost.spec, self.cost.cluster
        return rows * spec.flops_per_token_fwd / cluster.gemm_rate(np.maximum(rows, 1.0))

    def links_s(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """`[..., 3, D]` bytes -> `[...]` seconds, slowest device (`cost.link_time`)."""
        moved = np.maximum(send, recv)
        per_level = moved * self.inv_bw + np.where(moved > 0, self.lat, 0.0)
        return per_level.sum(axis=-2).max(axis=-1)

    def layer_s(
        self,
        comp: np.ndarray,
        tok_send: np.ndarray,
        tok_recv: np.ndarray,
        par_send: np.ndarray,
        par_recv: np.ndarray,
    ) -> np.ndarray:
        """Layer seconds under the cost model's schedule for a batch of states
        (`comp[M, D]`, the rest `[M, 3, D]`)."""
        tb = self.cost.spec.token_bytes
        a2a = self.links_s(tok_send * tb, tok_recv * tb)
        trans = self.links_s(par_send, par_recv)
        fec = comp.max(axis=-1)
        fnec = np.full_like(fec, self.fnec)
        phases = PhaseTimes(
            dispatch_s=a2a,
            combine_s=a2a,
            expert_fwd_s=fec,
            expert_bwd_s=2.0 * fec,
            non_moe_fwd_s=fnec,
            non_moe_bwd_s=2.0 * fnec,
            trans_s=trans,
            agg_s=trans,
            migrate_s=np.zeros_like(fec),
        )
        return self.cost.schedule.layer_time(phases)

    def current_s(self) -> float:
        return float(
            self.layer_s(
                self.comp[None],
                self.tok_send[None],
                self.tok_recv[None],
                self.par_send[None],
                self.par_recv[None],
            )[0]
        )
