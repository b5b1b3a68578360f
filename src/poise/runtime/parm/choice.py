"""Which Parm schedule a `ParallelMoE` runs under `schedule="auto"`: a callable
`chooser(ParmShape) -> "s1" | "s2"` (or "baseline"), asked once per token count. The default,
`ParmChooser`, is Parm's analytic choice (`poise.layouts.parm.choose_schedule`: S2 when its
unified all-to-alls cost less under the alpha-beta model than S1's EP all-to-alls plus ESP
all-gather and reduce-scatter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from poise.layouts.parm import ParmLayer, choose_schedule


@dataclass(frozen=True)
class ParmShape:
    """One MoE layer in one step, as a chooser sees it. `tokens`: per MP group (node) and step
    (`B * S`, duplicated on its M ranks); `capacity_factor`: None when dropless; `mp`, `esp`,
    `ep`: degrees (`world = ep * mp`); `heads`: None when unknown; `dtype_bytes`: per
    activation element."""

    tokens: int
    d_model: int
    d_expert: int
    num_experts: int
    top_k: int
    capacity_factor: float | None
    mp: int
    esp: int
    ep: int
    dtype_bytes: int
    heads: int | None = None


ScheduleChooser = Callable[[ParmShape], str]


def local_cluster(shape: ParmShape) -> Any:
    """The modelled cluster when none is given: `cpu-2`'s rates, one node of `mp` devices per
    MP group, `ep` nodes."""
    from poise.core.presets import PRESETS

    return dataclasses.replace(
        PRESETS["cpu-2"],
        name=f"cpu-{shape.ep}x{shape.mp}",
        devices_per_node=shape.mp,
        nodes_per_domain=shape.ep,
        domains=1,
    )


class ParmChooser:
    """Parm's automatic choice as a `ScheduleChooser`. `costs`: a `poise.core.cluster.Cluster`
    or a measured `poise.cost.collectives.CollectiveFit` (`poise calibrate`); None:
    `local_cluster`. A dropless layer is priced at capacity factor 1 (balanced dropless
    volume); tokens are rounded down to a multiple of `mp` (the model's MP-Split cuts evenly)."""

    def __init__(self, costs: Any = None) -> None:
        self.costs = costs

    def layer(self, shape: ParmShape) -> Any:
        """The `poise.layouts.parm.ParmLayer` of `shape`."""
        tokens = max(shape.tokens - shape.tokens % shape.mp, shape.mp)
        return ParmLayer(
            batch=1,
            seq_len=tokens,
            d_model=shape.d_model,
            d_expert=shape.d_expert,
            experts=shape.num_experts,
            top_k=shape.top_k,
            capacity_factor=1.0 if shape.capacity_factor is None else shape.capacity_factor,
            mp=shape.mp,
            esp=shape.esp,
            ep=shape.ep,
            heads=shape.heads,
            dtype_bytes=shape.dtype_bytes,
            name="ParallelMoE",
        )

    def __call__(self, shape: ParmShape) -> str:
        costs = self.costs if self.costs is not None else local_cluster(shape)
        return str(choose_schedule(self.layer(shape), costs))
