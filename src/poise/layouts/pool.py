"""SmartMoE's offline pool of hybrid parallel layouts and its online choice inside the pool.

SmartMoE (Zhai et al., "SmartMoE: Efficiently Training Sparsely-Activated Models through
Combining Offline and Online Parallelization", USENIX ATC '23) splits parallelisation in two:
offline, it enumerates hybrid parallel layouts, prices each with a *data-sensitive* performance
model on the expected load distribution and keeps a small pool of the best; online, it re-places
experts inside the layout in force (our `permute` policy) and picks the pool's best layout for
the load it currently sees. This module is the layouts themselves (`Layout`, their
enumeration and feasibility); `poise.layouts.price` prices and ranks them and re-places experts
inside one; `poise.layouts.online` picks within the pool; `poise.runtime.smartmoe` starts training
in
a layout. NumPy only.

Glossary (one layout on D devices, E experts, L MoE layers):

- `pp`: pipeline stages. Stage s holds MoE layers [s L/pp, (s+1) L/pp) on the contiguous devices
  [s Ds, (s+1) Ds), Ds = D / pp. The global batch is unchanged, so each stage device processes pp
  times the tokens a device of the trace sent (the trace's D sources folded onto Ds,
  `loads.fit_devices`).
- `ep`: expert-parallel degree. A stage's devices form Ds / ep contiguous EP groups of ep devices;
  each group holds one copy of every expert, E / ep experts per device, and its tokens go only to
  the copies in their own group (`Assignment.group_local`).
- `edp` = Ds / ep: expert-data-parallel degree (DeepSpeed-MoE's name). The devices at the same
  position of every EP group hold the same experts and all-reduce their gradients each step.
- `dp` = Ds: data-parallel degree of the dense (non-expert) part inside a stage.

Feasibility:

- Memory per device: (L / pp) ((E / ep) P_e + P_d) (B_dtype + B_opt) must fit the
  device (activations are not counted).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poise.core.cluster import Cluster
from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Assignment, Placement
from poise.core.spec import ModelSpec
from poise.cost.schedule import Schedule
from poise.plan.policies.base import static_homes

GIB = 2**30


# ------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class Layout:
    """One hybrid parallel layout: `devices` D, `experts` E, `layers` L (MoE layers), pipeline
    stages `pp` and expert-parallel degree `ep`; see the module docstring. Devices are numbered
    as in `poise.core.cluster.Cluster` (node-major); stage s is devices [s Ds, (s+1) Ds) and,
    inside it, EP group g is devices [s Ds + g ep, s Ds + (g+1) ep)."""

    devices: int
    experts: int
    layers: int
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("devices", "experts", "layers", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"must be an integer >= 1, got {value!r}", field=name, **_SRC)
        if self.layers % self.pp:
            raise ConfigError(
                f"{self.pp} pipeline stages do not divide {self.layers} MoE layers",
                field="pp",
                **_SRC,
            )
        if self.devices % self.pp:
            raise ConfigError(
                f"{self.pp} pipeline stages do not divide {self.devices} devices",
                field="pp",
                **_SRC,
            )
        if self.stage_devices % self.ep:
            raise ConfigError(
                f"expert-parallel degree {self.ep} does not divide the {self.stage_devices} "
                f"devices of a pipeline stage",
                field="ep",
                **_SRC,
            )
        if self.experts % self.ep:
            raise ConfigError(
                f"expert-parallel degree {self.ep} does not divide {self.experts} experts "
                f"(each device holds E / ep whole experts)",
                field="ep",
                **_SRC,
            )

    # ------------------------------------------------------------------ derived degrees
    @property
    def stage_devices(self) -> int:
        """Ds = D / pp: devices of one pipeline stage (the dense part's data-parallel degree)."""
        return self.devices // self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree Ds / ep: copies of each expert per stage."""
        return self.stage_devices // self.ep

    @property
    def dp(self) -> int:
        return self.stage_devices

    @property
    def experts_per_device(self) -> int:
        return self.experts // self.ep

    @property
    def layers_per_stage(self) -> int:
        return self.layers // self.pp

    @property
    def name(self) -> str:
        return f"pp{self.pp}-ep{self.ep}-edp{self.edp}"

    def describe(self) -> str:
        """One line for people."""
        stage = (
            f"{self.pp} pipeline stages of {self.stage_devices} devices and "
            f"{self.layers_per_stage} MoE layers each"
            if self.pp > 1
            else f"no pipeline ({self.layers} MoE layers on every device)"
        )
        return (
            f"{self.name}: {stage}; {self.edp} EP group(s) of {self.ep} devices per stage, each "
            f"holding all {self.experts} experts ({self.experts_per_device} per device); expert "
            f"gradients all-reduced over {self.edp} replica(s)"
        )

    # ------------------------------------------------------------------ groups
    def ep_groups(self) -> list[list[int]]:
        """Global device ranks of every EP group, stage by stage (each `[ep]`)."""
        return [list(range(start, start + self.ep)) for start in range(0, self.devices, self.ep)]

    def edp_groups(self) -> list[list[int]]:
        """Global device ranks of every EDP group (same position in each EP group of a stage),
        stage by stage (each `[edp]`)."""
        Ds = self.stage_devices
        return [
            [s * Ds + g * self.ep + i for g in range(self.edp)]
            for s in range(self.pp)
            for i in range(self.ep)
        ]

    # ------------------------------------------------------------------ placement
    def static_homes(self, layers: int | None = None) -> np.ndarray:
        """`[L, E]` group-local device (0..ep-1) of every expert: contiguous blocks."""
        return static_homes(self.layers if layers is None else layers, self.experts, self.ep)

    def placement(self, homes: np.ndarray | None = None) -> tuple[Placement, Assignment]:
        """The `Placement` and `Assignment` of one pipeline stage's Ds devices for the cost model.

        `homes[N, E]`: group-local position (0..ep-1) of each expert in N layers (default: the
        static blocks of one stage's layers). Every EP group holds one copy of each expert at
        that position: the copy in group 0 is the home, the others are replicas. Sources route
        each expert's tokens to the copy in their own group (`Assignment.group_local`; with one
        group, plain routing to the home)."""
        homes = self.static_homes(self.layers_per_stage) if homes is None else homes
        homes = np.asarray(homes, dtype=np.int64)
        if homes.ndim != 2 or homes.shape[1] != self.experts:
            raise PlanError(
                f"homes must be [layers, {self.experts}], got {homes.shape}", field="homes"
            )
        if homes.size and (homes.min() < 0 or homes.max() >= self.ep):
            raise PlanError(f"group-local homes must lie in [0, {self.ep})", field="homes")
        per = (homes[:, :, None] == np.arange(self.ep)).sum(axis=1)  # [N, ep]
        if np.any(per != self.experts_per_device):
            raise PlanError(
                f"every device of an EP group must hold {self.experts_per_device} experts",
                field="homes",
            )
        N, E = homes.shape
        Ds = self.stage_devices
        copies = np.zeros((N, Ds, E), dtype=np.int32)
        rows = np.repeat(np.arange(N), E)
        cols = np.tile(np.arange(E), N)
        for g in range(self.edp):
            copies[rows, g * self.ep + homes.ravel(), cols] = 1
        placement = Placement(homes.copy(), copies, self.experts_per_device)
        to_home = Assignment.to_home(placement)
        if self.edp == 1:
            return placement, to_home
        return placement, Assignment.group_local(placement, self.ep, to_home)

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, int]:
        return {
            "devices": self.devices,
            "experts": self.experts,
            "layers": self.layers,
            "pp": self.pp,
            "ep": self.ep,
            "edp": self.edp,
            "experts_per_device": self.experts_per_device,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "layout") -> Layout:
        try:
            layout = cls(
                int(data["devices"]),
                int(data["experts"]),
                int(data["layers"]),
                int(data.get("pp", 1)),
                int(data["ep"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a layout: {exc}", source=source, field="layout") from None
        if "edp" in data and int(data["edp"]) != layout.edp:
            raise ConfigError(
                f"edp {data['edp']} disagrees with devices / (pp * ep) = {layout.edp}",
                source=source,
                field="edp",
            )
        return layout

    @classmethod
    def parse(cls, text: str, devices: int, experts: int, layers: int) -> Layout:
        """`"ep=4"`, `"pp=2,ep=4"` or a name like `"pp1-ep4-edp2"` (edp is checked)."""
        found = dict(re.findall(r"(pp|ep|edp)\s*[=:]?\s*(\d+)", text))
        if "ep" not in found:
            raise ConfigError(
                "expected e.g. 'ep=4' or 'pp=2,ep=4' or 'pp1-ep4-edp2'", source=text, field="layout"
            )
        data: dict[str, Any] = {"devices": devices, "experts": experts, "layers": layers}
        data.update({k: int(v) for k, v in found.items()})
        return cls.from_dict(data, source=text)


_SRC = {"source": "layout"}


# ------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class LayoutSettings:
    """How layouts are searched and priced.

    `pool`: layouts kept (SmartMoE's candidate pool); `micro_batches`: m of the pipeline
    formula (the SmartMoE-AE sample records 4 per step); `micro_batch_tokens`: when given, m
    follows each layout instead, as Megatron-LM derives it from a fixed global batch (gbs) and
    micro-batch size (mbs, sequences of s tokens): m = gbs / (mbs Ds) = ceil(T_stage / b), with
    T_stage = pp x tokens per device the tokens of one stage device and b = mbs s
    (`micro_batches_for`); `max_steps`: at most this many trace steps, evenly spaced, are
    priced; `online`: price each layout with its `permute` placement for the mean loads (False:
    the static contiguous placement); `max_pp`: largest pipeline degree tried (None: every
    divisor); `schedule`: how a layer's phases overlap; `window`: steps of history `permute`
    averages online."""

    pool: int = 4
    micro_batches: int = 4
    max_steps: int = 32
    online: bool = True
    max_pp: int | None = None
    schedule: Schedule = field(default_factory=Schedule)
    window: int = 10
    micro_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("pool", "micro_batches", "max_steps", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"must be an integer >= 1, got {value!r}", field=name)
        for name in ("max_pp", "micro_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigError(f"must be an integer >= 1, got {value!r}", field=name)

    def micro_batches_for(self, layout: Layout, spec: ModelSpec) -> int:
        """m for `layout`: `micro_batches`, or ceil(pp x tokens per device / micro_batch_tokens)
        when `micro_batch_tokens` is set (class docstring)."""
        if self.micro_batch_tokens is None:
            return self.micro_batches
        stage_tokens = layout.pp * spec.tokens_per_device
        return max(1, -(-stage_tokens // self.micro_batch_tokens))


# ------------------------------------------------------------------------- enumeration
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    devices: int, experts: int, layers: int, max_pp: int | None = None
) -> list[Layout]:
    """Every layout with pp dividing both D and L (at most `max_pp`) and ep dividing both the
    stage's devices and E, in (pp, ep) order."""
    out = []
    for pp in divisors(devices):
        if layers % pp or (max_pp is not None and pp > max_pp):
            continue
        for ep in divisors(devices // pp):
            if experts % ep == 0:
                out.append(Layout(devices, experts, layers, pp, ep))
    return out


def sub_cluster(cluster: Cluster, devices: int) -> Cluster | None:
    """The cluster of `devices` contiguous devices starting at a multiple of `devices` (a part
    of one node, whole nodes of one domain, or whole domains), or None when such a run does not
    nest with the nodes and domains. Links keep their bandwidth and sharing."""
    D, dpn, dpd = cluster.num_devices, cluster.devices_per_node, cluster.devices_per_domain
    if devices < 1 or D % devices:
        return None
    if devices == D:
        return cluster
    name = f"{cluster.name}[{devices}]"
    if dpn % devices == 0:
        return dataclasses.replace(
            cluster, name=name, devices_per_node=devices, nodes_per_domain=1, domains=1
        )
    if devices % dpn == 0 and dpd % devices == 0:
        return dataclasses.replace(cluster, name=name, nodes_per_domain=devices // dpn, domains=1)
    if devices % dpd == 0:
        return dataclasses.replace(cluster, name=name, domains=devices // dpd)
    return None


def memory_bytes(layout: Layout, spec: ModelSpec) -> float:
    """Expert and dense state per device: (L / pp) ((E / ep) P_e + P_d) (B_dtype + B_opt)."""
    per_param = spec.dtype_bytes + spec.optimizer_bytes_per_param
    per_layer = layout.experts_per_device * spec.expert_params + spec.dense_params_per_block
    return float(layout.layers_per_stage * per_layer * per_param)


def layout_problem(layout: Layout, cluster: Cluster, spec: ModelSpec) -> str | None:
    """Why `layout` cannot run on `cluster` (None: it can)."""
    if layout.devices != cluster.num_devices:
        return f"is for {layout.devices} devices, the cluster has {cluster.num_devices}"
    if layout.experts != spec.experts:
        return f"is for {layout.experts} experts, the model has {spec.experts}"
    Ds, ep = layout.stage_devices, layout.ep
    dpn, dpd = cluster.devices_per_node, cluster.devices_per_domain
    if layout.pp > 1 and sub_cluster(cluster, Ds) is None:
        return (
            f"a pipeline stage of {Ds} devices does not nest with nodes of {dpn} and domains "
            f"of {dpd} devices"
        )
    if layout.edp > 1 and not (dpn % ep == 0 or (ep % dpn == 0 and dpd % ep == 0)):
        return (
            f"EP groups of {ep} devices do not lie inside one node or one domain (nodes of "
            f"{dpn}, domains of {dpd}); group-local routing is priced only there"
        )
    need = memory_bytes(layout, spec)
    if need > cluster.memory_bytes:
        return (
            f"needs {need / GIB:.1f} GiB of expert and dense state per device, a device has "
            f"{cluster.memory_bytes / GIB:.1f} GiB"
        )
    return None


__all__ = [
    "GIB",
    "Layout",
    "LayoutSettings",
    "divisors",
    "enumerate_layouts",
    "layout_problem",
    "memory_bytes",
    "sub_cluster",
]
