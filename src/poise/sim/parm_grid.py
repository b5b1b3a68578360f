"""Parm's grid of MoE-layer configurations, simulated: speedups of S1, S2 and the automatic
choice over DeepSpeed-MoE's schedule, and how often the choice picks the truly faster schedule.

Parm (INFOCOM 2024) reports 1.13x to 5.77x over DeepSpeed-MoE "on 1296 manually configured MoE
layers" on an 8-GPU server and a 32-GPU cluster. Its grid spans the layer's B, L, M, H, E, k, f
and the MP (= ESP) degree; the value sets of its table could not be read through this
project's search tools, so ours are our own, on the same axes and of the same size:

    B in {2, 4, 8}, L in {256, 512, 1024}, M in {512, 1024, 2048}, H / M in {2, 4},
    E in {16, 32}, k in {1, 2}, f in {1.0, 1.2}, N_MP = N_ESP in {2, 4, 8}

3 * 3 * 3 * 2 * 2 * 2 * 2 * 3 = 1,296 configurations per cluster (N_EP = P / N_ESP; fp16;
E in {16, 32} divides every N_EP). Each configuration is priced under every schedule by the
event model (`poise.sim.parm_events`: per-level streams, rings with shared NICs, GEMM curve) —
the "truth" — while the choice uses Parm's simpler alpha-beta condition
(`poise.layouts.parm.choose_schedule`) on the same cluster. Speedup = truth(baseline) /
truth(schedule);
the choice's speedup is that of the schedule it picks; it is accurate on a configuration when it
picks the faster of S1 and S2 under the truth (ties count as accurate).

Clusters (`PARM_CLUSTERS`): the `parm-8gpu` and `parm-32gpu` presets (`poise.core.presets`,
with the efficiencies and link rates every preset uses). `EXTRA_CLUSTERS` (not Parm's):
`parm-32gpu-nic-per-gpu`, the same 32 GPUs with one InfiniBand NDR NIC per GPU, so that a
device's inter-node bandwidth exceeds its PCIe 3.0 bandwidth: the regime where S2's unified
all-to-all (N_ESP times S1's inter-node bytes, but intra-node and inter-node transfers at once)
can beat S1, and where the choice has something to decide.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.core.cluster import Cluster, Link
from poise.core.presets import IB_NDR, PRESETS
from poise.layouts.parm import SCHEDULES, ParmLayer, choose_schedule
from poise.sim.parm_events import event_layer_time

PUBLISHED_SPEEDUP = (1.13, 5.77)
PUBLISHED_CONFIGS = 1296
STAT_NAMES = ("min", "p10", "median", "p90", "max")
TIE = 1e-9  # relative: S1 and S2 times closer than this are a tie

AXES: dict[str, tuple[float, ...]] = {
    "batch": (2, 4, 8),
    "seq_len": (256, 512, 1024),
    "d_model": (512, 1024, 2048),
    "h_scale": (2, 4),
    "experts": (16, 32),
    "top_k": (1, 2),
    "capacity_factor": (1.0, 1.2),
    "mp": (2, 4, 8),
}
QUICK_AXES: dict[str, tuple[float, ...]] = {
    "batch": (4,),
    "seq_len": (256, 1024),
    "d_model": (1024,),
    "h_scale": (4,),
    "experts": (16,),
    "top_k": (2,),
    "capacity_factor": (1.2,),
    "mp": (2, 4, 8),
}


def _nic_per_gpu() -> Cluster:
    base = PRESETS["parm-32gpu"]
    nic = Link(IB_NDR, base.inter_node.lat_s)
    return dataclasses.replace(
        base, name="parm-32gpu-nic-per-gpu", inter_node=nic, inter_domain=nic
    )


PARM_CLUSTERS: dict[str, Cluster] = {n: PRESETS[n] for n in ("parm-8gpu", "parm-32gpu")}
EXTRA_CLUSTERS: dict[str, Cluster] = {c.name: c for c in (_nic_per_gpu(),)}


def grid_layers(world: int, quick: bool = False) -> Iterator[ParmLayer]:
    """Every configuration of the grid (`AXES`, or `QUICK_AXES`) on `world` ranks."""
    axes = QUICK_AXES if quick else AXES
    for values in itertools.product(*axes.values()):
        v = dict(zip(axes, values, strict=True))
        yield ParmLayer.for_world(
            world,
            mp=int(v["mp"]),
            batch=int(v["batch"]),
            seq_len=int(v["seq_len"]),
            d_model=int(v["d_model"]),
            d_expert=int(v["d_model"] * v["h_scale"]),
            experts=int(v["experts"]),
            top_k=int(v["top_k"]),
            capacity_factor=float(v["capacity_factor"]),
            dtype_bytes=2,
            name="parm grid",
        )


def grid_size(quick: bool = False) -> int:
    return int(np.prod([len(v) for v in (QUICK_AXES if quick else AXES).values()]))


@dataclass
class GridResult:
    """Per configuration (`[N]`): truth seconds per schedule, the choice, and the truly faster
    of S1 and S2."""

    cluster: str
    devices: int
    layers: list[ParmLayer]
    truth_s: dict[str, np.ndarray]  # schedule -> [N]
    chosen: np.ndarray  # [N] "s1" / "s2"

    @property
    def configs(self) -> int:
        return len(self.layers)

    def speedup(self, which: str) -> np.ndarray:
        """`[N]` truth(baseline) / truth(which); `which` a schedule, "choice" or "oracle" (the
        faster of S1 and S2)."""
        base = self.truth_s["baseline"]
        if which == "choice":
            t = np.where(self.chosen == "s2", self.truth_s["s2"], self.truth_s["s1"])
        elif which == "oracle":
            t = np.minimum(self.truth_s["s1"], self.truth_s["s2"])
        else:
            t = self.truth_s[which]
        return base / t

    @property
    def truly_faster(self) -> np.ndarray:
        """`[N]` "s2" where S2 is faster than S1 under the truth by more than `TIE`, else "s1"."""
        return np.where(self.truth_s["s2"] < self.truth_s["s1"] * (1 - TIE), "s2", "s1")

    def choice_loss(self) -> np.ndarray:
        """`[N]` truth(chosen) / truth(faster of S1, S2): 1 where the choice is right."""
        t1, t2 = self.truth_s["s1"], self.truth_s["s2"]
        return np.where(self.chosen == "s2", t2, t1) / np.minimum(t1, t2)

    @property
    def choice_accuracy(self) -> float:
        """Fraction of configurations where the choice is the truly faster of S1 and S2 (within
        `TIE`: where the two take the same time, either is right)."""
        return float(np.mean(self.choice_loss() <= 1 + TIE))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": self.cluster,
            "devices": self.devices,
            "configs": self.configs,
        }
        for which in ("s1", "s2", "choice", "oracle"):
            out[which] = stats(self.speedup(which))
        out["choice_accuracy"] = self.choice_accuracy
        loss = self.choice_loss()
        out["choice_loss"] = {"median": float(np.median(loss)), "max": float(loss.max())}
        out["chosen"] = {s: int((self.chosen == s).sum()) for s in ("s1", "s2")}
        faster = self.truly_faster
        out["truly_faster"] = {s: int((faster == s).sum()) for s in ("s1", "s2")}
        return out


def stats(x: np.ndarray) -> dict[str, float]:
    """min, p10, median, p90, max of `x`."""
    q = np.percentile(x, [0, 10, 50, 90, 100])
    return {k: float(v) for k, v in zip(STAT_NAMES, q, strict=True)}


def run_grid(cluster: Cluster, quick: bool = False) -> GridResult:
    """Price every grid configuration on `cluster` (all its devices) under every schedule with
    the event model, and let `choose_schedule` pick between S1 and S2 with the alpha-beta
    model of the same cluster."""
    layers = list(grid_layers(cluster.num_devices, quick))
    truth = {s: np.empty(len(layers)) for s in SCHEDULES}
    chosen = np.empty(len(layers), dtype=object)
    for i, layer in enumerate(layers):
        for s in SCHEDULES:
            truth[s][i] = event_layer_time(cluster, layer, s)
        chosen[i] = choose_schedule(layer, cluster)
    return GridResult(cluster.name, cluster.num_devices, layers, truth, chosen.astype(str))
