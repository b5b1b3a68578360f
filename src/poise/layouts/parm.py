"""Parm's MP + EP + ESP MoE layer: its three schedules priced by alpha-beta models, and the
automatic choice between S1 and S2 (NumPy only).

Paper: Pan, Lin, Shi, Chu, Sun, Li, "Parm: Efficient Training of Large Sparsely-Activated Models
with Dedicated Schedules", IEEE INFOCOM 2024 (arXiv 2407.00599). Names and symbols are the
paper's (those its successor FSMoE, ASPLOS 2025, Table 1, also uses): B samples, L tokens per
sample, M embedding size, H expert hidden size, E experts, k top-k, f capacity factor, N_MP,
N_EP, N_ESP the group sizes, P = N_EP * N_ESP GPUs.

What the sources available to us say (the paper's body, with its equation numbers, could not be
read through this project's search tools: only its abstract and third-party summaries; the
layout below also follows FSMoE §2.2 and Fig. 2, which describes the same MP+EP+ESP flow and
cites Parm for it):

- In DeepSpeed-MoE, the tokens entering an MoE layer are duplicated on the N_MP ranks of an MP
  group (the attention's MP all-reduce leaves every MP rank a full copy), and each expert is
  sharded over that same group (ESP, N_ESP = N_MP: W1 by columns, W2 by rows of H).
- Parm pauses MP for the MoE layer (MP-Split before the gate, MP-AllGather after the combine), so
  duplicated tokens are neither gated, sent nor computed twice; S1 and S2 place the collectives
  differently; S2 replaces several collectives with a unified one, so that intra-node and
  inter-node transfers overlap; neither schedule dominates, and an alpha-beta model of each
  collective decides which one to run.

The three schedules as modelled here (per GPU; T = B L tokens held by each MP rank; C = ceil(k f
T / E) slots per expert and source before the split, C' = ceil(k f T / (N_MP E)) after it; b
bytes per element; groups: MP = ESP = N_MP consecutive ranks, EP = the N_EP ranks with the same
ESP rank, stride N_ESP; world = all P ranks):

    baseline (DeepSpeed-MoE: the same flow with MP not paused, so the N_MP copies of each token
        are gated, sent and computed):
        Gate(T) -> EP-AllToAll(E C M b) -> ESP-AllGather(N_ESP E C M b)
        -> Experts(N_ESP N_EP C rows per local expert, H / N_ESP wide)
        -> ESP-ReduceScatter(N_ESP E C M b) -> EP-AllToAll(E C M b)          [output duplicated]
    s1: MP-Split -> Gate(T / N_MP) -> EP-AllToAll(E C' M b) -> ESP-AllGather(N_ESP E C' M b)
        -> Experts(N_ESP N_EP C' rows) -> ESP-ReduceScatter(N_ESP E C' M b)
        -> EP-AllToAll(E C' M b) -> MP-AllGather(T M b)
    s2: MP-Split -> Gate(T / N_MP) -> unified AllToAll over the P ranks (N_ESP E C' M b: each
        token goes straight to every shard of its expert; replaces EP-AllToAll + ESP-AllGather)
        -> Experts(N_ESP N_EP C' rows) -> unified AllToAll (N_ESP E C' M b: each shard returns
        its partial output to the token's source, which sums the N_ESP partials; replaces
        ESP-ReduceScatter + EP-AllToAll) -> MP-AllGather(T M b)

S2's unified collective is our reading of "replace multiple collectives with a unified one":
it moves the same bytes as S1's all-to-all plus all-gather inside one node, but N_ESP times
S1's bytes across nodes, and its intra-node and inter-node parts run concurrently; S1 sends the
fewest bytes between nodes and then gathers inside the group. Which is faster depends on the
links and the sizes, which is what `choose_schedule` decides.

The backward pass runs the conjugate collectives on the same volumes (all-to-all <-> all-to-all,
all-gather <-> reduce-scatter, MP-AllGather <-> split, MP-Split <-> MP-AllGather), so each
schedule's backward has the forward's collectives; expert and gate GEMMs cost twice their
forward FLOPs (input and weight gradients).

Times (the alpha-beta model Parm decides with): a collective on a group of n ranks costs the
formula of `poise.cost.collectives` with the alpha and beta of the slowest link level the group
spans;
a GEMM of F FLOPs over r rows costs F / rate(r), rate(r) = gemm_flops r / (r + half_rows)
with gemm_flops = peak[t] * efficiency in the layer's compute dtype t (`Cluster.gemm_rate`).
S1 and S2 have the same gate, experts and MP-AllGather, so the choice depends on the
collectives they place differently only (per pass):

    s2 iff  2 t_a2a(P, N_ESP m') < 2 t_a2a(N_EP, m') + t_ag(N_ESP, N_ESP m') + t_rs(N_ESP, N_ESP m')
    with m' = E C' M b.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError
from poise.core.spec import resolve_compute_dtype
from poise.cost.collectives import CollectiveFit

Schedule = Literal["baseline", "s1", "s2"]
SCHEDULES: tuple[str, ...] = ("baseline", "s1", "s2")
GROUPS = ("mp", "esp", "ep", "world")


# ------------------------------------------------------------------------------------- the layer
@dataclass(frozen=True)
class ParmLayer:
    """One MoE layer under MP + EP + ESP.

    `batch` B and `seq_len` L: the samples and tokens per sample one MP group works on (each MP
    rank holds all T = B L of them); `d_model` M; `d_expert` H; `experts` E; `top_k` k;
    `capacity_factor` f; `mp` N_MP, `esp` N_ESP, `ep` N_EP (P = N_EP N_ESP ranks); `heads`: the
    attention heads MP splits (None: not checked); `dtype_bytes` b; `compute_dtype` the dtype
    its GEMMs run in (None: from `dtype_bytes`, `core.spec.resolve_compute_dtype`). Invalid
    values raise `ConfigError` naming the field."""

    batch: int
    seq_len: int
    d_model: int
    d_expert: int
    experts: int
    top_k: int
    capacity_factor: float
    mp: int
    esp: int
    ep: int
    heads: int | None = None
    dtype_bytes: int = 2
    name: str = "parm layer"
    compute_dtype: str | None = None

    def __post_init__(self) -> None:
        for f in (
            "batch",
            "seq_len",
            "d_model",
            "d_expert",
            "experts",
            "top_k",
            "mp",
            "esp",
            "ep",
            "dtype_bytes",
        ):
            _positive_int(getattr(self, f), f, self.name)
        if self.heads is not None:
            _positive_int(self.heads, "heads", self.name)
        resolve_compute_dtype(self.compute_dtype, self.dtype_bytes, self.name)
        f = self.capacity_factor
        ok = isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f)
        if not ok or f <= 0:
            raise ConfigError(
                f"must be a finite number > 0, got {f!r}", source=self.name, field="capacity_factor"
            )
        if self.top_k > self.experts:
            raise ConfigError(
                f"must be <= experts ({self.experts}), got {self.top_k}",
                source=self.name,
                field="top_k",
            )
        if self.esp != self.mp:
            raise ConfigError(
                f"must equal mp ({self.mp}), got {self.esp}: Parm, like DeepSpeed-MoE, shards "
                "each expert over the ranks of its MP group",
                source=self.name,
                field="esp",
            )
        _divides(self.ep, "ep", self.experts, "experts", self.name)
        _divides(self.esp, "esp", self.d_expert, "d_expert (the expert width H)", self.name)
        if self.heads is not None:
            _divides(self.mp, "mp", self.heads, "heads", self.name)
        _divides(self.mp, "mp", self.tokens, "batch * seq_len (tokens MP-Split cuts)", self.name)

    @classmethod
    def for_world(cls, world: int, *, mp: int, esp: int | None = None, **kw: object) -> ParmLayer:
        """A layer on `world` ranks: N_ESP = `esp` (default N_MP) and N_EP = world / N_ESP;
        `ConfigError` naming `mp` or `esp` when either does not divide the world."""
        name = str(kw.get("name", "parm layer"))
        _positive_int(world, "world", name)
        esp = mp if esp is None else esp
        _positive_int(mp, "mp", name)
        _positive_int(esp, "esp", name)
        _divides(mp, "mp", world, f"the world ({world} ranks)", name)
        _divides(esp, "esp", world, f"the world ({world} ranks)", name)
        return cls(mp=mp, esp=esp, ep=world // esp, **kw)  # type: ignore[arg-type]

    @property
    def gemm_dtype(self) -> str:
        """The dtype its GEMMs are priced in (`compute_dtype`, or from `dtype_bytes`)."""
        return resolve_compute_dtype(self.compute_dtype, self.dtype_bytes, self.name)

    @property
    def world(self) -> int:
        """P = N_EP * N_ESP."""
        return self.ep * self.esp

    @property
    def tokens(self) -> int:
        """T = B L, the tokens each MP rank holds (duplicated across the MP group)."""
        return self.batch * self.seq_len

    def capacity(self, split: bool) -> int:
        """Slots per expert and source rank: ceil(k f T / E), or with T / N_MP after MP-Split."""
        t = self.tokens // self.mp if split else self.tokens
        return max(1, math.ceil(self.top_k * self.capacity_factor * t / self.experts - 1e-9))

    def group(self, group: str) -> tuple[int, int]:
        """(size, stride) of a group: MP and ESP are N_MP consecutive ranks, EP the N_EP ranks
        N_ESP apart, world all P ranks."""
        if group in ("mp", "esp"):
            return self.mp, 1
        if group == "ep":
            return self.ep, self.esp
        if group == "world":
            return self.world, 1
        raise ConfigError(f"unknown group {group!r} (known: {', '.join(GROUPS)})", field="group")


def _positive_int(value: object, field: str, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(f"must be a positive integer, got {value!r}", source=source, field=field)


def _divides(degree: int, field: str, total: int, what: str, source: str) -> None:
    if total % degree:
        raise ConfigError(f"{degree} does not divide {what} = {total}", source=source, field=field)


# ------------------------------------------------------------------------------------ operations
@dataclass(frozen=True)
class Op:
    """One step of a schedule. Collectives: `kind` a collective name, `group` one of `GROUPS`,
    `nbytes` the message size as `poise.cost.collectives` defines it. GEMMs: `kind` "gate" or
    "experts", `flops` in all, `rows` per GEMM, `gemms` GEMM calls. `label` is the paper's
    name; `phase` "forward" or "backward"."""

    kind: str
    label: str
    phase: str
    group: str = ""
    nbytes: float = 0.0
    flops: float = 0.0
    rows: float = 0.0
    gemms: int = 0

    @property
    def is_collective(self) -> bool:
        return bool(self.group)


def schedule_ops(layer: ParmLayer, schedule: str) -> tuple[Op, ...]:
    """The operations of one forward and backward pass of `layer` under `schedule`, in order
    (module docstring)."""
    _check_schedule(schedule)
    b, m, h, e = layer.dtype_bytes, layer.d_model, layer.d_expert, layer.experts
    split = schedule != "baseline"
    cap = layer.capacity(split)
    slots = e * cap * m * b  # a rank's dispatch buffer: E x C x M
    gate_rows = layer.tokens // layer.mp if split else layer.tokens
    expert_rows = layer.ep * cap * layer.esp  # rows per local expert (baseline: N_MP copies)
    local = e // layer.ep
    shard = h // layer.esp
    expert_fwd = local * 2 * (2.0 * expert_rows * m * shard)  # two GEMMs per expert
    gate_fwd = 2.0 * gate_rows * m * e
    mp_gather = layer.tokens * m * b

    def gemm(kind: str, phase: str) -> Op:
        mult = 2 if phase == "backward" else 1
        if kind == "gate":
            return Op("gate", "Gate", phase, flops=mult * gate_fwd, rows=gate_rows, gemms=mult)
        return Op(
            "experts",
            "Experts",
            phase,
            flops=mult * expert_fwd,
            rows=expert_rows,
            gemms=mult * 2 * local,
        )

    ops: list[Op] = []
    for phase in ("forward", "backward"):
        gathered = layer.esp * slots
        if schedule in ("baseline", "s1"):
            # backward: the all-gather is the reduce-scatter's gradient and vice versa, so the
            # order of kinds is the forward's
            comm_in = [
                Op("all_to_all", "EP-AllToAll (dispatch)", phase, "ep", slots),
                Op("all_gather", "ESP-AllGather", phase, "esp", gathered),
            ]
            comm_out = [
                Op("reduce_scatter", "ESP-ReduceScatter", phase, "esp", gathered),
                Op("all_to_all", "EP-AllToAll (combine)", phase, "ep", slots),
            ]
        else:
            comm_in = [Op("all_to_all", "unified AllToAll (dispatch)", phase, "world", gathered)]
            comm_out = [Op("all_to_all", "unified AllToAll (combine)", phase, "world", gathered)]
        tail = (
            []
            if schedule == "baseline"
            else [Op("all_gather", "MP-AllGather", phase, "mp", mp_gather)]
        )
        body = [*comm_in, gemm("experts", phase), *comm_out]
        if phase == "forward":
            ops += [gemm("gate", phase), *body, *tail]
        else:  # gradients flow from the layer's output back to its input
            ops += [*body, gemm("gate", phase), *tail]
    return tuple(ops)


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})", field="schedule"
        )


# ------------------------------------------------------------------------------------- pricing
@dataclass(frozen=True)
class GemmModel:
    """rate(rows) = gemm_flops rows / (rows + half_rows) FLOP/s (`Cluster.gemm_rate`'s curve,
    and `poise calibrate`'s fit)."""

    gemm_flops: float
    half_rows: float = 0.0

    @classmethod
    def from_cluster(cls, cluster: Cluster, dtype: str) -> GemmModel:
        """The cluster's curve in compute dtype `dtype`: gemm_flops = peak[dtype] * efficiency."""
        return cls(cluster.gemm_flops(dtype), cluster.gemm_half_rows)

    def seconds(self, flops: float, rows: float) -> float:
        rows = max(float(rows), 1.0)
        return float(flops) * (rows + self.half_rows) / (self.gemm_flops * rows)


Costs = Cluster | CollectiveFit


def _fit(costs: Costs) -> CollectiveFit:
    return CollectiveFit.from_cluster(costs) if isinstance(costs, Cluster) else costs


def _gemm(costs: Costs, gemm: GemmModel | None, layer: ParmLayer) -> GemmModel:
    if gemm is not None:
        return gemm
    if isinstance(costs, Cluster):
        return GemmModel.from_cluster(costs, layer.gemm_dtype)
    raise ConfigError(
        "pricing GEMMs needs a GemmModel when the costs are a CollectiveFit", field="gemm"
    )


def op_seconds(layer: ParmLayer, op: Op, fit: CollectiveFit, gemm: GemmModel | None) -> float:
    """Alpha-beta seconds of one operation (module docstring)."""
    if op.is_collective:
        size, stride = layer.group(op.group)
        return fit.time(op.kind, size, op.nbytes, stride)
    if gemm is None:
        raise ConfigError("pricing GEMMs needs a GemmModel", field="gemm")
    return gemm.seconds(op.flops, op.rows)


def layer_breakdown(
    layer: ParmLayer, schedule: str, costs: Costs, gemm: GemmModel | None = None
) -> dict[str, float]:
    """Seconds per operation label (forward and backward summed) under the alpha-beta model."""
    fit, g = _fit(costs), _gemm(costs, gemm, layer)
    out: dict[str, float] = {}
    for op in schedule_ops(layer, schedule):
        out[op.label] = out.get(op.label, 0.0) + op_seconds(layer, op, fit, g)
    return out


def layer_time(
    layer: ParmLayer, schedule: str, costs: Costs, gemm: GemmModel | None = None
) -> float:
    """Seconds of one forward and backward pass of the layer under `schedule`: the operations
    run one after another, each priced by the alpha-beta model (`costs`: a cluster, or a
    `CollectiveFit` with a `GemmModel`)."""
    return float(sum(layer_breakdown(layer, schedule, costs, gemm).values()))


def schedule_condition(layer: ParmLayer, costs: Costs) -> float:
    """Seconds per pass that S2 saves over S1 (> 0: S2 is faster), from the collectives they
    place differently (module docstring):

        2 t_a2a(N_EP, m') + t_ag(N_ESP, N_ESP m') + t_rs(N_ESP, N_ESP m') - 2 t_a2a(P, N_ESP m')
    """
    fit = _fit(costs)
    m1 = layer.experts * layer.capacity(True) * layer.d_model * layer.dtype_bytes
    ep, ep_stride = layer.group("ep")
    esp, _ = layer.group("esp")
    s1 = (
        2 * fit.time("all_to_all", ep, m1, ep_stride)
        + fit.time("all_gather", esp, esp * m1)
        + fit.time("reduce_scatter", esp, esp * m1)
    )
    s2 = 2 * fit.time("all_to_all", layer.world, esp * m1)
    return s1 - s2


def choose_schedule(layer: ParmLayer, costs: Costs) -> Literal["s1", "s2"]:
    """Parm's automatic choice: "s2" when its unified all-to-alls cost less than S1's
    all-to-alls plus ESP all-gather and reduce-scatter under the alpha-beta model
    (`schedule_condition` > 0), else "s1". `costs`: a cluster or a (measured) `CollectiveFit`
    that covers the layer's link levels."""
    return "s2" if schedule_condition(layer, costs) > 0 else "s1"


def fastest_schedule(
    layer: ParmLayer,
    costs: Costs,
    gemm: GemmModel | None = None,
    schedules: Sequence[str] = SCHEDULES,
) -> str:
    """The schedule with the least `layer_time` (ties: the earlier in `schedules`)."""
    times = [layer_time(layer, s, costs, gemm) for s in schedules]
    return schedules[int(np.argmin(times))]
