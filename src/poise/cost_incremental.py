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
- `ExpertColumns`: any per-expert routing (e.g. `Assignment.balanced`), home moves with their
  migrations; keeps each expert's terms, prices batches of candidates that change a few experts
  (FlexMoE's vExpert search).

Float residues: `CostModel.price` charges a link level's latency only where at least
`cost.MIN_TRAFFIC_BYTES` (one byte) cross it, so residues of ~1e-13 tokens (e.g. `1 - sum of
shares` on a one-domain cluster) are not traffic; `ExpertColumns` charges it where some expert
moves more than 1e-9 tokens or bytes. The two agree unless a level carries real traffic of less
than one byte, which integer token counts never produce.
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
        phases = PhaseTimes.from_parts(a2a, fec, fnec, trans, np.zeros_like(fec))
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


# Rows of the packed per-expert terms `[..., TERMS, D]` of `ExpertColumns`.
ROW_R = 0  # tokens computed per device
ROW_COMP = 1  # forward expert seconds per device
ROW_SEND = slice(2, 11)  # bytes / tokens sent: dispatch tokens, Trans, migration x 3 levels
ROW_RECV = slice(11, 20)  # the same, received
# 1 where the expert sends or receives anything there: summed, how many experts use each
# (kind, level, device) link, so that latency is charged exactly where `CostModel.price` sees
# traffic (a difference of floats could leave a residue of 1e-12 tokens where there is none).
ROW_ACTIVE = slice(20, 29)
TERMS = 29
_NOISE = 1e-9  # tokens or bytes below this are float residue, not traffic


class ExpertColumns:
    """One layer kept as per-expert columns, for searches that change one or two experts at a
    time under any assignment that routes each expert independently (no group-local routing).

    Expert e's *terms* `[TERMS, D]` are its share of every per-device sum the cost model takes
    over experts: computed tokens R, forward expert seconds, dispatch tokens, Trans bytes and
    migration bytes sent and received per link level (rows `ROW_*`). The layer's totals are their
    sum over experts; a candidate's totals are the totals plus (new terms - old terms) of the
    experts it changes, and `price` turns a batch of totals into layer seconds exactly as
    `CostModel.price` does (the schedule, Trans/Agg and the migrations from `prev_home`
    included).

    `counts[D, E]` loads, `home[E]`, `copies[D, E]`, `weights[E, D]` (the assignment's shares of
    remote tokens), `prev_home[E]` the homes in force (None: nothing migrates)."""

    def __init__(
        self,
        cost: CostModel,
        counts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
        prev_home: np.ndarray | None,
    ) -> None:
        self.cost = cost
        cluster, spec = cost.cluster, cost.spec
        D, E = counts.shape
        self.counts_t = np.ascontiguousarray(counts.T)  # [E, D]
        self.prev_home = prev_home
        self.dpn, self.dpd = cluster.devices_per_node, cluster.devices_per_domain
        self.node_of, self.domain_of = cluster.node_of(), cluster.domain_of()
        self.devices = np.arange(D)
        self.fnec = spec.tokens_per_device * spec.non_moe_flops_fwd / cluster.gemm_flops
        links = cluster.links()
        self.bw = np.array([k.per_device_bw_Bps for k in links])[:, None]  # [3, 1]
        self.lat = np.array([k.lat_s for k in links])[:, None]
        # Tokens are priced in bytes; Trans and migration rows already are.
        self.scale = np.array([spec.token_bytes, 1.0, 1.0])[:, None, None]  # [kinds, 1, 1]
        self.terms = self.column_terms(np.arange(E), home, copies.T, weights)  # [E, TERMS, D]
        self.totals = self.terms.sum(axis=0)  # [TERMS, D]

    def column_terms(
        self,
        experts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        """Terms `[K, TERMS, D]` of experts `experts[K]` with homes `home[K]`, copies
        `copies[K, D]` and assignment shares `weights[K, D]`."""
        spec, cluster = self.cost.spec, self.cost.cluster
        K, D = copies.shape
        c = self.counts_t[experts]  # [K, D]
        held = copies > 0
        remote = np.where(held, 0.0, c)
        r_all = remote.sum(axis=1, keepdims=True)  # [K, 1]
        out = np.zeros((K, TERMS, D))
        R = np.where(held, c, 0.0) + weights * r_all
        out[:, ROW_R] = R
        rate = cluster.gemm_rate(np.maximum(R, 1.0))
        out[:, ROW_COMP] = R * spec.flops_per_token_fwd / rate
        # Dispatch: a source's remote tokens split by the share of e's copies in its node/domain;
        # a holder receives its share of the remote tokens of each level's sources.
        w_node = weights.reshape(K, -1, self.dpn).sum(axis=2)[:, self.node_of]
        w_dom = weights.reshape(K, -1, self.dpd).sum(axis=2)[:, self.domain_of]
        r_node = remote.reshape(K, -1, self.dpn).sum(axis=2)[:, self.node_of]
        r_dom = remote.reshape(K, -1, self.dpd).sum(axis=2)[:, self.domain_of]
        out[:, 2] = remote * w_node
        out[:, 3] = remote * (w_dom - w_node)
        out[:, 4] = remote * (1.0 - w_dom)
        out[:, 11] = weights * r_node
        out[:, 12] = weights * (r_dom - r_node)
        out[:, 13] = weights * (r_all - r_dom)
        # Trans: each replica receives W_e from the home, over the level between them.
        lv = cluster.level_between(home[:, None], self.devices[None, :])  # [K, D], -1 at home
        rep = held & (lv >= 0)
        at = rep[:, None, :] & (lv[:, None, :] == np.arange(3)[None, :, None])  # [K, 3, D]
        w_e = spec.expert_bytes
        out[:, 14:17] = at * w_e
        out[np.arange(K), 5:8, home] = at.sum(axis=2) * w_e
        # Migration: M_e from the home in force to the new home.
        if self.prev_home is not None:
            old = self.prev_home[experts]
            k = np.flatnonzero(old != home)
            if k.size:
                lv_m = cluster.level_between(old[k], home[k])
                out[k, 8 + lv_m, old[k]] = spec.migration_bytes
                out[k, 17 + lv_m, home[k]] = spec.migration_bytes
        # Shares that are differences of sums (1 - w_dom, w_dom - w_node) leave rounding residues
        # of ~1e-16 of a token where nothing moves: they are not traffic.
        out[:, ROW_ACTIVE] = (out[:, ROW_SEND] > _NOISE) | (out[:, ROW_RECV] > _NOISE)
        return out

    def price(self, totals: np.ndarray) -> np.ndarray:
        """Layer seconds `[M]` for a batch of totals `[M, TERMS, D]`, as `CostModel.price`."""
        M, _, D = totals.shape
        send = totals[:, ROW_SEND].reshape(M, 3, 3, D)  # [M, kind, level, D]
        recv = totals[:, ROW_RECV].reshape(M, 3, 3, D)
        active = totals[:, ROW_ACTIVE].reshape(M, 3, 3, D) > 0.5
        moved = np.maximum(np.maximum(send, recv), 0.0) * self.scale
        per_level = moved / self.bw + np.where(active, self.lat, 0.0)
        link_s = per_level.sum(axis=2).max(axis=2)  # [M, kind]
        a2a, trans, mig = link_s[:, 0], link_s[:, 1], link_s[:, 2]
        fec = totals[:, ROW_COMP].max(axis=1)
        fnec = np.full(M, self.fnec)
        phases = PhaseTimes.from_parts(a2a, fec, fnec, trans, mig)
        return self.cost.schedule.layer_time(phases)

    def candidates(self, experts: np.ndarray, terms: np.ndarray, select: np.ndarray) -> np.ndarray:
        """Totals `[M, TERMS, D]` of M candidates: candidate m replaces the terms of the experts
        `experts[k]` with `terms[k]` (`[K, TERMS, D]`) for every k with `select[m, k]` true
        (each expert at most once per candidate)."""
        delta = terms - self.terms[experts]  # [K, TERMS, D]
        M, K = select.shape
        picked = select.astype(np.float64) @ delta.reshape(K, -1)
        return self.totals[None] + picked.reshape(M, TERMS, -1)

    def apply(self, experts: np.ndarray, terms: np.ndarray, totals: np.ndarray) -> None:
        """Make a candidate current: experts `experts[k]` take `terms[k]`, the layer `totals`."""
        self.terms[experts] = terms
        self.totals = totals
