"""The Balancer: live load balancing of a model's `poise.nn.MoE` layers between training steps.

    model = MyModel(...)        # poise.nn.MoE layers, then
    apply_expert_parallel(model, group, num_slots=E // D + 1)     # spare slots for replicas
    opt = HomeRowsAdamW(model.parameters(), home_rows(model), ...)  # AdamW on home rows
    balancer = Balancer(model, opt, policy="auto", replan_every=10)  # every rank, collective
    for batch in data:
        loss = model(batch).loss
        loss.backward()            # micro-batches before the last: inside `balancer.no_sync()`
        sync_router_grads(model)   # + the data-parallel all-reduce of other non-expert gradients
        balancer.reduce_replicas() # Agg: replica gradients summed into their homes; counts
        clip_grad_norm_(...)       # anything that reads expert gradients comes after it
        opt.step()
        balancer.step()            # the step boundary: adopt a plan, or launch Trans
        opt.zero_grad()

The training loop names both calls, as vLLM's engine steps its EPLB state; `reduce_replicas` is
idempotent within a step and `step` calls it if the loop did not. Hooks remain only where they
buy overlap: forward hooks record counts and wait for Trans just before a layer runs, gradient
hooks launch Agg as soon as a layer's expert gradients are ready (`overlap=False`: both at the
step boundary). `hooks=True` is a legacy mode that registers `reduce_replicas` as an optimizer
step pre-hook and `step` as a post-hook, for loops that cannot call them.

Each step:

- the layers' `last_counts[E]` (tokens this rank routed to each expert) are accumulated on their
  device over the step's forwards (no host synchronisation in forward), then gathered
  (`all_gather`, with each rank's non-finite flag and its phase timings) at `reduce_replicas`,
  so every rank holds `counts[L, D, E]` and one figure per phase for all ranks
  (`selfcal.across_ranks`); a window of the last `history` steps is kept. A NaN or infinity
  any layer saw on any rank raises `NonFiniteInputError` there, on every rank, before the
  optimizer steps;
- `reduce_replicas`: Agg (replica gradients summed into their homes, zeroed);
- `step`: every `replan_every` steps the leader (rank 0 of the vote group) requests a plan from
  its background planner (`poise.runtime.planner.background`, a worker process, running
  `poise.runtime.planning_job`; `poise.runtime.planner.broadcast`): it fits the cost
  model's constants to the measured phases (`poise.runtime.selfcal.fit`), forecasts `[L, D, E]`
  from the window and runs the policy (each expert's home then re-chosen among its holders:
  `poise.runtime.moves.homes`), while training goes on. The plan is decided `plan_lag`
  steps later, at the same step boundary on every rank (the leader waits for its planner there
  if it must, the others for the leader's broadcast; `plan_lag=0` plans at once); later
  requests are decided as many steps later as the last job took (`planner.adoption_lag`, at
  least `plan_lag`; the leader broadcasts it with its decision), and a re-plan due while a
  plan is still in flight is skipped (a planner slower than `replan_every` steps stretches the
  interval rather than stalling a step). The guard (`poise.runtime.guard`) adopts it only when
  its predicted saving over the re-plan horizon exceeds the switch's measured cost by a margin,
  skips it when it equals the plan in force, and falls back to the static layout when a plan in
  force does not make steps faster; the leader broadcasts its decision with the plan
  (`check_plans`: every rank also plans and compares the plan's digest, `PlanMismatchError` if
  they disagree). An adopted plan takes effect at once: `migrate` (weights and AdamW moments to
  new homes, replicas filled) and the layers' new routings. Otherwise Trans refreshes the
  replicas, launched asynchronously and awaited by each layer before it runs; on a probe step's
  boundary (`probe_every`) the layers take the plan's homes-only routing for one step instead,
  and the next boundary restores the plan's and launches its Trans.

The planning half (`_request`, `_decide` with the leader's outcome, `_switch`, `verify_plan`)
is `poise.runtime.plan_cycle.PlanCycle`, which the Balancer mixes in; this module keeps the
layers' hooks, the step boundary, the gathered loads and `apply`.

Replica rows are never the master copy: homes carry weights and optimizer state, and the
optimizer's mathematics on them is static EP's, so balanced and static runs give the same losses
and parameters up to float summation order.

Compressed migration (HybridEP's parameter-efficient migration, off by default): with
`compression=ratio`, Trans and the replica fills of a migration send each replica as the
layer's shared expert plus the top-`ratio` share of its residual (`poise.runtime.hybridep.compress`,
`poise.runtime.moves.compressed_trans`). Replicas then compute with approximate weights, so the
losses
are no longer static EP's; homes, their optimizer state and Agg are unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.nn.moe import find_moe_layers
from poise.plan.predict import Predictor, parse_predictor
from poise.plan.retarget import retargeted
from poise.runtime.balancer_setup import check_settings, initial_plan, layer_slots
from poise.runtime.guard import SwitchGuard
from poise.runtime.hybridep.compress import Compression
from poise.runtime.moves.host_link import HostLink
from poise.runtime.moves.layer_moves import LayerMoves
from poise.runtime.moves.layer_state import LayerState, expert_params
from poise.runtime.moves.transfer_group import transfer_group as own_transfer_group
from poise.runtime.plan_cycle import PlanCycle, PlanMismatchError
from poise.runtime.plan_inputs import default_cluster, prior_cluster, spec_from_layers
from poise.runtime.planner.background import BackgroundPlanner
from poise.runtime.planner.broadcast import is_leader
from poise.runtime.planning_job import run_job
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
from poise.runtime.step_gather import gather_step
from poise.runtime.untimed import UNTIMED, UntimedWindows, free_settings
from poise.runtime.verdict import MIN_PROBES, Verdict

LAYER_PHASES = ("gate", "dispatch", "experts", "combine")


class Balancer(PlanCycle):
    """Records loads, plans and applies plans for every `poise.nn.MoE` layer of `model`.

    - `policy`: a registered policy name (`auto`, `static`, `shadow`, `prophet`, `vexpert`,
      `eplb`, `permute`, `hybrid`);
    - `replan_every`: request a plan every K steps (the first after K observed steps);
    - `plan_lag`: a plan requested at step s is decided at step s + plan_lag (0 <= plan_lag <=
      replan_every; 0: planned and decided at the same boundary, on the training thread);
    - `cluster`: the modelled cluster the cost model prices: a `Cluster`, a preset name or a
      YAML path (the file `poise calibrate` writes); default `default_cluster(D)`, with the
      world's ranks sharing this host's cores, and one link for their bulk bytes, where they
      are CPU processes. It is the prior of the self-calibration (`calibrate`);
    - `spec`: the model shape (default: from the layers, `spec_from_layers`; tokens per device
      from the observed counts);
    - `predictor`: `Predictor` or its text form (`ema`, `window:20`, `last`);
    - `options`: per-policy settings (`auto`'s horizon is at least `replan_every`,
      `auto.base_horizon`, and as long as the load pattern has held: `poise.plan.persistence`);
    - `history`: steps of counts kept for the predictor and the policies' look-back;
    - `guard`: adopt a plan only when it pays, fall back to the static layout when it does not
      (`poise.runtime.guard`), and plan homes only where the ranks share their cores
      (`PlanCycle.cores_shared`); False: adopt every plan that differs from the one in force;
      `guard_margin`: the switch must be paid (1 + margin) times; `guard_horizon`: steps a plan
      is expected to serve (default `replan_every`; an `auto` plan's own horizon where longer);
    - `calibrate`: fit the cluster's compute, transfer and dispatch constants to this run's
      measured phases (`poise.runtime.selfcal.fit`) and plan with the fitted cluster;
      `probe_transfers` (with `calibrate`, a balancing policy and more than one rank): time one
      migration's worth of bulk traffic at start-up (`poise.runtime.selfcal.probe`, collective) and
      start `k_transfer` there instead of at the prior's 1, and time a synthetic switch's
      migration (`probe.probe_switch_scale`: half a rank's experts with their moments through
      `transfers.migrate`), the first switch's price until one is measured;
    - `plan_process`: plan in a worker process (`poise.runtime.planner.background`: a planning
    thread
      would hold the interpreter lock the training thread needs between its tensor operations);
      False: on a thread of this process;
    - `hooks`: legacy mode: run `reduce_replicas`/`step` from optimizer step hooks;
    - `overlap`: launch Agg from gradient hooks and wait for Trans in each layer's forward
      (else both run at the step boundary);
    - `check_plans`: every rank plans too and compares its plan's hash with the leader's
      (`PlanMismatchError`): a determinism check that costs each rank the planning (off: only
      the leader plans, `poise.runtime.planner.broadcast`);
    - `vote_group`: the ranks that must take the same decisions (default the Balancer's group;
      the world when several EP groups must keep the same layout): its rank 0 is the leader,
      which plans and decides for all; measurements are then also reduced over it;
    - `compression`: None (default: replicas get the exact weights), or a ratio in (0, 1] (or a
      `Compression`): replicas get the shared expert plus that share of their residual's
      entries (HybridEP's compressed migration; it changes the mathematics);
    - `split_tokens` (default on): within a plan, each step's tokens of a replicated expert are
      split among its holders by that step's actual counts, a holder shedding some of its own
      tokens to the others where that levels them (`Assignment.by_counts`,
      `poise.core.token_split`; the planner prices plans so too); off: by the plan's fixed
      shares, holders keeping their own;
    - `holdout` (default on; with the guard only): the run's first re-plan (and the first
      after a resume), which has no earlier candidate to backtest, may adopt a homes-only plan
      that a holdout vouched for (`planning_job.holdout`: made from the window's older half,
      priced on its newer half); off, the first adoption of a homes move waits for a backtest,
      at the second re-plan at the earliest (with `retarget`, a replica trial on the homes in
      force needs none: `planning_job.run_job`, step 6). On for loads that hold still from the
      first step (a replayed trace: `benchmarks/ep_step.py`); `poise train` turns it off by
      default (the training setting `holdout`: a router trained from scratch still moves in
      its first steps);
    - `recheck` (default on; with the guard only): a candidate refused as `unsettled` (from the
      static layout, with no backtest yet that its forecast held: `leader`, rule 3) is asked
      again half a period later: the re-plans shift so that the next request comes
      `replan_every // 2` steps after the refused one (its backtest then covers those steps)
      and every `replan_every` steps from there (`replan_phase`); off, the next backtest waits
      a whole period. Once a run (the first refusal: the run's first re-plan has no earlier
      candidate to backtest), and not where the refused decision came later than that point
      (a lag above half a period);
    - `retarget` (default on): under a plan with replicas, each step boundary (but a switch's
      or a probe's) re-chooses the plan's replicas from the counts of the step just run, the
      homes staying and the plan's number of replicas over all layers at most
      (`poise.plan.retarget`): a replica's weights travel every step anyway, so which expert
      it copies follows the router at no cost in bytes, and the per-step split then levels
      each step as well as those replicas allow; the layers run `routed`, the guard judges
      `plan`; off: the plan's own replicas until the next plan;
    - `probe_every` (default 5; 0: off; with the guard only) and `max_probes` (default 8): while
      a plan with replicas is in force, one step in `probe_every` runs on the plan's homes
      without its replicas (no Trans before it, no Agg in it; nothing moves), up to
      `max_probes` such steps since plans with replicas took over, and none once the clock is
      conclusive on them (`verdict.clock_settled`). Each probe step against its
      neighbours measures what the replicas save on this machine's clock, paired so that the
      machine's drift cancels (`paired_clock.paired_clock`); the guard's clock test then uses them
      instead of the static steps of the run's start. Each probe step forgoes the replicas'
      saving once;
    - `host_link` (default off): where every rank of the group is a CPU process on this host
      (gloo), Trans, Agg and migrations move their rows through shared memory
      (`poise.runtime.moves.host_link`) instead of gloo's sockets (calls above
      `transfers.LINK_MAX_BYTES` a rank through the group). It halves a layer's Trans and Agg
      in isolation and takes a migration in a fifth to a third of gloo's time
      (`benchmarks/migrate.py`); off by default: in paired training runs it was ahead of gloo
      in 16 rounds of 25, not in every setting (docs/benchmarks.md);
    - `separate_transfers` (default on): Trans, Agg and migration run on a process group of
      their own over the same ranks (`poise.runtime.moves.transfer_group`; made here, collectively,
      where `group` spans the world), so that they do not queue ahead of the tokens'
      all-to-alls in the group's order of operations; `transfer_group`: that group, given by
      a caller that made it (`LayoutGroups.ep_transfer`); off and none given: `group`;
    - `free_balancing` (default off; needs `guard` off): a timing oracle for benchmarks
      (`poise.runtime.untimed`): Agg, planning, migration and Trans run at the step boundary
      (`overlap` off, `plan_lag` 0) and their seconds are left out of the step's time
      (`untimed_s`), so a run measures what the policy's balance is worth with its transfers
      free; the mathematics stays static EP's;
    - `total_steps` (default None: not known): the step the run ends at (`steps_done` counts
      from the run's start, a resumed run included). A plan is requested only if it would
      serve a step before then, and priced and judged over no more steps than it would serve
      (`PlanningJob.steps_left`): a home moved near the end pays back nothing past it.

    Statistics: `stats` (one `StepStats` per step, the newest last; `last_stats`); `steps_done`,
    `switches` (plans that took effect), `fit` (the latest `selfcal.Fit`)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: str = "auto",
        replan_every: int = 10,
        *,
        plan_lag: int = 1,
        cluster: Cluster | str | None = None,
        spec: ModelSpec | None = None,
        predictor: Predictor | str = "ema",
        options: Mapping[str, Mapping[str, Any]] | None = None,
        history: int = 100,
        guard: bool = True,
        guard_margin: float = 0.2,
        guard_horizon: int | None = None,
        calibrate: bool = True,
        probe_transfers: bool = True,
        plan_process: bool = True,
        hooks: bool = False,
        overlap: bool = True,
        check_plans: bool = False,
        group: dist.ProcessGroup | None = None,
        vote_group: dist.ProcessGroup | None = None,
        keep_stats: int = 10_000,
        compression: Compression | float | None = None,
        split_tokens: bool = True,
        probe_every: int = 5,
        max_probes: int = 8,
        host_link: bool = False,
        separate_transfers: bool = True,
        transfer_group: dist.ProcessGroup | None = None,
        total_steps: int | None = None,
        free_balancing: bool = False,
        holdout: bool = True,
        recheck: bool = True,
        retarget: bool = True,
    ) -> None:
        overlap, plan_lag = free_settings(free_balancing, guard, overlap, plan_lag)
        check_settings(policy, replan_every, plan_lag, probe_every, max_probes, total_steps)
        modules = find_moe_layers(model)
        if not modules:
            raise ConfigError("the model has no poise.nn.MoE layer", field="model")
        self.model = model
        self.optimizer = optimizer
        self.policy = policy
        self.replan_every = replan_every
        self.plan_lag = plan_lag
        self.total_steps = total_steps
        self.lag = plan_lag  # steps from the next request to its decision (adoption_lag)
        self.group = group if group is not None else modules[0].group
        self.vote_group = vote_group
        self.world_size, self.rank = modules[0].world, modules[0].rank
        self.layers = [LayerState(m, i) for i, m in enumerate(modules)]
        self.slots = layer_slots(self.layers)
        on_cpu = self.layers[0].params[0].device.type == "cpu"
        self.cluster = prior_cluster(cluster, self.world_size, on_cpu)
        self.fitted_cluster = self.cluster
        self.fit = selfcal.Fit()
        self.calibrate = calibrate
        self._spec = spec
        self.balancing = policy != "static"  # static EP never probes, plans or switches
        # Trans, Agg and migration: their own queue of collectives
        # (`poise.runtime.moves.transfer_group`)
        self.transfers_pg = transfer_group
        if self.transfers_pg is None:
            separate = separate_transfers and self.balancing and self.world_size > 1
            self.transfers_pg = own_transfer_group(self.group) if separate else self.group
        self.num_experts = modules[0].num_experts
        self.predictor = parse_predictor(predictor) if isinstance(predictor, str) else predictor
        self.options = {k: dict(v) for k, v in (options or {}).items()}
        self.options.setdefault("auto", {}).setdefault("base_horizon", replan_every)
        self.check_plans = check_plans
        self._vote_pg = vote_group if vote_group is not None else self.group
        self.leader = is_leader(self._vote_pg)  # plans and decides for every rank
        self._plans_here = self.leader or check_plans
        self._due_at: int | None = None  # the step boundary where the next decision is taken
        self._requested_at: int | None = None  # the boundary of the last request
        self.replan_phase = 0  # re-plans are due where steps_done % replan_every == this
        self.split_tokens = bool(split_tokens)
        self.overlap = overlap
        self.untimed = UntimedWindows(free_balancing and self.balancing, self.group)
        self.guard = SwitchGuard(guard_horizon or replan_every, guard_margin, enabled=guard)
        # probe steps serve the guard (`poise.runtime.probe_steps`)
        self.probes = ProbeSteps(int(probe_every) if guard else 0, int(max_probes))
        self.holdout = bool(holdout)  # the first re-plan may vouch by a holdout (PlanningJob)
        self.recheck = bool(recheck) and guard  # an `unsettled` refusal is asked again sooner
        # the plan's replica slots follow each step's hot experts (`poise.plan.retarget`)
        self.retarget_replicas = bool(retarget) and self.balancing
        # the planner takes CPU from the ranks where they compute on the cores
        self._planner_shares_cores = on_cpu
        self.compression = Compression.parse(compression)
        self.link = (
            HostLink.connect(self.transfers_pg) if host_link and on_cpu and self.balancing else None
        )
        # routing, Trans, Agg and migration on the layers (`poise.runtime.moves.layer_moves`)
        self.moves = LayerMoves(
            self.layers, self.rank, self.slots, optimizer, self.transfers_pg,
            link=self.link, compression=self.compression, overlap=overlap,
        )  # fmt: skip
        self.probe: tuple[float, float, float] | None = None  # (k, measured s, modelled s)
        # (k_switch, measured s, modelled s, homes a rank moved): the first switch's price
        self.switch_probe: tuple[float, float, float, int] | None = None
        if calibrate and probe_transfers and self.balancing and self.world_size > 1:
            shapes = spec if spec is not None else spec_from_layers(modules)
            self.probe, self.switch_probe = start_up_probes(
                self.cluster, shapes, self.transfers_pg, self.layers[0].params[0].device,
                link=self.moves.migrate_channel(), scratch=self.moves.scratch,
            )  # fmt: skip
            self.fit = selfcal.Fit(k_transfer=self.probe[0])
        # the planning worker starts after the probes, which it would slow, and starts up
        # while the first steps run
        self.planner = BackgroundPlanner(plan_process, preload=(run_job.__module__,))
        if self._plans_here and self.balancing:
            self.planner.start()
        # per step: counts, measured seconds, layout, settled (`poise.runtime.records`)
        self.records = StepRecords(history)
        # its rows, by their names here (the same deques; changed in place, never replaced)
        self.window = self.records.window  # [L, D, E] per step
        self.measured = self.records.measured  # [step, *selfcal.MEASURED] per measured step
        self.row_layout = self.records.layout
        self.row_settled = self.records.settled
        self.stats: deque[StepStats] = deque(maxlen=keep_stats)
        self.steps_done = 0
        self.switches = 0
        self.plan = initial_plan(self.layers, self.slots, self.rank, self.split_tokens, self.spec())
        self.static_plan = self.plan  # the layout to fall back to
        self.routed = self.plan  # what the layers run: `plan`, its replicas retargeted
        self._shapes: ModelSpec | None = None  # the spec retargeting prices bytes with
        self._layout = STATIC  # what `plan` is, for `row_layout` (set where `plan` changes)
        self._plan_since = 0  # first step run under `plan`
        self._last_candidate: tuple[int, Plan] | None = None  # (requested at, plan): backtests
        self._pattern: tuple[int, int] | None = None  # (requested at, `auto`'s pattern age)
        self._replicas_timed = False  # the paired clock has timed a plan with replicas
        self._switch_check: tuple[int, float, float] | None = None  # (step, modelled s, wait s)
        self._t_reduce: float | None = None  # when the last `reduce_replicas` had its Agg
        self._paused_at: float | None = None  # when `pause` handed the host to another run
        self._boundary_s = 0.0  # this rank's seconds in the last `step`
        self._migrate_s = 0.0  # ... of them moving homes (a switch's migration)
        self._current = StepStats(step=0, policy=policy)
        self._prepared = False
        self._accumulating = False  # inside `no_sync`: a micro-batch before the step's last
        self._handles: list[Any] = []
        self.moves.route(self.plan)
        for state in self.layers:  # replicas of the initial routing start from their homes
            if state.has_replicas:
                self.moves.start_trans(state, refresh=True).wait()
        self._register_layer_hooks()
        if hooks:
            self._handles.append(
                optimizer.register_step_pre_hook(lambda *_: self.reduce_replicas())
            )
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self.step()))

    # ----------------------------------------------------------------------------- set-up
    def spec(self) -> ModelSpec:
        """The model shape the planner prices, tokens per device from the counts seen so far."""
        if self._spec is not None:
            return self._spec
        tokens = 1
        if self.window:
            top_k = self.layers[0].layer.top_k
            tokens = int(np.mean([c[0].sum() for c in self.window]) / (self.world_size * top_k))
        return spec_from_layers([s.layer for s in self.layers], tokens)

    def _register_layer_hooks(self) -> None:
        for state in self.layers:
            self._handles.append(
                state.layer.register_forward_hook(lambda m, a, o, s=state: self._record(s))
            )
            if not self.overlap:
                continue
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

    def close(self) -> None:
        """Finish transfers in flight, drop a plan in flight and remove every hook the Balancer
        registered."""
        self.moves.wait_all(self._current)
        self.planner.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def pause(self) -> None:
        """Between steps, before this run hands its host to another (`poise.train.turns`):
        Trans in flight lands now (its wait counted in the next step's transfers, as in the
        forward that would have waited for it) and the planner's worker stops, so nothing of
        this run works on the other's time. `resume` undoes it."""
        self.moves.wait_all(self._current)
        self.planner.pause()
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """This run holds the host again: the planner goes on, and the step period measured at
        the next boundary leaves out the seconds spent paused."""
        if self._paused_at is None:
            return
        if self._t_reduce is not None:
            self._t_reduce += time.perf_counter() - self._paused_at
        self._paused_at = None
        self.planner.resume()

    # ------------------------------------------------------------------------ layer hooks
    def _record(self, state: LayerState) -> None:
        """Forward hook: add the layer's `last_counts[E]` to this step's counts (on the layer's
        device: no host synchronisation) and its phase seconds (`last_forward.seconds`: gate,
        dispatch, experts, combine) to the step's statistics."""
        if not state.layer.training:
            return
        counts = state.layer.last_counts.detach()
        state.counts = counts.clone() if state.counts.numel() == 0 else state.counts + counts
        state.rows += int(state.layer.last_forward.rows)
        for phase, seconds in state.layer.last_forward.seconds.items():
            if phase in LAYER_PHASES:
                self._current.add_seconds(phase, float(seconds))

    def _grad_ready(self, state: LayerState, index: int) -> None:
        """Gradient hook: once all of a layer's expert tensors have their gradient from this
        backward, launch its Agg (not inside `no_sync`: a later micro-batch adds to them)."""
        state.grads_ready.add(index)
        if len(state.grads_ready) < len(state.params):
            return
        state.grads_ready.clear()
        if state.has_replicas and not self._accumulating:
            self.moves.launch_agg(state, self._current, in_compute=True)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of micro-batches before a step's last (gradient accumulation, as
        `DistributedDataParallel.no_sync`): the replicas' gradients add up and no Agg is
        launched; the last micro-batch's backward, outside this context, launches each
        layer's Agg on the step's sum (or `reduce_replicas` does, `overlap=False`). Counts and
        phase seconds add up over the micro-batches' forwards; Trans is awaited by the first."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    # ---------------------------------------------------------------------- step boundary
    def reduce_replicas(self) -> None:
        """After `backward`, before anything reads expert gradients (clipping, norms, the
        optimizer): Agg (finish those launched from gradient hooks, run the rest), gather the
        step's counts, flags and timings; raise `NonFiniteInputError` on every rank if any
        layer saw NaN or infinity. Collective; idempotent within a step."""
        if self._prepared:
            return
        free = self.untimed.start()
        self.moves.finish_aggs(self._current)
        self.untimed.end(self._current, free)
        t_end = time.perf_counter()  # the period holds the step's own Agg (`paired_clock`)
        period = 0.0 if self._t_reduce is None else t_end - self._t_reduce
        self._t_reduce = t_end
        self._gather(period)
        self._prepared = True

    def step(self) -> StepStats:
        """The step boundary, after `optimizer.step()`: decide a plan that is due (adopt it,
        skip it, or fall back to the static layout), request the next plan every
        `replan_every` steps, otherwise launch Trans for the next forward. Calls
        `reduce_replicas` first if the loop did not. Collective; returns the step's stats."""
        self.reduce_replicas()
        free = self.untimed.start()
        t0 = time.perf_counter()
        self.steps_done += 1
        s = self.steps_done
        stats = self._current
        if self.probes.probing is not None:
            self._end_probe()
        switched = self._due_at is not None and s >= self._due_at and self._decide(stats)
        due = bool(self.balancing and self.replan_due_at(s) and self.window)
        due = due and self.steps_left(s) != 0
        if due:
            self.guard.replan_due()
        # one plan in flight at a time: a slow planner stretches the interval (every rank
        # knows `_due_at`: the lag is the leader's, broadcast with its decisions)
        if due and self._due_at is None and not self.guard.skip_replan():
            self._request(s)
            if self._due_at == s:  # plan_lag 0
                switched = self._decide(stats) or switched
        if not switched and self._probe_due(s):
            self._begin_probe()
        if not switched:
            self._refresh_replicas(stats)
        self._boundary_s = time.perf_counter() - t0
        self._migrate_s = stats.seconds.get("migrate", 0.0)  # only a switch migrates
        stats.add_seconds("boundary", self._boundary_s)
        self.untimed.end(stats, free)
        self.stats.append(stats)
        self._current = StepStats(step=self.steps_done, policy=self.policy)
        self._current.probe = self.probes.probing is not None
        self._prepared = False
        return stats

    def _refresh_replicas(self, stats: StepStats) -> None:
        """Launch the replicas' Trans for the next forward; first, with `retarget` (off a probe
        step), re-choose the plan's replicas from the counts of the step just run
        (`poise.plan.retarget`: homes stay, so only the routing changes; every rank derives
        the same from the same gathered counts)."""
        if self.retarget_replicas and self._layout == REPLICAS and self.probes.probing is None:
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

    # ------------------------------------------------------------------------ probe steps
    def note_verdict(self, verdict: Verdict | None) -> None:
        """A verdict shared by the leader (every rank gets the same): once one is conclusive on
        the episode's probes (`verdict.clock_settled`), no more probe steps until plans with
        replicas take over again. One read from `MIN_PROBES` probes or more means the clock
        has timed replicas in this run (`leader`'s `unjudged`)."""
        self.probes.note_verdict(verdict)
        if verdict is not None and verdict.probes >= MIN_PROBES:
            self._replicas_timed = self._replicas_timed or verdict.wall_saving_s is not None

    def _probe_due(self, step: int) -> bool:
        """Whether the step after boundary `step` is a probe step (`ProbeSteps.due`: a plan
        with replicas in force, on the cadence; only while balancing). The same on every
        rank."""
        return self.balancing and self.probes.due(step, self._layout == REPLICAS, self._plan_since)

    def _begin_probe(self) -> None:
        """Run the next step on the plan's homes without its replicas (`ProbeSteps.begin`)."""
        if self.probes.begin(self.plan, self.spec(), self.moves):
            self._layout = PROBE

    def _end_probe(self) -> None:
        """Back to the plan's routing after a probe step (`ProbeSteps.end`)."""
        self.probes.end(self.routed, self.moves)
        self._layout = REPLICAS

    @property
    def last_stats(self) -> StepStats | None:
        return self.stats[-1] if self.stats else None

    @property
    def untimed_s(self) -> float:
        """Seconds of the last step that free balancing leaves out of its time (0 otherwise)."""
        last = self.last_stats
        return 0.0 if last is None else last.seconds.get(UNTIMED, 0.0)

    # ----------------------------------------------------------------------------- loads
    def _gather(self, period_s: float) -> None:
        """All ranks' counts of this step, `[L, D, E]`, appended to the window, with the
        seconds (`selfcal.across_ranks`) per `selfcal.MEASURED` column; non-finite flags raise
        here (`poise.runtime.step_gather`: one `all_gather`)."""
        sec = self._current.seconds
        mine = [
            period_s,
            self._boundary_s,
            sec.get("gate", 0.0),
            sec.get("dispatch", 0.0) + sec.get("combine", 0.0),
            sec.get("experts", 0.0),
            sec.get("transfers", 0.0),
            self._migrate_s,
        ]
        g = gather_step(
            self.layers, self.num_experts, mine, self.group, self.world_size,
            self.steps_done + 1, self.vote_group,
        )  # fmt: skip
        self._current.rank_seconds = {
            name: g.rank_seconds[:, i].tolist() for i, name in enumerate(selfcal.MEASURED)
        }
        running = self.probes.probing if self.probes.probing is not None else self.routed
        self.records.append(
            g.counts,
            np.concatenate([[self.steps_done], g.measured]),
            self._layout,
            self.steps_done > self._plan_since,
            g.rank_experts,
            np.argwhere(running.placement.replicas()),
        )
        self._current.measured_period_s = float(g.measured[selfcal.PERIOD])
        self._current.layout = LAYOUT_NAMES[self._layout]
        planned = layer_loads(running.placement, running.assignment, g.counts)
        self._current.set_loads(planned.measured(g.computed))

    def apply(self, plan: Plan, stats: StepStats | None = None) -> None:
        """Make `plan` the routing of every layer now (`LayerMoves.relay`: homes migrate with
        their optimizer state where their slots change, every layer takes its new routing, and
        the replicas' Trans is launched as a step boundary does) and note what kind of layout
        it is; one without replicas ends the probe steps' episode. Collective."""
        stats = stats if stats is not None else self._current
        self.moves.relay(plan, stats)
        self.plan = plan
        self.routed = plan
        if plan.digest() == self.static_plan.digest():
            self._layout = STATIC
        else:
            self._layout = REPLICAS if plan.placement.replicas().any() else OTHER
        if self._layout != REPLICAS:
            self.probes.new_episode()


__all__ = [
    "Balancer",
    "PlanMismatchError",
    "default_cluster",
    "expert_params",
    "spec_from_layers",
]
