"""The Balancer's plan carried out on the layers of one rank (`LayerMoves`; the Balancer decides
*which* plan runs): routing, a new plan's migration, Trans (plain, or compressed: HybridEP's
shared expert plus a share of each residual) launched at the step boundary and waited for in
the layer's forward, and Agg launched from the gradient hooks and finished before anything
reads gradients.

Seconds spent here go to the step's `transfers` phase, bytes to its `trans_bytes`,
`agg_bytes`, `migrate_bytes`; the part spent inside the step's forward and backward (Trans
waits in the forward pre-hooks, Agg launches from the gradient hooks) also to
`TRANSFERS_IN_COMPUTE`, the rest to the training loop's `balance` phase. Every rank calls the
same methods in the same order (the transfers are collective over `group`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from poise.core.placement import Plan
from poise.nn.slots import SlotMap, slot_maps
from poise.runtime.hybridep.compress import Compression
from poise.runtime.moves import transfers as tr
from poise.runtime.moves.compressed_trans import trans_compressed_async
from poise.runtime.moves.exchange import Pending, Scratch
from poise.runtime.moves.host_link import Channel, HostLink
from poise.runtime.moves.layer_state import LayerState, grad_of, same_homes
from poise.runtime.stats import StepStats

TRANSFERS_IN_COMPUTE = "transfers_in_compute"  # the transfers' seconds inside forward/backward


@dataclass(eq=False)
class LayerMoves:
    """Routing, Trans, Agg and migration on this rank's layers (module docstring).

    `layers`: the Balancer's `LayerState`s; `slots`: slots per rank; `optimizer`: whose state
    migrates with the homes (anything with a torch optimizer's `state` mapping: the Balancer
    passes `optimizer_state.ExpertStates`); `link`: shared-memory channels among the ranks of
    `group` (None: through the group); `compression`: None (exact replicas) or a
    `Compression`; `overlap`: Trans runs under the forward (else it is waited for at once)."""

    layers: list[LayerState]
    rank: int
    slots: int
    optimizer: tr.HasState
    group: dist.ProcessGroup | None
    link: HostLink | None = None
    compression: Compression | None = None
    overlap: bool = True
    # layer -> shared expert (compression)
    _shared: dict[int, list[torch.Tensor]] = field(default_factory=dict, init=False)
    # the migrations' packed rows, reused from layer to layer and switch to switch
    scratch: Scratch = field(default_factory=Scratch, init=False)

    # ---------------------------------------------------------------------------- routing
    def route(self, plan: Plan, layer_maps: list[list[SlotMap]] | None = None) -> None:
        """Tell each layer its placement, assignment and this rank's slot map (`layer_maps`
        `[L][D]`; default: `slot_maps`'s canonical order)."""
        if layer_maps is None:
            layer_maps = [slot_maps(plan.placement, s.index, self.slots) for s in self.layers]
        for state, maps in zip(self.layers, layer_maps, strict=True):
            self._set_routing(state, plan, maps)

    def _set_routing(self, state: LayerState, plan: Plan, maps: list[SlotMap]) -> None:
        state.set_maps(maps)
        state.layer.set_routing(plan.placement, plan.assignment, maps[self.rank], layer=state.index)

    def relay(self, plan: Plan, stats: StepStats) -> None:
        """Make `plan` the routing of every layer now: migrate the homes whose slots change with
        their optimizer state (`transfers.migrate`, through one shared-memory channel and
        buffers every layer's migration takes in turn), then launch every layer's Trans under
        the new maps (`launch_trans`). Homes that stay keep their slots (`slot_maps(previous=)`),
        so only rewritten rows cost memory traffic; a layer whose plan only adds, drops or swaps
        replicas moves nothing (its Trans overwrites the replica rows; rows no slot holds keep
        stale values no forward reads). Collective."""
        t0 = time.perf_counter()
        layer_maps = []
        for state in self.layers:
            self.wait(state)
            new_maps = slot_maps(plan.placement, state.index, self.slots, previous=state.maps)
            layer_maps.append(new_maps)
            if same_homes(state.maps, new_maps):  # replicas only: no re-lay of any row
                continue
            t_move = time.perf_counter()
            moved = tr.migrate(
                state.params, self.optimizer, state.maps, new_maps, self.rank, group=self.group,
                fill_replicas=False, link=self.migrate_channel(), scratch=self.scratch,
            )  # fmt: skip
            stats.add_seconds("migrate", time.perf_counter() - t_move)
            stats.migrate_bytes += moved.home_total_bytes
            stats.moved_homes += moved.moved_homes
            stats.relaid_rows += moved.relaid_rows
        self.route(plan, layer_maps)
        stats.add_seconds("transfers", time.perf_counter() - t0)
        self.launch_trans(stats, refresh=True)

    def reroute(self, plan: Plan, layers: list[int], stats: StepStats) -> None:
        """`plan`'s routing on `layers` (indices into `self.layers`) whose homes stay, replicas
        re-chosen (`poise.plan.retarget`; nothing migrates: `relay` moves homes), then every
        replicated layer's Trans. Collective."""
        t0 = time.perf_counter()
        for i in layers:
            state = self.layers[i]
            self.wait(state)
            maps = slot_maps(plan.placement, state.index, self.slots, previous=state.maps)
            assert same_homes(state.maps, maps), "reroute moves no home"
            self._set_routing(state, plan, maps)
        stats.add_seconds("transfers", time.perf_counter() - t0)
        self.launch_trans(stats)

    # ------------------------------------------------------------------------------ Trans
    def start_trans(self, state: LayerState, refresh: bool = False) -> Pending:
        """Launch one layer's Trans under its current maps (compressed when `compression`;
        `refresh`: recompute the layer's shared expert first)."""
        if self.compression is None:
            return tr.trans_async(
                state.params, state.maps, self.rank, group=self.group, routes=state.trans_routes,
                link=self._channel("trans", state),
            )  # fmt: skip
        shared = None if refresh else self._shared.get(state.index)
        pending = trans_compressed_async(
            state.params, state.maps, self.rank, self.compression.ratio,
            shared=shared, group=self.group, routes=state.trans_routes,
        )  # fmt: skip
        self._shared[state.index] = pending.shared
        return pending

    def launch_trans(self, stats: StepStats, refresh: bool = False) -> None:
        """Launch every replicated layer's Trans (after waiting for any still in flight): it runs
        under the next forward, which waits for each layer's before using it (`wait`), or at
        once without `overlap`."""
        t0 = time.perf_counter()
        for state in self.layers:
            self.wait(state)
            if state.has_replicas:
                state.trans = self.start_trans(state, refresh=refresh)
                stats.trans_bytes += state.trans.total_bytes
                if not self.overlap:
                    self.wait(state)
        stats.add_seconds("transfers", time.perf_counter() - t0)

    def wait(
        self, state: LayerState, stats: StepStats | None = None, in_compute: bool = False
    ) -> None:
        """Wait for the layer's Trans (before it runs); the wait goes to `stats`' transfers
        where given, and also to `TRANSFERS_IN_COMPUTE` when `in_compute` (the forward pre-hook)."""
        if state.trans is not None:
            t0 = time.perf_counter()
            state.trans.wait()
            state.trans = None
            if stats is not None:
                _add_transfer_seconds(stats, time.perf_counter() - t0, in_compute)

    def wait_all(self, stats: StepStats | None = None) -> None:
        for state in self.layers:
            self.wait(state, stats)

    # -------------------------------------------------------------------------------- Agg
    def launch_agg(
        self, state: LayerState, stats: StepStats, timed: bool = True, in_compute: bool = False
    ) -> None:
        """Launch the layer's Agg on its gradients as they stand; its launch seconds go as in
        `wait` when `timed` (`in_compute`: from a gradient hook, inside the step's backward)."""
        t0 = time.perf_counter()
        grads = [grad_of(p) for p in state.params]
        pending = tr.agg_async(
            grads, state.maps, self.rank, group=self.group, routes=state.agg_routes,
            link=self._channel("agg", state),
        )  # fmt: skip
        state.aggs.append(pending)
        stats.agg_bytes += pending.total_bytes
        if timed:
            _add_transfer_seconds(stats, time.perf_counter() - t0, in_compute)

    def finish_aggs(self, stats: StepStats) -> None:
        """Before anything reads expert gradients: every tensor gets a gradient (zeros where
        the backward gave none: every rank steps every tensor, keeping AdamW's state in step),
        each replicated layer's Agg is launched if its gradient hooks did not, and all are
        finished."""
        t0 = time.perf_counter()
        for state in self.layers:
            for p in state.params:
                grad_of(p)
            if state.has_replicas and not state.aggs:
                self.launch_agg(state, stats, timed=False)
            for pending in state.aggs:
                pending.wait()
            state.aggs.clear()
            state.grads_ready.clear()
        stats.add_seconds("transfers", time.perf_counter() - t0)

    def _channel(self, kind: str, state: LayerState) -> Channel | None:
        """The layer's shared-memory channel for `kind` (Trans or Agg), None without a link."""
        return None if self.link is None else self.link.channel(f"{kind}-{state.index}")

    def migrate_channel(self) -> Channel | None:
        """The channel every layer's migration takes in turn (one region, sized by the largest
        layer's move), None without a link."""
        return None if self.link is None else self.link.channel("migrate")


def _add_transfer_seconds(stats: StepStats, seconds: float, in_compute: bool) -> None:
    stats.add_seconds("transfers", seconds)
    if in_compute:
        stats.add_seconds(TRANSFERS_IN_COMPUTE, seconds)


__all__ = ["TRANSFERS_IN_COMPUTE", "LayerMoves"]
