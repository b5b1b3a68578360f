"""Pricing and ranking SmartMoE layouts (`poise.layouts.pool.Layout`) on a load distribution, and
the
re-placement of experts inside a layout (its online `permute`). NumPy only.

Costs of one training step (seconds; `price_layout`):

- Dispatch, combine, expert and non-MoE compute of each stage's layers: `cost.CostModel` on the
  stage's devices (a sub-cluster of Ds devices) and the layout's placement (`Layout.placement`:
  every token stays in its EP group), on the step's loads, per layer (slowest device), combined
  by the schedule (`schedule.Schedule.layer_time`). Trans and Agg are zero: EDP copies are not
  refreshed from a home, they all-reduce instead:
      T_stage[s] = sum_{l in s} layer_time(l)
  EP groups exchange nothing, so `stage_phases` prices each group on its own ep devices with
  its own sources' loads and takes the slowest group per phase: the figures of pricing the whole
  stage's placement at once (tests/test_layouts.py checks it), without its Ds x E routing arrays.
- Pipeline (GPipe, Huang et al. NeurIPS 2019; 1F1B, Narayanan et al. SC '21): with m
  micro-batches, (m + pp - 1) micro-batch slots of the slowest stage, so
      T_pipe = max_s T_stage[s] * (m + pp - 1) / m,    bubble = T_pipe - max_s T_stage[s]
  plus the point-to-point activations on the fill and drain critical path, one micro-batch of
  b = (tokens per stage device / m) * B_t bytes per hop over the stage-to-stage link level:
      T_p2p = 2 (pp - 1) (b / bw + lat)
- EDP all-reduce of expert gradients, V = (L / pp) (E / ep) W_e bytes over the edp copies,
  and the data-parallel all-reduce of the dense gradients, V = (L / pp) P_d B_dtype over the Ds
  devices of a stage, where P_d = F_d / 2 is the dense parameters per block estimated from the
  block's non-MoE forward FLOPs per token F_d (`ModelSpec.non_moe_flops_fwd`, 2 FLOPs per
  multiply-add): hierarchical all-reduces, each level the faster of a ring,
  2 (n - 1) / n * V / bw + 2 (n - 1) lat, and a binary tree, 2 V / bw + 2 ceil(log2 n) lat
  (`poise.cost.collectives`, with sources). Both are charged in full (not hidden under
  backward).
- The rest of the step's work outside the layers, as the simulator charges it
  (`poise.cost.step_overheads`: the routing counts' gather, the global gradient norm with
  clipping and the optimizer step), for the P = (L / pp) ((E / ep) P_e + P_d) parameters a
  device of the layout holds; its dense all-reduce is T_dp + T_edp above:
      T_out = T_counts + T_clip + T_opt
      T_step = T_pipe + T_p2p + T_edp + T_dp + T_out
  So a layout without a pipeline or EDP copies (pp = 1, ep = D) prices as `simulate` prices the
  `static` policy with the model's dense parameters charged (`dense_params`) under the same
  schedule, step by step (tests/test_layouts.py checks it; with measured host costs the
  simulator's P also counts its spare slot per device); a pipeline adds its bubble and p2p.
- m, the micro-batches per step: `LayoutSettings.micro_batches`, or per layout from a fixed
  global batch (`LayoutSettings.micro_batch_tokens`, Megatron-LM's gbs / (mbs dp)).

The ranking key is the mean of T_step over the trace's steps (the expectation of the step time
under the load distribution, not the step time of the mean load: the slowest device's max is
convex in the loads). With `online=True` each layout is priced with the expert placement its
online `permute` would choose for the trace's mean expert loads (SmartMoE prices layouts with the
adaptive placement in mind); `static_s` keeps the contiguous placement.

Worked example (tests/test_layouts.py): 8 devices in one node, 8 experts, uniform loads and
experts large against the tokens: the EDP all-reduce costs more than the all-to-all it saves,
so pure EP (`ep=8`) ranks first; every token on expert 0 and a cheap all-reduce: `ep=1` (eight
replicas of the whole expert set, no all-to-all) ranks first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec
from poise.cost.collectives import hierarchical_allreduce_s
from poise.cost.model import CostModel
from poise.cost.network import fair_share_links
from poise.cost.phases import PhaseTimes
from poise.cost.schedule import Schedule
from poise.cost.step_overheads import StepWork, step_overheads
from poise.layouts.pool import (
    Layout,
    LayoutSettings,
    enumerate_layouts,
    layout_problem,
    memory_bytes,
    sub_cluster,
)
from poise.plan.policies.base import PlanContext
from poise.plan.policies.registry import make_plan
from poise.trace.loads import fit_devices


# ------------------------------------------------------------------------------- pricing
@dataclass
class LayoutCost:
    """A layout priced on a load distribution. Seconds per training step; `steps_s[S]` per
    priced step, the others means over those steps (phases of the slowest stage, forward plus
    backward)."""

    layout: Layout
    step_s: float
    worst_s: float
    static_s: float
    a2a_s: float
    expert_s: float
    non_moe_s: float
    bubble_s: float
    p2p_s: float
    edp_allreduce_s: float
    dp_allreduce_s: float
    memory_bytes: float
    homes: np.ndarray = field(repr=False)  # [L, E] group-local homes the price assumes
    steps_s: np.ndarray = field(repr=False)
    outside_s: float = 0.0  # T_out: counts gather, clipping, optimizer (module docstring)
    micro_batches: int = 1  # m the pipeline term used

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.layout.to_dict(),
            "name": self.layout.name,
            "step_s": self.step_s,
            "worst_s": self.worst_s,
            "static_s": self.static_s,
            "a2a_s": self.a2a_s,
            "expert_s": self.expert_s,
            "non_moe_s": self.non_moe_s,
            "bubble_s": self.bubble_s,
            "p2p_s": self.p2p_s,
            "edp_allreduce_s": self.edp_allreduce_s,
            "dp_allreduce_s": self.dp_allreduce_s,
            "outside_s": self.outside_s,
            "micro_batches": self.micro_batches,
            "memory_bytes": self.memory_bytes,
            "homes": self.homes.tolist(),
        }


def _span_level(cluster: Cluster, first: np.ndarray, last: np.ndarray) -> int:
    """The highest link level between `first[i]` and `last[i]` (0 when all are equal)."""
    return max(0, int(np.max(cluster.level_between(first, last))))


def allreduce_times(layout: Layout, cluster: Cluster, spec: ModelSpec) -> tuple[float, float]:
    """`(T_edp, T_dp)` seconds per step (module docstring): `hierarchical_allreduce_s` for the
    EDP group of position 0 (the ep positions' groups run at once; those with members in
    a node share its links) and for one stage's dense all-reduce."""
    Ds, ep, edp = layout.stage_devices, layout.ep, layout.edp
    Ls = layout.layers_per_stage
    t_edp = 0.0
    if edp > 1:
        members = np.arange(edp) * ep
        in_node = np.arange(min(cluster.devices_per_node, Ds)) % ep
        nbytes = Ls * layout.experts_per_device * spec.expert_bytes
        t_edp = hierarchical_allreduce_s(cluster, members, nbytes, len(np.unique(in_node)))
    t_dp = 0.0
    if Ds > 1:
        nbytes = Ls * spec.dense_params_per_block * spec.dtype_bytes
        t_dp = hierarchical_allreduce_s(cluster, np.arange(Ds), nbytes)
    return t_edp, t_dp


def outside_time(layout: Layout, cluster: Cluster, spec: ModelSpec) -> float:
    """T_out (module docstring): `step_overheads` without its dense all-reduce (the layout's
    own T_dp and T_edp replace it), for the (L / pp) ((E / ep) P_e + P_d) parameters one device
    of `layout` holds and the L E routing counts of a step."""
    params = layout.layers_per_stage * (
        layout.experts_per_device * spec.expert_params + spec.dense_params_per_block
    )
    work = StepWork(0, int(params), float(spec.dtype_bytes), 8.0 * layout.layers * spec.experts)
    terms = step_overheads(cluster, work)
    return float(sum(v for k, v in terms.items() if k != "grad_allreduce_s"))


def p2p_time(layout: Layout, cluster: Cluster, spec: ModelSpec, micro_batches: int) -> float:
    """T_p2p = 2 (pp - 1) (b / bw + lat) (module docstring); 0 without a pipeline."""
    if layout.pp == 1:
        return 0.0
    Ds = layout.stage_devices
    # Every device of a stage sends to its peer at once: each gets its fair share of a link.
    bw, lat = fair_share_links(cluster)
    v = _span_level(cluster, np.arange(Ds), np.arange(Ds) + Ds)
    tokens = spec.tokens_per_device * layout.pp / micro_batches
    return 2.0 * (layout.pp - 1) * float(tokens * spec.token_bytes / bw[v] + lat[v])


def _check_loads(loads: np.ndarray, layout: Layout, source: str = "loads") -> np.ndarray:
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 3:
        loads = loads[None]
    if loads.ndim != 4 or loads.shape[1] != layout.layers or loads.shape[3] != layout.experts:
        raise PlanError(
            f"loads must be [steps, layers={layout.layers}, devices, experts={layout.experts}], "
            f"got {loads.shape}",
            source=source,
            field="loads",
        )
    if not np.all(np.isfinite(loads)) or (loads.size and loads.min() < 0):
        raise PlanError("loads must be finite and non-negative", source=source, field="loads")
    return fit_devices(loads, layout.devices, source)


def stage_phases(
    layout: Layout,
    cluster: Cluster,
    spec: ModelSpec,
    counts: np.ndarray,
    homes: np.ndarray,
    schedule: Schedule,
) -> PhaseTimes:
    """Phase times `[N]` of N MoE layers on one stage: `counts[N, Ds, E]` tokens per stage device
    and expert, `homes[N, E]` group-local homes, `spec` already carrying the stage's tokens per
    device. Each EP group is priced on the sub-cluster of its ep devices (to its homes, no
    replicas) and each phase takes its slowest group (module docstring)."""
    N, _, E = counts.shape
    n_groups, ep = layout.edp, layout.ep
    group = sub_cluster(cluster, ep)
    if group is None:
        raise ConfigError(
            f"EP groups of {ep} devices do not nest with the cluster's nodes and domains",
            source=layout.name,
            field="ep",
        )
    per_group = counts.reshape(N * n_groups, ep, E)  # row n * n_groups + g: layer n, group g
    rows = np.repeat(np.asarray(homes, dtype=np.int64), n_groups, axis=0)  # [N n_groups, E]
    # Rows with the same homes and loads have the same phases: price each distinct row once
    # (a trace scaled up from fewer sources repeats many groups).
    key = np.ascontiguousarray(
        np.concatenate([rows.astype(np.float64), per_group.reshape(N * n_groups, ep * E)], axis=1)
    )
    as_bytes = key.view(np.dtype((np.void, key.dtype.itemsize * key.shape[1]))).ravel()
    _, first, inverse = np.unique(as_bytes, return_index=True, return_inverse=True)
    rows, per_group = rows[first], per_group[first]
    # [U, ep, E] over the U distinct rows
    copies = (rows[:, None, :] == np.arange(ep)[None, :, None]).astype(np.int32)
    placement = Placement(rows, copies, layout.experts_per_device)
    model = CostModel(group, spec, schedule)
    unique, _ = model.phases(placement, Assignment.to_home(placement), per_group)
    phases = {k: v[inverse.reshape(-1)] for k, v in unique.__dict__.items()}  # [N n_groups] each
    worst = {k: v.reshape(N, n_groups).max(axis=1) for k, v in phases.items()}
    zero = np.zeros(N)
    return PhaseTimes(**{**worst, "trans_s": zero, "agg_s": zero.copy()})


def price_layout(
    layout: Layout,
    cluster: Cluster,
    spec: ModelSpec,
    loads: np.ndarray,
    settings: LayoutSettings | None = None,
    homes: np.ndarray | None = None,
) -> LayoutCost:
    """Price `layout` on `loads[S, L, D, E]` (or one step `[L, D, E]`; D is fitted to the
    cluster, `loads.fit_devices`) with group-local `homes[L, E]` (default: the static blocks;
    the caller chooses them, e.g. `permute_in_layout`). See the module docstring for the
    formulas. Raises `ConfigError` for a layout that cannot run on the cluster."""
    settings = settings or LayoutSettings()
    problem = layout_problem(layout, cluster, spec)
    if problem:
        raise ConfigError(problem, source=layout.name, field="layout")
    loads = _check_loads(loads, layout)
    S, L, _, E = loads.shape
    pp, Ds, Ls = layout.pp, layout.stage_devices, layout.layers_per_stage
    m = settings.micro_batches_for(layout, spec)
    homes = layout.static_homes() if homes is None else np.asarray(homes, dtype=np.int64)
    if homes.shape != (L, E):
        raise PlanError(f"homes must be [{L}, {E}], got {homes.shape}", field="homes")
    counts = fit_devices(loads, Ds, "loads").reshape(S * L, Ds, E)
    stage_spec = spec.with_(tokens_per_device=spec.tokens_per_device * pp)
    phases = stage_phases(
        layout, cluster, stage_spec, counts, np.tile(homes, (S, 1)), settings.schedule
    )
    layer_s = settings.schedule.layer_time(phases).reshape(S, pp, Ls)
    stage_s = layer_s.sum(axis=2)  # [S, pp]
    slowest = stage_s.argmax(axis=1)  # [S]
    worst_stage = stage_s[np.arange(S), slowest]
    pipe = worst_stage * (m + pp - 1) / m if pp > 1 else worst_stage
    p2p = p2p_time(layout, cluster, spec, m)
    t_edp, t_dp = allreduce_times(layout, cluster, spec)
    t_out = outside_time(layout, cluster, spec)
    steps = pipe + p2p + t_edp + t_dp + t_out

    def phase_mean(*arrays: np.ndarray, scale: float = 1.0) -> float:
        total = sum(a.reshape(S, pp, Ls).sum(axis=2) for a in arrays)
        return float(np.mean(np.asarray(total)[np.arange(S), slowest]) * scale)

    p = phases
    return LayoutCost(
        layout=layout,
        step_s=float(steps.mean()),
        worst_s=float(steps.max()),
        static_s=float("nan"),
        a2a_s=phase_mean(p.dispatch_s, p.combine_s, scale=2.0),
        expert_s=phase_mean(p.expert_fwd_s, p.expert_bwd_s),
        non_moe_s=phase_mean(p.non_moe_fwd_s, p.non_moe_bwd_s),
        bubble_s=float(np.mean(pipe - worst_stage)),
        p2p_s=p2p,
        edp_allreduce_s=t_edp,
        dp_allreduce_s=t_dp,
        memory_bytes=memory_bytes(layout, spec),
        homes=homes,
        steps_s=steps,
        outside_s=t_out,
        micro_batches=m,
    )


# ------------------------------------------------------------------------------- online
def group_context(layout: Layout, cluster: Cluster, spec: ModelSpec) -> PlanContext:
    """The planning context of one EP group (ep devices, E / ep slots each), for `permute`."""
    group = sub_cluster(cluster, layout.ep)
    if group is None:
        raise ConfigError(
            f"EP groups of {layout.ep} devices do not nest with the cluster's nodes and domains",
            source=layout.name,
            field="ep",
        )
    return PlanContext.create(group, spec, slots_per_device=layout.experts_per_device)


def permute_in_layout(
    layout: Layout,
    cluster: Cluster,
    spec: ModelSpec,
    loads: np.ndarray,
    current: np.ndarray | None = None,
    history: np.ndarray | None = None,
    window: int = 10,
) -> tuple[np.ndarray, dict[str, Any]]:
    """SmartMoE's online re-placement inside `layout`: the `permute` policy on one EP group.

    `loads[L, D, E]` (D fitted to the group's ep positions; permute looks only at each expert's
    total), `current[L, E]` the group-local homes in force (default the static blocks),
    `history[S, L, E]` recent expert loads (permute's window). Returns the new group-local
    homes `[L, E]` (E / ep experts per device: permute keeps to the layout's slots) and
    permute's notes. The same homes apply in every EP group and stage, so the devices at one
    position of the EP groups keep holding the same experts and the EDP all-reduce stays a
    slot-by-slot reduction."""
    loads = np.asarray(loads, dtype=np.float64)
    L = loads.shape[0]
    ctx = group_context(layout, cluster, spec)
    ctx.history = history
    ctx.options = {"permute": {"window": int(window)}}
    group_loads = fit_devices(loads, layout.ep, "loads")
    start = layout.static_homes(L) if current is None else np.asarray(current, dtype=np.int64)
    placement = Placement.from_homes(start, layout.ep, layout.experts_per_device)
    previous = Plan(
        policy="layout",
        placement=placement,
        assignment=Assignment.to_home(placement),
        transfers=transfers_between(None, placement, spec),
    )
    plan = make_plan("permute", group_loads, previous, ctx)
    return plan.placement.home.copy(), dict(plan.notes)


def expected_loads(loads: np.ndarray, max_steps: int) -> np.ndarray:
    """At most `max_steps` evenly spaced steps of `loads[S, ...]` (first and last kept)."""
    steps = loads.shape[0]
    if steps <= max_steps:
        return loads
    idx = np.unique(np.linspace(0, steps - 1, max_steps).round().astype(np.int64))
    return loads[idx]


def price_with_online(
    layout: Layout,
    cluster: Cluster,
    spec: ModelSpec,
    loads: np.ndarray,
    settings: LayoutSettings,
    current: np.ndarray | None = None,
) -> LayoutCost:
    """`price_layout` with the static placement and, if `settings.online`, with the placement
    `permute_in_layout` picks for the mean of `loads[S, L, D, E]` starting from `current`; the
    returned cost is the online one with `static_s` filled in."""
    static = price_layout(layout, cluster, spec, loads, settings)
    if not settings.online:
        static.static_s = static.step_s
        return static
    mean = np.asarray(loads, dtype=np.float64).mean(axis=0)
    homes, _ = permute_in_layout(layout, cluster, spec, mean, current, window=settings.window)
    if np.array_equal(homes, static.homes):  # permute kept the static blocks
        static.static_s = static.step_s
        return static
    online = price_layout(layout, cluster, spec, loads, settings, homes)
    online.static_s = static.step_s
    return online


# ------------------------------------------------------------------------------- search
@dataclass
class LayoutSearch:
    """Every feasible layout priced and ranked (fastest first), the infeasible ones with their
    reasons, and the pool (the first `settings.pool` ranked)."""

    ranked: list[LayoutCost]
    rejected: list[tuple[Layout, str]]
    settings: LayoutSettings
    steps_priced: int

    @property
    def pool(self) -> list[LayoutCost]:
        return self.ranked[: self.settings.pool]

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "settings": {
                "pool": s.pool,
                "micro_batches": s.micro_batches,
                "micro_batch_tokens": s.micro_batch_tokens,
                "max_steps": s.max_steps,
                "online": s.online,
                "max_pp": s.max_pp,
                "schedule": s.schedule.name,
            },
            "steps_priced": self.steps_priced,
            "pool": [c.layout.name for c in self.pool],
            "ranked": [{"rank": i + 1, **c.to_dict()} for i, c in enumerate(self.ranked)],
            "rejected": [
                {**lay.to_dict(), "name": lay.name, "reason": why} for lay, why in self.rejected
            ],
        }


def rank_layouts(
    loads: np.ndarray,
    cluster: Cluster,
    spec: ModelSpec,
    settings: LayoutSettings | None = None,
) -> LayoutSearch:
    """SmartMoE's offline stage: enumerate the layouts of `cluster` and `spec`, price each on
    `loads[S, L, D, E]` (a trace's counts; D is fitted to the cluster), rank by mean step time
    (ties: fewer pipeline stages, then larger ep) and keep the pool. Raises `ConfigError` when no
    layout fits."""
    settings = settings or LayoutSettings()
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 4:
        raise PlanError(f"loads must be [steps, layers, devices, experts], got {loads.shape}")
    if loads.shape[3] != spec.experts:
        raise ConfigError(
            f"loads have {loads.shape[3]} experts, the model {spec.experts}", field="experts"
        )
    D, L, E = cluster.num_devices, loads.shape[1], loads.shape[3]
    loads = expected_loads(fit_devices(loads, D, "loads"), settings.max_steps)
    ranked: list[LayoutCost] = []
    rejected: list[tuple[Layout, str]] = []
    for layout in enumerate_layouts(D, E, L, settings.max_pp):
        problem = layout_problem(layout, cluster, spec)
        if problem:
            rejected.append((layout, problem))
            continue
        ranked.append(price_with_online(layout, cluster, spec, loads, settings))
    if not ranked:
        why = rejected[0][1] if rejected else "no pipeline/expert degree divides the sizes"
        raise ConfigError(
            f"no layout of {D} devices, {E} experts and {L} MoE layers fits ({why})",
            source=cluster.name,
            field="layout",
        )
    ranked.sort(key=lambda c: (c.step_s, c.layout.pp, -c.layout.ep))
    return LayoutSearch(ranked, rejected, settings, int(loads.shape[0]))


__all__ = [
    "LayoutCost",
    "LayoutSearch",
    "allreduce_times",
    "expected_loads",
    "group_context",
    "outside_time",
    "p2p_time",
    "permute_in_layout",
    "price_layout",
    "price_with_online",
    "rank_layouts",
    "stage_phases",
]
