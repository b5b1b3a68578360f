"""Exact incremental pricing of layers under any per-expert routing: `ExpertColumns`.

The companion of `poise.cost.incremental` (whose docstring gives the idea: a layer kept as
per-device sums over experts, a change priced as the difference of the changed experts' terms)
for searches that re-route whole experts: any assignment that routes each expert on its own
(e.g. `Assignment.balanced`), home moves with their migrations, several layers in lockstep
(FlexMoE's vExpert search, `poise.plan.policies.vexpert`). Its prices equal `CostModel.price`
on the changed layers up to float rounding (`tests/test_cost_incremental.py`).

Latency is charged per message (`poise.cost.network`), and a device's messages are not a sum
over experts (two experts sent to one device are one message): a candidate's message counts come
from the layer's per-pair multiplicities plus the changed experts' (`cost.message_pairs`, on
clusters of up to `messages.DIRECT_RUN` devices), or are recounted on its whole layer as the
cost model counts them (`Routing.messages`, `replica_messages`, `migration_messages`:
`ExpertColumns.layer_messages`); either way they are the model's exactly. The bytes and the
compute stay differences of per-expert terms.
"""

from __future__ import annotations

import numpy as np

from poise.core.placement import Assignment, Placement
from poise.cost.message_pairs import MessagePairs, applies
from poise.cost.messages import level_counts, pair_counts
from poise.cost.model import CostModel, expert_call_floor, expert_seconds
from poise.cost.network import bandwidth_s, latency_s
from poise.cost.phases import PhaseTimes
from poise.cost.traffic import (
    Routing,
    migration_messages,
    migration_traffic,
    replica_traffic,
    sends,
)

# Rows of the packed per-expert terms `[..., TERMS, D]` of `ExpertColumns`.
ROW_R = 0  # tokens computed per device
ROW_COMP = 1  # forward expert seconds per device
ROW_SEND = slice(2, 11)  # bytes / tokens sent: dispatch tokens, Trans, migration x 3 levels
ROW_RECV = slice(11, 20)  # the same, received
TERMS = 20
# Rows of a layer's totals `[..., TOTALS, D]`: the terms summed over experts, then the messages.
ROW_MSG_OUT = slice(20, 29)  # peers sent to: dispatch, Trans, migration x 3 levels
ROW_MSG_IN = slice(29, 38)  # peers received from, the same
MESSAGES = 18
TOTALS = TERMS + MESSAGES
_MESSAGE_CELLS = 2**22  # layer x device x expert cells of candidates recounted at once


class ExpertColumns:
    """Layers kept as per-device totals, for searches that change one or two experts of a layer
    at a time under any assignment that routes each expert independently (no group-local
    routing). Several layers are searched in lockstep: every array has a leading layer axis.

    Expert e's *terms* in layer l `[TERMS, D]` are its share of every per-device sum the cost
    model takes over experts: computed tokens R, forward expert seconds, dispatch tokens, Trans
    bytes and migration bytes sent and received per link level (rows `ROW_*`). A layer's
    `totals[l]` `[TOTALS, D]` are their sum over experts (computed once with the cost model's own
    vectorised functions) and then its messages (rows `ROW_MSG_OUT`, `ROW_MSG_IN`: the peers
    each device sends to and receives from per kind and level); a candidate's totals are its
    layer's totals plus (new terms - current terms) of the experts it changes, the current terms
    re-derived from the columns in force, with its messages recounted on the changed layer
    (`candidate_messages`). `price` turns a batch of totals into layer seconds exactly as
    `CostModel.price` does (the schedule, Trans/Agg, the migrations from `prev_home`, a latency
    per message).

    `counts[L, D, E]` loads, `home[L, E]`, `copies[L, D, E]`, `weights[L, E, D]` (the
    assignment's shares of remote tokens; kept, not copied: `apply` updates them in place),
    `prev_home[L, E]` the homes in force (None: nothing migrates); if the caller has them (None:
    computed here), `received[L, D, E]` the computed tokens `Assignment(weights).received` and
    `counts_t[L, E, D]` the loads transposed, contiguous (kept). Memory: O(L * E * D)."""

    def __init__(
        self,
        cost: CostModel,
        counts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
        prev_home: np.ndarray | None,
        received: np.ndarray | None = None,
        counts_t: np.ndarray | None = None,
    ) -> None:
        self.cost = cost
        cluster, spec = cost.cluster, cost.spec
        L, D, _ = counts.shape
        if counts_t is None:
            counts_t = np.ascontiguousarray(counts.transpose(0, 2, 1))
        self.counts_t = counts_t  # [L, E, D]
        # int64 homes and copies: the dtypes `MessagePairs`' compiled kernels take
        self.home = home.astype(np.int64)  # (a copy)
        self.copies_t = np.ascontiguousarray(copies.transpose(0, 2, 1), dtype=np.int64)  # [L, E, D]
        self.weights = weights
        self.prev_home = prev_home
        self.dpn, self.dpd = cluster.devices_per_node, cluster.devices_per_domain
        self.node_of, self.domain_of = cluster.node_of(), cluster.domain_of()
        self.devices = np.arange(D)
        self.levels = np.arange(3)[:, None]  # [3, 1]
        self.fnec, self.bnec = cost.non_moe_s
        # Tokens are priced in bytes; Trans and migration rows already are.
        self.scale = np.array([spec.token_bytes, 1.0, 1.0])[:, None, None]  # [kinds, 1, 1]
        placement = Placement(home, copies, 0)
        assignment = Assignment(weights)
        R = assignment.received(placement, counts) if received is None else received  # [L, D, E]
        tok_send, tok_recv = Routing(cluster, placement, assignment).traffic(counts)
        par_send, par_recv = replica_traffic(cluster, placement, spec.expert_bytes)
        mig_send = np.zeros((3, L, D))
        mig_recv = np.zeros((3, L, D))
        if prev_home is not None:
            layer, expert = np.nonzero(prev_home != home)
            rows = np.stack([layer, expert, prev_home[layer, expert], home[layer, expert]], 1)
            mig_send, mig_recv = migration_traffic(cluster, rows, L, spec.migration_bytes)
        totals = np.empty((L, TOTALS, D))
        totals[:, ROW_R] = R.sum(axis=2)
        totals[:, ROW_COMP] = self.comp_s(R).sum(axis=2)
        totals[:, ROW_SEND] = np.concatenate([tok_send, par_send, mig_send]).transpose(1, 0, 2)
        totals[:, ROW_RECV] = np.concatenate([tok_recv, par_recv, mig_recv]).transpose(1, 0, 2)
        self.go = sends(counts, spec.token_bytes)  # [L, D, E] cells worth a message
        held_t, takes_t = self.copies_t > 0, weights > 0
        self.pairs: MessagePairs | None = None
        if applies(cluster):
            self.pairs = MessagePairs(cluster, self.go, home, held_t, takes_t, prev_home)
            totals[:, TERMS:] = self.pairs.rows_now
        else:
            totals[:, TERMS:] = self.layer_messages(np.arange(L), home, held_t, takes_t)
        self.totals = totals

    def comp_s(self, rows: np.ndarray) -> np.ndarray:
        """Forward seconds of one expert GEMM over `rows` tokens (elementwise)."""
        return expert_seconds(self.cost.cluster, self.cost.spec, rows)

    def column_terms(
        self,
        layers: np.ndarray,
        experts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        """Terms `[K, TERMS, D]` of experts `experts[K]` of layers `layers[K]` with homes
        `home[K]`, copies `copies[K, D]` and assignment shares `weights[K, D]`."""
        spec = self.cost.spec
        K, D = copies.shape
        c = self.counts_t[layers, experts]  # [K, D]
        held = copies > 0
        remote = np.where(held, 0.0, c)
        r_all = remote.sum(axis=1, keepdims=True)  # [K, 1]
        out = np.zeros((K, TERMS, D))
        R = out[:, ROW_R]
        np.add(np.where(held, c, 0.0), weights * r_all, out=R)
        out[:, ROW_COMP] = self.comp_s(R)
        # Dispatch: a source's remote tokens split by the share of e's copies in its node/domain;
        # a holder receives its share of the remote tokens of each level's sources.
        # inside[0 | 1, K, level, D]: the shares (0) and the remote tokens (1) summed over each
        # device's node, domain and the cluster, then turned into what each level adds.
        pair = np.empty((2, K, D))
        pair[0] = weights
        pair[1] = remote
        inside = np.empty((2, K, 3, D))
        inside[:, :, 0] = pair.reshape(2, K, -1, self.dpn).sum(axis=3)[..., self.node_of]
        inside[:, :, 1] = pair.reshape(2, K, -1, self.dpd).sum(axis=3)[..., self.domain_of]
        inside[0, :, 2] = 1.0
        inside[1, :, 2] = r_all
        inside[:, :, 2] -= inside[:, :, 1]  # cluster - domain
        inside[:, :, 1] -= inside[:, :, 0]  # domain - node
        np.multiply(remote[:, None], inside[0], out=out[:, 2:5])
        np.multiply(weights[:, None], inside[1], out=out[:, 11:14])
        # Trans, a broadcast from the home (`traffic.replica_traffic`): the copy enters each other
        # domain at its first replica (level 2), each other node at its first (level 1), the
        # rest of a node over level 0; the home sends it once, over the farthest level.
        level = (self.node_of != self.node_of[home][:, None]).view(np.int8) + (
            self.domain_of != self.domain_of[home][:, None]
        ).view(np.int8)  # [K, D]
        rep = held & (self.devices != home[:, None])
        hop = np.zeros((K, D), dtype=np.int64)
        with_rep = np.flatnonzero(rep.any(axis=1))
        if with_rep.size:
            r, lv = rep[with_rep], level[with_rep]
            n = len(with_rep)
            first_node = r & (np.cumsum(r.reshape(n, -1, self.dpn), axis=2) == 1).reshape(n, D)
            first_dom = r & (np.cumsum(r.reshape(n, -1, self.dpd), axis=2) == 1).reshape(n, D)
            hop[with_rep] = np.where(
                lv == 2,
                np.where(first_dom, 2, np.where(first_node, 1, 0)),
                np.where((lv == 1) & first_node, 1, 0),
            )
        at = (hop[:, None, :] == self.levels) & rep[:, None, :]  # [K, 3, D]
        w_e = spec.expert_bytes
        np.multiply(at, w_e, out=out[:, 14:17])
        if with_rep.size:
            farthest = np.where(rep[with_rep], level[with_rep], -1).max(axis=1)
            out[with_rep, 5 + farthest, home[with_rep]] = w_e
        # Migration: M_e from the home in force to the new home.
        if self.prev_home is not None:
            old = self.prev_home[layers, experts]
            k = np.flatnonzero(old != home)
            if k.size:
                lv_m = self.cost.cluster.level_between(old[k], home[k])
                out[k, 8 + lv_m, old[k]] = spec.migration_bytes
                out[k, 17 + lv_m, home[k]] = spec.migration_bytes
        return out

    def layer_messages(
        self, layers: np.ndarray, home: np.ndarray, held_t: np.ndarray, takes_t: np.ndarray
    ) -> np.ndarray:
        """Message rows `[N, MESSAGES, D]` of whole layers: layer `layers[n]`'s loads under homes
        `home[N, E]`, holders `held_t[N, E, D]` (copies > 0) and takers `takes_t[N, E, D]`
        (shares > 0), with the migrations from `prev_home` (rows `ROW_MSG_OUT`, `ROW_MSG_IN` of
        the totals, less `TERMS`), counted as `CostModel.price` counts them: the dispatch as
        `Routing.messages` of an assignment without groups or shedding (s sends to d iff
        sends(c[s, e]), s holds no copy of e and w[d, e] > 0), Trans as `replica_messages`,
        migrations as `migration_messages`."""
        cluster = self.cost.cluster
        N, E, D = held_t.shape
        out = np.zeros((N, MESSAGES, D))
        step = max(1, _MESSAGE_CELLS // max(1, E * D))
        for lo in range(0, N, step):
            hi = min(N, lo + step)
            n = hi - lo
            held = held_t[lo:hi].transpose(0, 2, 1)  # [n, D, E]
            src = self.go[layers[lo:hi]] & ~held
            replica = held_t[lo:hi].copy()
            replica[np.arange(n)[:, None], np.arange(E)[None, :], home[lo:hi]] = False
            row, expert, device = np.nonzero(replica)
            parts = [
                level_counts(cluster, src, takes_t[lo:hi].transpose(0, 2, 1)),
                pair_counts(cluster, row, home[lo:hi][row, expert], device, n),
            ]
            if self.prev_home is not None:
                old = self.prev_home[layers[lo:hi]]
                row, expert = np.nonzero(old != home[lo:hi])
                moves = np.stack([row, expert, old[row, expert], home[lo:hi][row, expert]], 1)
                parts.append(migration_messages(cluster, moves, n))
            for kind, (m_out, m_in) in enumerate(parts):
                out[lo:hi, 3 * kind : 3 * kind + 3] = m_out.transpose(1, 0, 2)
                out[lo:hi, 9 + 3 * kind : 12 + 3 * kind] = m_in.transpose(1, 0, 2)
        return out

    def candidate_messages(
        self,
        layers: np.ndarray,
        experts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
        select: np.ndarray,
        valid: np.ndarray | None = None,
    ) -> np.ndarray:
        """Message rows `[B, M, MESSAGES, D]` of M candidates in each of B layers (`candidates`'
        arguments: `layers[B]`, the changed columns `experts[B, K]` with homes `home[B, K]`,
        copies `copies[B, K, D]` and shares `weights[B, K, D]`; candidate m takes column k where
        `select[m, k]`), from the pair multiplicities (`MessagePairs`) or each recounted on its
        whole layer (`layer_messages`); only where `valid[B, M]` (None: everywhere), zero
        elsewhere."""
        B, K = experts.shape
        M = select.shape[0]
        D = copies.shape[-1]
        if self.pairs is not None:
            in_force = (self.home, self.copies_t, self.weights)
            new = (home, copies, weights)
            return self.pairs.candidate_rows(layers, experts, new, in_force, select, valid)
        h = np.repeat(self.home[layers][:, None], M, axis=1)  # [B, M, E]
        held = np.repeat((self.copies_t[layers] > 0)[:, None], M, axis=1)  # [B, M, E, D]
        takes = np.repeat((self.weights[layers] > 0)[:, None], M, axis=1)
        rows = np.arange(B)
        for k in range(K):
            for m in np.flatnonzero(select[:, k]):
                h[rows, m, experts[:, k]] = home[:, k]
                held[rows, m, experts[:, k]] = copies[:, k] > 0
                takes[rows, m, experts[:, k]] = weights[:, k] > 0
        out = np.zeros((B, M, MESSAGES, D))
        b, m = np.nonzero(np.ones((B, M), dtype=bool) if valid is None else valid)
        if b.size:
            out[b, m] = self.layer_messages(layers[b], h[b, m], held[b, m], takes[b, m])
        return out

    def pair_change(
        self,
        layers: np.ndarray,
        experts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        """`[K, KINDS, D, D]` new minus current pair multiplicities (`MessagePairs.change`) of
        experts `experts[K]` of `layers[K]` taking homes `home[K]`, copies `copies[K, D]` and
        shares `weights[K, D]`."""
        assert self.pairs is not None
        now = (
            self.home[layers, experts],
            self.copies_t[layers, experts] > 0,
            self.weights[layers, experts] > 0,
        )
        return self.pairs.change(layers, experts, (home, copies > 0, weights > 0), now)

    def current_terms(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """Terms `[K, TERMS, D]` of the columns in force of experts `experts[K]` of `layers[K]`."""
        return self.column_terms(
            layers,
            experts,
            self.home[layers, experts],
            self.copies_t[layers, experts],
            self.weights[layers, experts],
        )

    def price(self, totals: np.ndarray) -> np.ndarray:
        """Layer seconds `[M]` for a batch of totals `[M, TOTALS, D]`, as `CostModel.price`."""
        return self.cost.schedule.layer_time(self.phase_times(totals))

    def phases(self) -> tuple[PhaseTimes, np.ndarray]:
        """The layers in force as `PlanPricer.phases` gives them: phase times `[L]` and the
        computed tokens per device `[L, D]` (equal up to float rounding: the totals were
        updated by differences)."""
        return self.phase_times(self.totals), self.totals[:, ROW_R].copy()

    def phase_times(self, totals: np.ndarray) -> PhaseTimes:
        """Phase times `[M]` of a batch of totals `[M, TOTALS, D]`."""
        M, _, D = totals.shape
        # (without `prev_home` the migration rows are zero, which price to 0 s)
        send = totals[:, ROW_SEND].reshape(M, 3, 3, D)  # [M, kind, level, D]
        recv = totals[:, ROW_RECV].reshape(M, 3, 3, D)
        out = totals[:, ROW_MSG_OUT].reshape(M, 3, 3, D)
        into = totals[:, ROW_MSG_IN].reshape(M, 3, 3, D)
        # (transpose, not np.moveaxis: the same view at a tenth of the call's cost)
        send = (send * self.scale).transpose(2, 0, 1, 3)  # [level, M, kind, D]
        recv = (recv * self.scale).transpose(2, 0, 1, 3)
        cluster = self.cost.cluster
        # `link_seconds`, its latency summed over the level axis where it lies (bit for bit)
        latency = latency_s(cluster, out, into, axis=2).max(axis=-1, initial=0.0)  # [M, kind]
        link_s = bandwidth_s(cluster, send, recv) + latency
        bulk = self.cost.cluster.host.transfer_scale  # Trans and migration, not tokens
        a2a, trans = link_s[:, 0], link_s[:, 1] * bulk
        mig = link_s[:, 2] * bulk
        # the forward expert seconds of the slowest device with the per-call floor: the floor is
        # monotone, so the floored maximum is the floor of the maximum (`expert_call_floor`)
        fec = expert_call_floor(self.cost.cluster, self.cost.spec, totals[:, ROW_COMP].max(axis=1))
        fnec, bnec = np.full(M, self.fnec), np.full(M, self.bnec)
        return PhaseTimes.from_parts(a2a, fec, fnec, trans, mig, bnec)

    def candidates(
        self,
        layers: np.ndarray,
        experts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
        terms: np.ndarray,
        select: np.ndarray,
    ) -> np.ndarray:
        """Totals `[B, M, TOTALS, D]` of M candidates in each of B layers: the K changed columns
        are grouped per layer, `layers[B]`, `experts[B, K]`, with homes `home[B, K]`, copies
        `copies[B, K, D]`, shares `weights[B, K, D]` and their terms `terms[B, K, TERMS, D]`;
        candidate m of layer b replaces the columns of `experts[b, k]` with these for every k
        with `select[m, k]` true (each expert at most once per candidate)."""
        B, K = experts.shape
        flat_layers = np.repeat(layers, K)
        current = self.current_terms(flat_layers, experts.reshape(-1)).reshape(terms.shape)
        delta = terms - current  # [B, K, TERMS, D]
        picked = np.matmul(select.astype(np.float64), delta.reshape(B, K, -1))  # [B, M, T * D]
        messages = self.candidate_messages(layers, experts, home, copies, weights, select)
        return self.totals_after(layers, picked.reshape(B, select.shape[0], TERMS, -1), messages)

    def totals_after(
        self, layers: np.ndarray, change: np.ndarray, messages: np.ndarray
    ) -> np.ndarray:
        """Totals `[B, M, TOTALS, D]` of M candidates in each of the B layers `layers[B]`, given
        each candidate's change of terms `change[B, M, TERMS, D]` (the sum over the columns it
        changes of new - current terms) and its messages `messages[B, M, MESSAGES, D]`
        (`candidate_messages`): `totals[layers] + change` and the messages, as `candidates`
        prices them, for callers that derive the current terms themselves."""
        B, M, _, D = change.shape
        out = np.empty((B, M, TOTALS, D))
        np.add(self.totals[layers][:, None, :TERMS], change, out=out[:, :, :TERMS])
        out[:, :, TERMS:] = messages
        return out

    def apply(
        self,
        layers: np.ndarray,
        experts: np.ndarray,
        home: np.ndarray,
        copies: np.ndarray,
        weights: np.ndarray,
        changed: np.ndarray,
        totals: np.ndarray,
        candidate: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Make candidates current: expert `experts[k]` of layer `layers[k]` takes `home[k]`,
        `copies[k]` and `weights[k]` (`[K, D]`); layer `changed[b]` takes `totals[b]`
        (`[TOTALS, D]`, messages included). `candidate` = (batch rows `j[b]`, moves `m[b]`) of
        the last `candidate_messages` call where layer `changed[b]` is its row `j[b]` and these
        columns are its candidate `m[b]`'s: the pair multiplicities are taken from it
        (`MessagePairs.adopt`), not recounted from the columns."""
        if self.pairs is not None:  # (before the columns in force change)
            if candidate is not None:
                self.pairs.adopt(*candidate)
            else:
                change = self.pair_change(layers, experts, home, copies, weights)
                self.pairs.apply(layers, change)
        self.home[layers, experts] = home
        self.copies_t[layers, experts] = copies
        self.weights[layers, experts] = weights
        self.totals[changed] = totals
