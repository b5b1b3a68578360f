"""Exact incremental pricing of one layer when one expert's copies change.

`CostModel.price` prices whole plans (`[L, D, E]` at once). A planner that searches move by move
needs the price of *one layer* after a small change: one expert gains or loses copies, its
tokens are re-routed. Every term of the cost model (`cost/model.py`) is a sum over experts of
per-device, per-link-level quantities followed by a max over devices, so a layer can be kept as
per-device sums and a change applied as the difference of the changed expert's terms. The
pricers keep those sums and evaluate batches of candidate changes; their results equal
`CostModel.price` on the changed layer (up to float rounding, tested in
`tests/test_cost_incremental.py`).

- `LayerState` (here): replicas that serve only their own device's tokens (`Assignment.to_home`,
  Pro-Prophet, HybridEP); the caller builds the per-candidate deltas. `prefix_cuts` and
  `prefix_states` price every prefix of a ranked list of such changes.
- `ExpertColumns` (`poise.cost.expert_columns`): any per-expert routing (e.g.
  `Assignment.balanced`), home moves with their migrations (FlexMoE's vExpert search).

Latency is charged per message (`poise.cost.network`): the states keep, per device and level,
the peers it sends to and receives from (`poise.cost.messages`), which are not sums over experts
(two experts sent to one device are one message). Callers that change a state derive the
changed counts from the pairs the change adds and removes (`hybrid`, `prophet`: a pair's
multiplicity, the experts it carries, going to or from zero); `home_pairs` gives those
multiplicities for homes-only states.

Float residues: both pricers and `CostModel.price` charge a link only where at least
`cost.MIN_TRAFFIC_BYTES` (one byte) cross it, and count a message only for a source's expert
with at least a byte of tokens (`traffic.sends`), so residues of ~1e-13 tokens left by
differences of sums (e.g. `1 - sum of shares` on a one-domain cluster, or totals updated by
deltas) are not traffic.
"""

from __future__ import annotations

import functools

import numpy as np

from poise.core.cluster import Cluster
from poise.core.placement import Assignment, Placement
from poise.cost.messages import DIRECT_RUN, linked_levels
from poise.cost.model import CostModel, expert_call_floor, expert_seconds
from poise.cost.network import device_seconds, group_seconds, link_bytes, link_split
from poise.cost.phases import PhaseTimes
from poise.cost.traffic import (
    Routing,
    homes_messages,
    homes_traffic,
    replica_cells,
    replica_messages,
    replica_traffic,
    sends,
)

PREFIX_EXACT = 16  # prefix lengths always evaluated one by one
PREFIX_POINTS = 64  # at most this many prefix lengths evaluated (plus 0 and K)
_PAIR_CELLS = 2**22  # one-hot cells (layers x experts x devices) per matmul in `home_pairs`


def prefix_cuts(steps: int) -> np.ndarray:
    """Prefix lengths `[G]` (ascending, from 0 to `steps`) at which a greedy that adds `steps`
    changes one by one is priced: all of them when there are few, else 0..PREFIX_EXACT and a
    geometric grid up to `steps`, so pricing stays O(PREFIX_POINTS * D) on 8,192 devices."""
    if steps + 1 <= PREFIX_EXACT + PREFIX_POINTS:
        return np.arange(steps + 1)
    grid = np.geomspace(PREFIX_EXACT, steps, PREFIX_POINTS).round().astype(np.int64)
    return np.unique(np.concatenate([np.arange(PREFIX_EXACT + 1), grid, [steps]]))


def prefix_states(
    base: np.ndarray,
    step: np.ndarray,
    index: tuple[np.ndarray, ...],
    value: np.ndarray,
    cuts: np.ndarray,
) -> np.ndarray:
    """States after the first `cuts[g]` changes: `[G, *base.shape]`.

    Change entries are sparse: entry i belongs to change `step[i]` and adds `value[i]` at
    `base[index][i]`; state g = base + the sum of the entries with step < cuts[g]. Entries are
    summed per segment between cuts and the segments accumulated, O(entries + G * base.size)."""
    G = len(cuts)
    seg = np.searchsorted(cuts, step, side="right")  # first g that counts the entry
    flat = np.ravel_multi_index(index, base.shape)
    size = base.size
    keep = seg < G
    sums = np.bincount(
        seg[keep] * size + flat[keep], weights=value[keep], minlength=G * size
    ).reshape(G, *base.shape)
    return base[None] + _cumsum_first_axis(sums)


def _cumsum_first_axis(x: np.ndarray) -> np.ndarray:
    """`np.cumsum(x, axis=0)`, bit for bit; for wide rows it adds row by row in place, some 30x
    faster than NumPy's strided accumulate over the first axis (8,192-device prefix states)."""
    if x.ndim < 2 or x[0].size < 1024:
        return np.cumsum(x, axis=0)
    for g in range(1, x.shape[0]):
        np.add(x[g], x[g - 1], out=x[g])
    return x


def home_pairs(home: np.ndarray, counts: np.ndarray, token_bytes: float) -> np.ndarray:
    """`[L, D, D]` float: under `Assignment.to_home` of `Placement.from_homes(home)` (`home[L,
    E]`, `counts[L, D, E]`), pairs[l, s, d] = the experts homed on d that s sends a message's
    worth of tokens to (`traffic.sends`; 0 for s = d): the multiplicity of the dispatch
    message s -> d, which exists iff it is > 0. Cost L * D * E; memory L * D * D (callers use
    it where D <= E)."""
    L, D, E = counts.shape
    home = np.asarray(home, dtype=np.int64)
    go = sends(counts, token_bytes)
    go[np.arange(L)[:, None], home, np.arange(E)[None, :]] = False  # a home keeps its tokens
    # pairs[l] = go[l] @ onehot(home[l]) [E, D], in float32 (sums of at most E ones: exact),
    # over chunks of layers that keep the one-hot matrices within _PAIR_CELLS cells.
    pairs = np.empty((L, D, D))
    step = max(1, _PAIR_CELLS // max(1, E * D))
    for lo in range(0, L, step):
        hi = min(L, lo + step)
        onehot = np.zeros((hi - lo, E, D), dtype=np.float32)
        onehot[np.arange(hi - lo)[:, None], np.arange(E)[None, :], home[lo:hi]] = 1.0
        pairs[lo:hi] = np.matmul(go[lo:hi].astype(np.float32), onehot)
    return pairs


@functools.lru_cache(maxsize=32)
def _level_table(cluster: Cluster) -> np.ndarray:
    """`[D, D]` `cluster.level_between` of every pair of devices (read-only, kept per
    cluster)."""
    devices = np.arange(cluster.num_devices)
    table = cluster.level_between(devices[:, None], devices)
    table.setflags(write=False)
    return table


class LayerState:
    """One layer's per-device quantities, enough to price a lightweight placement change.

    `comp[D]` forward expert seconds, `tok_send/tok_recv[3, D]` dispatch tokens per link level,
    `par_send/par_recv[3, D]` Trans bytes per level, `tok_msg_out/tok_msg_in[3, D]` the peers a
    device sends dispatch tokens to / receives them from per level, `par_msg_out/par_msg_in[3,
    D]` the same for Trans (`poise.cost.messages`), `R[D, E]` computed tokens. The per-device
    arrays are views of one packed array `cells[D, CELLS]`, a row per device, so a planner
    gathers or updates a device's whole state at once; `packed_terms` and `packed_layer_s`
    price such states side by side. Columns: `COMP`, then what a device sends, level by level
    (dispatch tokens, Trans bytes), then what it receives, then its messages likewise: level v
    of kind `TOK_SEND`, `PAR_SEND`, `TOK_RECV`, `PAR_RECV`, `MSG_TOK_OUT`, `MSG_PAR_OUT`,
    `MSG_TOK_IN` or `MSG_PAR_IN` is column `kind + LEVEL_STEP * v`."""

    COMP = 0  # column of `cells`: forward expert seconds
    TOK_SEND = 1  # dispatch tokens sent, at level 0 (level v: + LEVEL_STEP * v)
    PAR_SEND = 2  # Trans bytes sent (as a home)
    TOK_RECV = 7  # dispatch tokens received
    PAR_RECV = 8  # Trans bytes received (as a replica)
    LEVEL_STEP = 2
    MSG_TOK_OUT = 13  # peers sent dispatch tokens to, at level 0
    MSG_PAR_OUT = 14  # peers sent Trans bytes to (replica devices, as a home)
    MSG_TOK_IN = 19  # peers received dispatch tokens from
    MSG_PAR_IN = 20  # peers received Trans bytes from (homes, as a replica device)
    CELLS = 25
    # Rows of `packed_terms`: compute, then the all-to-all's and Trans' own-link seconds and
    # the latency of the device's messages.
    T_COMP, T_TOK_PORT, T_TOK_LAT, T_PAR_PORT, T_PAR_LAT = range(5)
    TERMS = 5
    TABLE_DEVICES = 64  # `level_between` from a table up to this many devices

    def __init__(self, cost: CostModel, placement: Placement, counts: np.ndarray) -> None:
        """One layer: `placement` of one layer, `counts[D, E]`."""
        (state,) = LayerState.for_layers(cost, placement, counts[None])
        self.__dict__.update(state.__dict__)

    @classmethod
    def for_layers(
        cls, cost: CostModel, placement: Placement, counts: np.ndarray
    ) -> list[LayerState]:
        """One state per layer of `placement`, `counts[L, D, E]`, priced in one vectorised pass
        (each a view of `LayerState.stacked`)."""
        stacked = cls.stacked(cost, placement, counts)
        return [stacked.take(layer) for layer in range(counts.shape[0])]

    @classmethod
    def stacked(cls, cost: CostModel, placement: Placement, counts: np.ndarray) -> LayerState:
        """All layers of `placement` (`counts[L, D, E]`) in one state whose arrays carry a
        leading layer axis: `R[L, D, E]`, `comp[L, D]`, `tok_send/tok_recv/par_send/par_recv[L,
        3, D]` (`cells[L, D, CELLS]`). The batch methods (`device_terms`, `layer_s`, ...) take
        any leading axes, so planners price candidates of every layer at once (`[L, M, 3, D]`);
        `take(l)` is layer l's own state (views)."""
        cluster, spec = cost.cluster, cost.spec
        assignment = Assignment.to_home(placement)
        R = assignment.received(placement, counts)  # [L, D, E]
        routing = Routing(cluster, placement, assignment)
        send, recv = routing.traffic(counts)
        m_out, m_in = routing.messages(counts, spec.token_bytes)
        replicas = replica_cells(placement)
        p_send, p_recv = replica_traffic(cluster, placement, spec.expert_bytes, replicas=replicas)
        pm_out, pm_in = replica_messages(cluster, placement, replicas)
        L, D, _ = counts.shape
        state = cls._blank(cost, np.empty((L, D, cls.CELLS)))
        state.R = R
        state.comp[...] = state.comp_s(R).sum(axis=2)
        for view, x in (
            (state.tok_send, send),
            (state.tok_recv, recv),
            (state.par_send, p_send),
            (state.par_recv, p_recv),
            (state.tok_msg_out, m_out),
            (state.tok_msg_in, m_in),
            (state.par_msg_out, pm_out),
            (state.par_msg_in, pm_in),
        ):
            view[...] = x.transpose(1, 0, 2)
        return state

    @classmethod
    def for_homes(cls, cost: CostModel, home: np.ndarray, counts: np.ndarray) -> LayerState:
        """`stacked` for `Placement.from_homes(home)` (`home[L, E]`: no replicas, tokens to the
        homes), from the homes directly: each expert's tokens land on its home only, so the
        computed tokens, the traffic and the (zero) Trans come without the generic routing's
        passes over `[L, D, E]` (expert seconds are computed at the homes' cells only: zero
        tokens take zero seconds); the same numbers as `stacked`, bit for bit. `counts[L, D,
        E]` float. It also keeps the multiplicities of the messages, for searches that add
        replicas to it: `carried[L, D, D]` the experts each dispatch message s -> d carries
        (`home_pairs`) and `trans_carried[L, D, D]` those each Trans message home -> replica
        device carries (zero: no replicas). Memory L * D * D: for D <= E."""
        cluster = cost.cluster
        home = np.asarray(home, dtype=np.int64)
        L, D, E = counts.shape
        at_home = (np.arange(L)[:, None], home, np.arange(E)[None, :])
        remote = np.array(counts, dtype=np.float64)  # tokens that leave their source
        remote[at_home] = 0.0
        computed = counts[at_home] + remote.sum(axis=1)  # [L, E] each home's tokens of e
        R = np.zeros((L, D, E))  # the home computes its own tokens and all remote ones
        R[at_home] = computed
        send, recv = homes_traffic(cluster, home, remote)
        carried = home_pairs(home, counts, cost.spec.token_bytes)
        if D <= DIRECT_RUN:  # the messages are the pairs that carry an expert
            m_out, m_in = linked_levels(cluster, carried > 0)  # [L, 3, D] each
        else:
            m_out, m_in = (
                m.transpose(1, 0, 2)
                for m in homes_messages(cluster, home, remote, cost.spec.token_bytes)
            )
        state = cls._blank(cost, np.zeros((L, D, cls.CELLS)))  # Trans: zero
        state.R = R
        seconds = np.zeros((L, D, E))
        seconds[at_home] = state.comp_s(computed)
        state.comp[...] = seconds.sum(axis=2)  # comp_s(R).sum(axis=2): the same cells
        state.tok_send[...] = send.transpose(1, 0, 2)
        state.tok_recv[...] = recv.transpose(1, 0, 2)
        state.tok_msg_out[...] = m_out
        state.tok_msg_in[...] = m_in
        state.carried = carried
        state.trans_carried = np.zeros_like(state.carried)
        return state

    @classmethod
    def _blank(cls, cost: CostModel, cells: np.ndarray) -> LayerState:
        """A state on `cells[..., D, CELLS]` (kept, not copied), without `R`."""
        cluster = cost.cluster
        state = cls.__new__(cls)
        state.cost = cost
        state.carried = state.trans_carried = None  # `for_homes` only
        state.ports, state.shared = link_split(cluster)
        state.fnec, state.bnec = cost.non_moe_s
        # The link levels a message can take on this cluster (0 needs several devices per
        # node, 1 several nodes per domain, 2 several domains), as a range: the others carry
        # nothing in any state built here or changed along `level_between`.
        has = [cluster.devices_per_node > 1, cluster.nodes_per_domain > 1, cluster.domains > 1]
        used = [v for v in range(3) if has[v]] or [0]
        state.levels = (used[0], used[-1] + 1)
        state._table = _level_table(cluster) if cluster.num_devices <= cls.TABLE_DEVICES else None
        state._set_cells(cells)
        return state

    def _set_cells(self, cells: np.ndarray) -> None:
        """Keep `cells[..., D, CELLS]` and make the named per-device arrays views of it."""

        def levels(first: int) -> np.ndarray:
            step = self.LEVEL_STEP
            return cells[..., first : first + 3 * step : step].swapaxes(-1, -2)  # [..., 3, D]

        self.cells = cells
        self.comp = cells[..., self.COMP]
        self.tok_send, self.par_send = levels(self.TOK_SEND), levels(self.PAR_SEND)
        self.tok_recv, self.par_recv = levels(self.TOK_RECV), levels(self.PAR_RECV)
        self.tok_msg_out, self.par_msg_out = levels(self.MSG_TOK_OUT), levels(self.MSG_PAR_OUT)
        self.tok_msg_in, self.par_msg_in = levels(self.MSG_TOK_IN), levels(self.MSG_PAR_IN)

    def take(self, layer: int | slice) -> LayerState:
        """Layer `layer` (or a run of layers) of a `stacked` state; its arrays are views."""
        state = LayerState.__new__(LayerState)
        state.cost, state.fnec, state.ports, state.shared = (
            self.cost,
            self.fnec,
            self.ports,
            self.shared,
        )
        state.bnec = self.bnec
        state.levels, state._table = self.levels, self._table
        state.R = self.R[layer]
        state.carried = None if self.carried is None else self.carried[layer]
        state.trans_carried = None if self.trans_carried is None else self.trans_carried[layer]
        state._set_cells(self.cells[layer])
        return state

    def comp_s(self, rows: np.ndarray) -> np.ndarray:
        """Forward seconds of one expert GEMM over `rows` tokens (elementwise)."""
        return expert_seconds(self.cost.cluster, self.cost.spec, rows)

    def _kind_bytes(self, packed: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """`(send, recv)` `[..., 3, X]` bytes by level of kind 0 (dispatch tokens, scaled by
        B_t) or 1 (Trans) from states packed side by side, `packed[..., CELLS, X]`."""
        step = self.LEVEL_STEP
        sent, received = ((self.TOK_SEND, self.TOK_RECV), (self.PAR_SEND, self.PAR_RECV))[kind]
        send = packed[..., sent : sent + 3 * step : step, :]
        recv = packed[..., received : received + 3 * step : step, :]
        if kind == 0:
            tb = self.cost.spec.token_bytes
            return send * tb, recv * tb
        return send, recv

    def _kind_messages(self, packed: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """`(m_out, m_in)` `[..., 3, X]` peers by level of kind 0 (dispatch) or 1 (Trans) from
        states packed side by side, `packed[..., CELLS, X]`."""
        step = self.LEVEL_STEP
        out, into = ((self.MSG_TOK_OUT, self.MSG_TOK_IN), (self.MSG_PAR_OUT, self.MSG_PAR_IN))[kind]
        sent = packed[..., out : out + 3 * step : step, :]
        return sent, packed[..., into : into + 3 * step : step, :]

    def packed_terms(self, packed: np.ndarray) -> np.ndarray:
        """Per device state, the parts of a layer's phases that are its own: `[..., TERMS, X]`
        from states packed side by side, `packed[..., CELLS, X]` (`cells` transposed: a column
        per device state, any leading axes). Rows: `T_COMP` forward expert seconds (with the
        cluster's per-call floor, `cost.model.expert_call_floor`), then for the
        all-to-all (`T_TOK_*`) and Trans (`T_PAR_*`) the seconds on the device's own links
        (`PORT`) and its messages' latency (`LAT`) (`network.device_seconds`). The maxima over a
        layer's devices, with the shared links' `packed_groups`, give its phases
        (`layer_s_from_parts`)."""
        lead, X = packed.shape[:-2], packed.shape[-1]
        out = np.empty((*lead, self.TERMS, X))
        cost = self.cost
        out[..., self.T_COMP, :] = expert_call_floor(
            cost.cluster, cost.spec, packed[..., self.COMP, :]
        )
        cluster = self.cost.cluster
        for kind, row in ((0, self.T_TOK_PORT), (1, self.T_PAR_PORT)):
            port, lat = device_seconds(
                cluster, *self._kind_bytes(packed, kind), *self._kind_messages(packed, kind)
            )
            out[..., row, :] = port
            out[..., row + 1, :] = lat
        return out

    def packed_groups(self, packed: np.ndarray) -> np.ndarray:
        """`[..., 2]` seconds of the busiest shared link (NIC or uplink several devices share)
        in the all-to-all and in Trans, for whole layers packed `[..., CELLS, D]`
        (`network.group_seconds`)."""
        cluster = self.cost.cluster
        out = np.zeros((*packed.shape[:-2], 2))
        if self.shared:
            for kind in (0, 1):
                out[..., kind] = group_seconds(cluster, *self._kind_bytes(packed, kind))
        return out

    def group_inputs(self, packed: np.ndarray) -> np.ndarray:
        """`[..., S, 4, X]` what each device state puts on the shared link of each shared level
        s (`self.shared`): dispatch bytes out and in, Trans bytes out and in (`network.link_bytes`),
        from `packed[..., CELLS, X]`; a link's load is the sum over the devices behind it."""
        out = np.empty((*packed.shape[:-2], len(self.shared), 4, packed.shape[-1]))
        for kind in (0, 1):
            send, recv = self._kind_bytes(packed, kind)
            for s, (v, _) in enumerate(self.shared):
                o, i = link_bytes(send, recv, v)
                out[..., s, 2 * kind, :] = o
                out[..., s, 2 * kind + 1, :] = i
        return out

    def level_between(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """`Cluster.level_between` (from a `[D, D]` table on clusters of at most
        `TABLE_DEVICES` devices)."""
        if self._table is not None:
            return self._table[src, dst]
        return self.cost.cluster.level_between(src, dst)

    def layer_s_from_max(self, fec: np.ndarray, a2a: np.ndarray, trans: np.ndarray) -> np.ndarray:
        """Layer seconds `[M]` from the slowest device's compute, all-to-all and Trans `[M]`
        (the non-expert compute and the migration, the same for all, as scalars)."""
        fnec, none = np.float64(self.fnec), np.float64(0.0)
        phases = PhaseTimes.from_parts(a2a, fec, fnec, trans, none, np.float64(self.bnec))
        return self.cost.schedule.layer_time(phases)

    def phase_parts(
        self, slowest: np.ndarray, groups: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(FEC, A, Trans)` `[...]` from the maxima over a layer's devices of `packed_terms`,
        `slowest[..., TERMS]`, and its shared links' `groups[..., 2]`: a phase takes its busiest
        link plus its largest latency of one device's messages (`network.link_seconds`)."""
        a2a = np.maximum(slowest[..., self.T_TOK_PORT], groups[..., 0])
        trans = np.maximum(slowest[..., self.T_PAR_PORT], groups[..., 1])
        a2a = a2a + slowest[..., self.T_TOK_PORT + 1]
        trans = trans + slowest[..., self.T_PAR_PORT + 1]
        trans = trans * self.cost.cluster.host.transfer_scale
        return slowest[..., self.T_COMP], a2a, trans

    def layer_s_from_parts(self, slowest: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """Layer seconds `[...]` from `phase_parts`' inputs."""
        return self.layer_s_from_max(*self.phase_parts(slowest, groups))

    def packed_layer_s(self, packed: np.ndarray) -> np.ndarray:
        """Layer seconds `[...]` of whole layers packed side by side, `packed[..., CELLS, D]`:
        `CostModel.price` of the layers these states describe."""
        terms = self.packed_terms(packed)  # [..., TERMS, D]
        if terms.size >= 4096:  # the max over many short rows: faster down contiguous columns
            rows = terms.reshape(-1, terms.shape[-1])
            slowest = rows.T.copy().max(axis=0).reshape(terms.shape[:-1])  # [..., TERMS]
        else:
            slowest = terms.max(axis=-1)
        return self.layer_s_from_parts(slowest, self.packed_groups(packed))

    def layer_s(
        self,
        comp: np.ndarray,
        tok_send: np.ndarray,
        tok_recv: np.ndarray,
        par_send: np.ndarray,
        par_recv: np.ndarray,
        tok_msg_out: np.ndarray,
        tok_msg_in: np.ndarray,
        par_msg_out: np.ndarray,
        par_msg_in: np.ndarray,
    ) -> np.ndarray:
        """Layer seconds under the cost model's schedule for a batch of states
        (`comp[M, D]`, the rest `[M, 3, D]`: bytes, then messages, as the named arrays)."""
        M, D = comp.shape
        packed = np.zeros((M, self.CELLS, D))
        packed[:, self.COMP] = comp
        step = self.LEVEL_STEP
        for first, x in (
            (self.TOK_SEND, tok_send),
            (self.PAR_SEND, par_send),
            (self.TOK_RECV, tok_recv),
            (self.PAR_RECV, par_recv),
            (self.MSG_TOK_OUT, tok_msg_out),
            (self.MSG_PAR_OUT, par_msg_out),
            (self.MSG_TOK_IN, tok_msg_in),
            (self.MSG_PAR_IN, par_msg_in),
        ):
            packed[:, first : first + 3 * step : step] = x
        return self.packed_layer_s(packed)

    def phases(self) -> PhaseTimes:
        """Phase times `[L]` of a stacked state (no migration: these states keep their homes),
        as `PlanPricer.phases` gives them for the placement the state describes (equal up to
        float rounding where the state was updated by differences)."""
        packed = np.ascontiguousarray(self.cells.swapaxes(-1, -2))
        slowest = self.packed_terms(packed).max(axis=-1)
        fec, a2a, trans = self.phase_parts(slowest, self.packed_groups(packed))
        fnec, bnec = np.full_like(fec, self.fnec), np.full_like(fec, self.bnec)
        return PhaseTimes.from_parts(a2a, fec, fnec, trans, 0.0 * fec, bnec)

    def current_s(self) -> float:
        packed = np.ascontiguousarray(self.cells.swapaxes(-1, -2))
        return float(self.packed_layer_s(packed[None])[0])
