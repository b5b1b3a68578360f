"""The Balancer: live load balancing of a model's `poise.nn.MoE` layers between training steps.

    apply_expert_parallel(model, group, num_slots=E // D + 1)       # spare slots for replicas
    opt = HomeRowsAdamW(model.parameters(), home_rows(model), ...)    # AdamW on home rows
    balancer = Balancer(model, opt, "auto", replan_every=10, config=BalancerConfig(...))
    for batch in data:
        loss = model(batch).loss
        loss.backward()            # micro-batches before the last: inside `balancer.no_sync()`
        sync_router_grads(model)   # + the data-parallel all-reduce of other non-expert gradients
        balancer.reduce_replicas() # Agg: replica gradients summed into their homes; the loads
        clip_grad_norm_(...)       # anything that reads expert gradients comes after it
        opt.step()
        balancer.step()            # the step boundary: decide, request a plan, or launch Trans
        opt.zero_grad()

One step, every rank alike:

1. forward hooks add each layer's `last_counts[E]` up on its device (no host wait) and, with
   `overlap`, wait for the layer's Trans just before it runs; gradient hooks launch Agg as soon
   as a layer's expert gradients are ready;
2. `reduce_replicas` finishes Agg and gathers every rank's counts, non-finite flags and seconds in
   one collective (`poise.runtime.loads`), so every rank holds `counts[L, D, E]`;
3. `step`, every `replan_every` steps, has the leader (rank 0 of the vote group) hand a planning
   job to its background planner (`poise.runtime.control.job`, in `poise.runtime.planner`);
   `lag` steps later (as many as the last job took) the leader's controller decides on it
   (`poise.runtime.control.controller`: adopt, keep or revert) and every rank takes the decision
   at the same boundary (`poise.runtime.planner.broadcast`); an adopted plan takes effect at once
   (`moves.layer_moves.LayerMoves.relay`: homes migrate with their optimizer state, replicas
   fill); otherwise the boundary re-chooses the replicas from the step just run (`retarget`) and
   launches their Trans, or runs the next step as a probe on the plan's homes alone.

Replica rows are never the master copy: homes carry weights and optimizer state, and the
optimizer's mathematics on them is static EP's, so balanced and static runs give the same losses
up to float summation order (HybridEP's `compression` excepted). Instruments (free balancing,
steps in turns) plug into `callbacks` around the boundary's work (`BoundaryCallback`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from poise.adapters.protocol import find_balanceable
from poise.core.errors import ConfigError
from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.plan.policies.registry import get_policy
from poise.plan.predict import parse_predictor
from poise.plan.retarget import retargeted
from poise.runtime.config import BalancerConfig
from poise.runtime.hybridep.compress import Compression
from poise.runtime.loads import gather_step
from poise.runtime.moves.host_link import HostLink
from poise.runtime.moves.layer_moves import LayerMoves
from poise.runtime.moves.layer_state import LayerState
from poise.runtime.moves.optimizer_state import ExpertStates
from poise.runtime.moves.transfer_group import transfer_group as own_transfer_group
from poise.runtime.plan_inputs import initial_plan, layer_slots, prior_cluster, spec_from_layers
from poise.runtime.planner.broadcast import is_leader
from poise.runtime.planning import PlanMismatchError, Planning
from poise.runtime.probe_steps import ProbeSteps
from poise.runtime.records import (
    LAYOUT_NAMES,
    OTHER,
    PROBE,
    REPLICAS,
    STATIC,
    StepRecords,
)
from poise.runtime.selfcal import fit as selfcal
from poise.runtime.selfcal.probe import start_up_probes
from poise.runtime.stats import StepStats, layer_loads

LAYER_PHASES = ("gate", "dispatch", "experts", "combine")
KEEP_STATS = 10_000  # `StepStats` kept, the newest last


class BoundaryCallback(Protocol):
    """An instrument around the Balancer's own work at a step boundary: `enter(point)` before
    and `leave(point, stats)` after, `point` being `reduce` (`reduce_replicas`' Agg) or `step`
    (the decision, the request, the moves)."""

    def enter(self, point: str) -> None: ...

    def leave(self, point: str, stats: StepStats) -> None: ...


class Balancer:
    """Records loads, plans and applies plans for every `poise.nn.MoE` layer of `model` (every
    `poise.adapters.BalanceableMoE`, the outermost where nested).

    `policy`: a registered policy name (`auto`, `static`, `eplb`, ...); `replan_every`: request a
    plan every K steps; `config`: the settings (`BalancerConfig`); `group`: the expert-parallel
    group (default the layers'); `vote_group`: the ranks that must take the same decisions
    (default `group`): its rank 0 is the leader; `optimizer`: a torch optimizer or a container
    of them (`poise.runtime.moves.optimizer_state`: the expert tensors' moments are found in the
    inner optimizer that holds them, and migrate with them); `transfer_group`: the group Trans,
    Agg and migration run on (default one of their own over `group` with `separate_transfers`).
    Statistics: `stats` (one `StepStats` per step), `steps_done`, `switches`, `fit`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Any,
        policy: str = "auto",
        replan_every: int = 10,
        config: BalancerConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        vote_group: dist.ProcessGroup | None = None,
        transfer_group: dist.ProcessGroup | None = None,
    ) -> None:
        cfg = config if config is not None else BalancerConfig()
        cfg.check(replan_every)
        get_policy(policy)  # unknown names fail here
        modules = find_balanceable(model)
        if not modules:
            raise ConfigError(
                "the model has no poise.nn.MoE layer (nor another BalanceableMoE)", field="model"
            )
        self.config, self.model, self.optimizer = cfg, model, optimizer
        self.policy, self.replan_every = policy, replan_every
        self.group = group if group is not None else modules[0].group
        self.world_size, self.rank = modules[0].world, modules[0].rank
        self.layers = [LayerState(m, i) for i, m in enumerate(modules)]
        # the experts' moments, inside an optimizer container too (or one ConfigError)
        self.expert_states = ExpertStates(optimizer, [p for s in self.layers for p in s.params])
        self.slots = layer_slots(self.layers)
        self.num_experts = modules[0].num_experts
        on_cpu = self.layers[0].params[0].device.type == "cpu"
        self.cluster = prior_cluster(cfg.cluster, self.world_size, on_cpu)
        self.balancing = policy != "static"  # static EP never probes, plans or switches
        self.predictor = parse_predictor(cfg.predictor)
        self.options = {k: dict(v) for k, v in cfg.options.items()}
        self.options.setdefault("auto", {}).setdefault("base_horizon", replan_every)
        self.vote_group = vote_group  # None: `group`
        self._vote_pg = vote_group if vote_group is not None else self.group
        self.leader = is_leader(self._vote_pg)  # plans and decides for every rank
        self.probes = ProbeSteps(cfg.probe_every if cfg.guard else 0)
        self.retarget = cfg.retarget and self.balancing
        self.transfers_pg = transfer_group
        if self.transfers_pg is None:
            separate = cfg.separate_transfers and self.balancing and self.world_size > 1
            self.transfers_pg = own_transfer_group(self.group) if separate else self.group
        link = cfg.host_link and on_cpu and self.balancing
        self.moves = LayerMoves(
            self.layers, self.rank, self.slots, self.expert_states, self.transfers_pg,
            link=HostLink.connect(self.transfers_pg) if link else None,
            compression=Compression.parse(cfg.compression), overlap=cfg.overlap,
        )  # fmt: skip
        self.probe: tuple[float, float, float] | None = None  # (k, measured s, modelled s)
        self.switch_probe: tuple[float, float, float, int] | None = None  # (..., homes)
        if cfg.calibrate and cfg.probe_transfers and self.balancing and self.world_size > 1:
            shapes = cfg.spec if cfg.spec is not None else spec_from_layers(modules)
            self.probe, self.switch_probe = start_up_probes(
                self.cluster, shapes, self.transfers_pg, self.layers[0].params[0].device,
                link=self.moves.migrate_channel(), scratch=self.moves.scratch,
            )  # fmt: skip
        self.planning = Planning(
            cfg, policy, replan_every, self.cluster, slots=self.slots, options=self.options,
            predictor=self.predictor, vote_group=self._vote_pg, leader=self.leader,
            retarget=self.retarget, shared_cores=self.cores_shared(), on_cpu=on_cpu,
            fit=selfcal.Fit(k_transfer=self.probe[0] if self.probe else 1.0),
            switch_prior=self.switch_probe[0] if self.switch_probe else 1.0,
        )  # fmt: skip
        if self.planning.plans_here and self.balancing:
            self.planning.planner.start()  # after the probes, which it would slow
        self.records = StepRecords(cfg.history)
        self.window = self.records.window  # [L, D, E] per step (the same deque)
        self.stats: deque[StepStats] = deque(maxlen=KEEP_STATS)
        self.steps_done = self.switches = 0
        self.callbacks: list[BoundaryCallback] = []
        self.plan = initial_plan(self.layers, self.slots, self.rank, cfg.split_tokens, self.spec())
        self.static_plan = self.routed = self.plan  # the fallback; what the layers run
        self._layout, self._plan_since = STATIC, 0
        self._t_reduce: float | None = None  # when the last `reduce_replicas` had its Agg
        self._paused_at: float | None = None
        self._boundary_s = self._migrate_s = 0.0
        self._shapes: ModelSpec | None = None
        self._current = StepStats(step=0, policy=policy)
        self._prepared = self._accumulating = False
        self._handles: list[Any] = []
        self.moves.route(self.plan)
        for state in self.layers:  # replicas of the initial routing start from their homes
            if state.has_replicas:
                self.moves.start_trans(state, refresh=True).wait()
        self._register_hooks()

    # ----------------------------------------------------------------------------- set-up
    def spec(self) -> ModelSpec:
        """The model shape the planner prices, tokens per device from the counts seen so far."""
        if self.config.spec is not None:
            return self.config.spec
        tokens = 1
        if self.window:
            top_k = self.layers[0].layer.top_k
            tokens = int(np.mean([c[0].sum() for c in self.window]) / (self.world_size * top_k))
        return spec_from_layers([s.layer for s in self.layers], tokens)

    def cores_shared(self) -> bool:
        """Whether this run's ranks share their cores (`HostCosts.shared_cores` of the prior)."""
        return self.cluster.host.shared_cores > 0

    def _register_hooks(self) -> None:
        for state in self.layers:
            self._handles.append(
                state.layer.register_forward_hook(lambda m, a, o, s=state: self._record(s))
            )
            if self.config.overlap:
                self._handles.append(
                    state.layer.register_forward_pre_hook(
                        lambda m, a, s=state: self.moves.wait(s, self._current, in_compute=True)
                    )
                )
                for i, p in enumerate(state.params):
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(
                            lambda p, s=state, i=i: self._grad_ready(s, i)
                        )
                    )
        if self.config.optimizer_hooks:
            pre = self.optimizer.register_step_pre_hook(lambda *_: self.reduce_replicas())
            self._handles += [pre, self.optimizer.register_step_post_hook(lambda *_: self.step())]

    def close(self) -> None:
        """Finish transfers in flight, drop a plan in flight, remove every hook."""
        self.moves.wait_all(self._current)
        self.planning.planner.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def pause(self) -> None:
        """Between steps, before handing the host to another run: Trans in flight lands and the
        planner's worker stops until `resume`."""
        self.moves.wait_all(self._current)
        self.planning.planner.pause()
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """The host is this run's again: the planner goes on; the next step's period leaves out
        the seconds paused."""
        if self._paused_at is None:
            return
        if self._t_reduce is not None:
            self._t_reduce += time.perf_counter() - self._paused_at
        self._paused_at = None
        self.planning.planner.resume()

    # ------------------------------------------------------------------------ layer hooks
    def _record(self, state: LayerState) -> None:
        """Forward hook: the layer's counts and rows added up, its phase seconds noted."""
        if not state.layer.training:
            return
        counts = state.layer.last_counts.detach()
        state.counts = counts.clone() if state.counts.numel() == 0 else state.counts + counts
        state.rows += int(state.layer.last_forward.rows)
        for phase, seconds in state.layer.last_forward.seconds.items():
            if phase in LAYER_PHASES:
                self._current.add_seconds(phase, float(seconds))

    def _grad_ready(self, state: LayerState, index: int) -> None:
        """Gradient hook: once all of a layer's expert gradients are in, launch its Agg (not
        inside `no_sync`, where later micro-batches add to them)."""
        state.grads_ready.add(index)
        if len(state.grads_ready) < len(state.params):
            return
        state.grads_ready.clear()
        if state.has_replicas and not self._accumulating:
            self.moves.launch_agg(state, self._current, in_compute=True)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of micro-batches before a step's last (as `DistributedDataParallel.no_sync`):
        replica gradients add up and no Agg is launched."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    # ---------------------------------------------------------------------- step boundary
    def _enter(self, point: str) -> None:
        for cb in self.callbacks:
            cb.enter(point)

    def _leave(self, point: str, stats: StepStats) -> None:
        for cb in self.callbacks:
            cb.leave(point, stats)

    def reduce_replicas(self) -> None:
        """After `backward`, before anything reads expert gradients: finish Agg and gather the
        step's loads (`NonFiniteInputError` on every rank where a layer saw NaN or infinity).
        Collective; idempotent within a step."""
        if self._prepared:
            return
        self._enter("reduce")
        self.moves.finish_aggs(self._current)
        self._leave("reduce", self._current)
        t_end = time.perf_counter()  # the period holds the step's own Agg
        period = 0.0 if self._t_reduce is None else t_end - self._t_reduce
        self._t_reduce = t_end
        self._gather(period)
        self._prepared = True

    def step(self) -> StepStats:
        """The step boundary, after `optimizer.step()`: decide a plan that is due, request the
        next every `replan_every` steps, otherwise launch Trans. Collective; the step's stats."""
        self.reduce_replicas()
        self._enter("step")
        t0 = time.perf_counter()
        self.steps_done += 1
        s, stats = self.steps_done, self._current
        if self.probes.probing is not None:
            self.probes.end(self.routed, self.moves)
            self._layout = REPLICAS
        switched = self.planning.due(s) and self._decide(stats)
        if self.balancing and self.window and self.planning.may_request(s):
            self._request(s)
            if self.planning.due(s):  # plan_lag 0
                switched = self._decide(stats) or switched
        replicas = self.balancing and self._layout == REPLICAS
        probe = not switched and self.probes.due(s, replicas, self._plan_since)
        if probe and self.probes.begin(self.plan, self.spec(), self.moves):
            self._layout = PROBE
        if not switched:
            self._refresh_replicas(stats)
        self._boundary_s = time.perf_counter() - t0
        self._migrate_s = stats.seconds.get("migrate", 0.0)  # only a switch migrates
        stats.add_seconds("boundary", self._boundary_s)
        self._leave("step", stats)
        self.stats.append(stats)
        self._current = StepStats(step=s, policy=self.policy)
        self._current.probe = self.probes.probing is not None
        self._prepared = False
        return stats

    def _refresh_replicas(self, stats: StepStats) -> None:
        """Launch the replicas' Trans for the next forward; first, with `retarget` (off a probe
        step), re-choose the plan's replicas from the step just run (`poise.plan.retarget`)."""
        if self.retarget and self._layout == REPLICAS:
            if self._shapes is None:  # the replicas' bytes depend on the shapes alone
                self._shapes = self.spec()
            new = retargeted(self.plan, self.window[-1], self._shapes)
            changed = (new.placement.copies != self.routed.placement.copies).any(axis=(1, 2))
            if changed.any():
                stats.retargeted = int(changed.sum())
                self.moves.reroute(new, np.flatnonzero(changed).tolist(), stats)
                self.routed = new
                return
        self.moves.launch_trans(stats)

    @property
    def last_stats(self) -> StepStats | None:
        return self.stats[-1] if self.stats else None

    def _gather(self, period_s: float) -> None:
        """All ranks' counts of this step, `[L, D, E]`, and their seconds, recorded."""
        sec = self._current.seconds
        mine = [
            period_s, self._boundary_s, sec.get("gate", 0.0),
            sec.get("dispatch", 0.0) + sec.get("combine", 0.0), sec.get("experts", 0.0),
            sec.get("transfers", 0.0), self._migrate_s,
        ]  # fmt: skip
        g = gather_step(
            self.layers, self.num_experts, mine, self.group, self.world_size,
            self.steps_done + 1, self.vote_group,
        )  # fmt: skip
        self._current.rank_seconds = {
            name: g.rank_seconds[:, i].tolist() for i, name in enumerate(selfcal.MEASURED)
        }
        running = self.probes.probing if self.probes.probing is not None else self.routed
        self.records.append(
            g.counts, np.concatenate([[self.steps_done], g.measured]), self._layout,
            self.steps_done > self._plan_since, g.rank_experts,
            np.argwhere(running.placement.replicas()),
        )  # fmt: skip
        self._current.measured_period_s = float(g.measured[selfcal.PERIOD])
        self._current.layout = LAYOUT_NAMES[self._layout]
        planned = layer_loads(running.placement, running.assignment, g.counts)
        self._current.set_loads(planned.measured(g.computed))

    def apply(self, plan: Plan, stats: StepStats | None = None) -> None:
        """Make `plan` every layer's routing now (`LayerMoves.relay`). Collective."""
        self.moves.relay(plan, stats if stats is not None else self._current)
        self.plan = self.routed = plan
        if plan.digest() == self.static_plan.digest():
            self._layout = STATIC
        else:
            self._layout = REPLICAS if plan.placement.replicas().any() else OTHER
        if self._layout != REPLICAS:
            self.probes.new_episode()

    # ------------------------------------------------------------------------ planning
    def _decide(self, stats: StepStats) -> bool:
        """Take the leader's decision and act on it; whether a plan took effect."""
        plan, evidence = self.planning.decide(
            stats, self.records, self.plan, self.static_plan, self.steps_done, self.rank
        )
        self.probes.note(evidence)
        if plan is None:
            return False
        self.apply(plan, stats)
        stats.switched = True
        self.switches += 1
        self._plan_since = self.steps_done
        self.planning.switched(self.steps_done)
        return True

    def _request(self, step: int) -> None:
        self.planning.request(
            step, self.records, self.plan, self.static_plan, self._plan_since, self.spec(),
            probing=self.probes.every > 0,
        )  # fmt: skip


__all__ = ["Balancer", "BalancerConfig", "BoundaryCallback", "PlanMismatchError"]
