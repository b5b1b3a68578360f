"""Message counts of a search's candidates from per-pair multiplicities: `MessagePairs`.

A device's messages are not a sum over experts (two experts sent to one peer are one message,
`poise.cost.messages`), so a search that changes one or two experts of a layer cannot price a
candidate's latency by differences of per-expert terms. It can keep, per layer, how many
experts link each pair of devices, per kind of traffic:

    n[l, 0, i, j] = #{e : i sends tokens of e (sends(c[i, e]), i holds no copy) and w[j, e] > 0}
    n[l, 1, i, j] = #{e : i is e's home and j holds a replica of e}          (Trans)
    n[l, 2, i, j] = #{e : e's home moves from i (the home in force) to j}    (migration)

Each is a sum over experts, so a candidate's multiplicities are the layer's plus (new - current)
outer products of the experts it changes, and its messages are the pairs with n > 0, split by
level: out[kind, v, i] = #{j at level v from i : n[kind, i, j] > 0}, into likewise over i.
That is exactly `ExpertColumns.layer_messages` (the counts `CostModel.price` uses). A candidate's
rows are counted from the layer's rows in force (`rows_now`) and the cells its changed experts
touch, where a pair's message appears or goes (`pair_kernels`, compiled loops): about K D cells
for K changed experts, against O(E D^2) for a recount of the layer.

The `[L, 3, D, D]` multiplicities are kept only on clusters of up to `messages.DIRECT_RUN`
devices (`applies`); larger clusters recount (`ExpertColumns.layer_messages`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.cost.messages import DIRECT_RUN, level_index, linked_levels
from poise.cost.pair_kernels import adopt, candidate_rows

KINDS = 3  # dispatch, Trans, migration: the kinds of `ExpertColumns`' message rows


def applies(cluster: Cluster) -> bool:
    """Whether `MessagePairs` is used on `cluster` (at most `DIRECT_RUN` devices)."""
    return cluster.num_devices <= DIRECT_RUN


class MessagePairs:
    """The pair multiplicities `n[L, KINDS, D, D]` (module docstring) of L layers in force.

    `go[L, D, E]`: the load cells worth a message (`traffic.sends`); `home[L, E]`,
    `held_t[L, E, D]` (copies > 0), `takes_t[L, E, D]` (assignment shares > 0) the columns in
    force; `prev_home[L, E]` the homes before the plan (None: nothing migrates, kept as -1)."""

    def __init__(
        self,
        cluster: Cluster,
        go: np.ndarray,
        home: np.ndarray,
        held_t: np.ndarray,
        takes_t: np.ndarray,
        prev_home: np.ndarray | None,
    ) -> None:
        self.go_t = np.ascontiguousarray(go.transpose(0, 2, 1))  # [L, E, D]
        L, E, D = held_t.shape
        # -1: no previous home, nothing migrates (the kernels and `change` skip it)
        self.prev_home = (
            np.full((L, E), -1, dtype=np.int64) if prev_home is None else prev_home.astype(np.int64)
        )
        self.cluster = cluster
        # The last `candidate_rows` call's arguments, for `adopt`.
        self.candidates: tuple[Any, ...] = ()
        src = (self.go_t & ~held_t).astype(np.float32)  # [L, E, D]
        # float32 counts: sums of at most E ones, exact up to 2^24 experts
        n = np.zeros((L, KINDS, D, D), dtype=np.float32)
        n[:, 0] = np.matmul(src.transpose(0, 2, 1), takes_t.astype(np.float32))
        replica_t = held_t.copy()  # [L, E, D] held, not at the home
        replica_t[np.arange(L)[:, None], np.arange(E)[None, :], home] = False
        # (a 3-D np.nonzero takes five times as long as the flat indices unravelled)
        layer, expert, device = np.unravel_index(np.flatnonzero(replica_t), replica_t.shape)
        np.add.at(n, (layer, 1, home[layer, expert], device), 1)
        layer, expert = np.nonzero((self.prev_home >= 0) & (self.prev_home != home))
        np.add.at(n, (layer, 2, self.prev_home[layer, expert], home[layer, expert]), 1)
        self.n = n  # [L, KINDS, D, D]
        self.level = level_index(cluster)  # [D, D] link level of each pair, -1 on the diagonal
        self.rows_now = np.ascontiguousarray(self.rows(n))  # [L, 18, D] the messages in force

    def change(
        self,
        layers: np.ndarray,
        experts: np.ndarray,
        new: tuple[np.ndarray, np.ndarray, np.ndarray],
        now: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> np.ndarray:
        """`[K, KINDS, D, D]` new minus current multiplicities of expert columns `experts[K]` of
        `layers[K]`, each side given as `(home[K], held[K, D], takes[K, D])`: the dispatch's outer
        products src x takes, +-1 per (home, replica) pair and per (old home, new home) move."""
        K, D = new[1].shape
        out = np.empty((K, KINDS, D, D), dtype=np.float32)
        out[:, 1:] = 0.0  # (the dispatch's kind 0 is written whole below)
        go = self.go_t[layers, experts]  # [K, D]
        # The dispatch's two outer products in one matmul: [src_new, -src_now] x [takes_new;
        # takes_now] (0/+-1 entries: the float32 sums are exact).
        src = np.empty((K, D, 2), dtype=np.float32)
        np.greater(go, new[1], out=src[:, :, 0])  # go & ~held (both bool)
        np.greater(go, now[1], out=src[:, :, 1])
        src[:, :, 1] *= -1.0
        takes = np.empty((K, 2, D), dtype=np.float32)
        takes[:, 0] = new[2]
        takes[:, 1] = now[2]
        np.matmul(src, takes, out=out[:, 0])
        # Trans: row `home[k]` of column k gains its replicas (the holders but the home).
        k = np.arange(K)
        old = self.prev_home[layers, experts]
        for sign, (home, held, _) in ((1.0, new), (-1.0, now)):
            replicas = held.astype(np.float32)
            replicas[k, home] = 0.0
            out[k, 1, home] += sign * replicas  # one row per k: no repeated cell
            moved = np.flatnonzero((old >= 0) & (old != home))
            out[moved, 2, old[moved], home[moved]] += sign
        return out

    def rows(self, n: np.ndarray) -> np.ndarray:
        """Message rows `[..., 2 * KINDS * 3, D]` of multiplicities `n[..., KINDS, D, D]`: peers
        sent to per kind and level, then peers received from (`ExpertColumns`' message rows):
        the pairs with n > 0, by `messages.linked_levels`."""
        lead, D = n.shape[:-3], n.shape[-1]
        out = np.zeros((*lead, 2, KINDS, 3, D))
        nd = out.ndim  # [2, ..., KINDS, 3, D] (a transpose: np.moveaxis costs ten times more)
        view = out.transpose(nd - 4, *range(nd - 4), nd - 3, nd - 2, nd - 1)
        linked_levels(self.cluster, n > 0, out=view)
        return out.reshape(*lead, 2 * KINDS * 3, D)

    def candidate_rows(
        self,
        layers: np.ndarray,
        experts: np.ndarray,
        new: tuple[np.ndarray, np.ndarray, np.ndarray],
        in_force: tuple[np.ndarray, np.ndarray, np.ndarray],
        select: np.ndarray,
        valid: np.ndarray | None,
    ) -> np.ndarray:
        """Message rows `[B, M, 2 * KINDS * 3, D]` of M candidates in each of B layers
        `layers[B]`: candidate m gives the columns `experts[B, K]` with `select[m, k]` the new
        `(home[B, K], copies[B, K, D], shares[B, K, D])` in place of the columns in force
        `in_force = (home[L, E], copies_t[L, E, D], shares[L, E, D])`; zero where not
        `valid[B, M]`. Only the cells a candidate changes are visited (`pair_kernels`)."""
        B = experts.shape[0]
        M = select.shape[0]
        D = self.n.shape[-1]
        if valid is None:
            valid = np.ones((B, M), dtype=bool)
        # (the kernels' dtypes: no copies where the arrays have them)
        layers, experts = np.asarray(layers, np.int64), np.asarray(experts, np.int64)
        new = (np.asarray(new[0], np.int64), np.asarray(new[1], np.int64), new[2])
        in_force = (np.asarray(in_force[0], np.int64), np.asarray(in_force[1], np.int64),
                    in_force[2])  # fmt: skip
        self.candidates = (layers, experts, new, in_force, select)  # for `adopt`
        out = np.empty((B, M, 2 * KINDS * 3, D))
        candidate_rows(
            self.n, self.level, self.rows_now, layers, experts, *new, *in_force, self.go_t,
            self.prev_home, select, valid, out,
        )  # fmt: skip
        return out

    def adopt(self, rows: np.ndarray, moves: np.ndarray) -> None:
        """Layer `layers[rows[k]]` of the last `candidate_rows` call takes the multiplicities
        and message rows of its candidate `moves[k]`; before the columns in force change."""
        layers, experts, new, in_force, select = self.candidates
        adopt(
            self.n, self.level, self.rows_now, layers, experts, *new, *in_force, self.go_t,
            self.prev_home, select, np.asarray(rows, np.int64), np.asarray(moves, np.int64),
        )  # fmt: skip

    def apply(self, layers: np.ndarray, change: np.ndarray) -> None:
        """Add the column changes `change[K, KINDS, D, D]` to the layers `layers[K]` (a layer may
        repeat: the changes are summed per layer by a 0/1 matmul, exact on these whole counts)."""
        unique, which = np.unique(layers, return_inverse=True)
        K = len(layers)
        member = np.zeros((unique.size, K), dtype=np.float32)
        member[which, np.arange(K)] = 1.0
        summed = member @ change.reshape(K, -1)  # [U, KINDS * D * D]
        self.n[unique] += summed.reshape(unique.size, *change.shape[1:])
        self.rows_now[unique] = self.rows(self.n[unique])


__all__ = ["KINDS", "MessagePairs", "applies"]
