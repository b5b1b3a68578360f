"""Expert domains in the live runtime (HybridEP, arXiv 2510.19470 §IV-A): clusters cut into
domains (`domain_cluster`, what the planner prices), and what the dispatcher really sends
across them (`cross_domain_tokens`, recorded at every forward by `DomainTraffic`).

Under `Balancer(..., policy="hybrid", cluster=domain_cluster(...))` the policy copies experts
into domains (filled by Trans from the home) and routes group-locally
(`Assignment.group_local`): a source whose domain holds a copy of e sends e's tokens there,
every other token goes to e's home across domains.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from torch import nn

from poise.core.cluster import Cluster, Link
from poise.core.errors import ConfigError
from poise.core.presets import PRESETS
from poise.nn.moe import MoE, find_moe_layers


def domain_cluster(
    domains: int,
    nodes_per_domain: int = 1,
    devices_per_node: int = 1,
    *,
    wan_bw_Bps: float = 1.25e8,
    wan_lat_s: float = 1e-3,
) -> Cluster:
    """`domains x nodes_per_domain x devices_per_node` local ranks: `cpu-2`'s device and
    intra/inter-node links, `wan_bw_Bps` (default 1 Gb/s) and `wan_lat_s` between domains."""
    if wan_bw_Bps <= 0 or wan_lat_s < 0:
        raise ConfigError("wan_bw_Bps must be > 0 and wan_lat_s >= 0", field="inter_domain")
    return dataclasses.replace(
        PRESETS["cpu-2"],
        name=f"cpu-{domains}x{nodes_per_domain}x{devices_per_node}",
        devices_per_node=devices_per_node,
        nodes_per_domain=nodes_per_domain,
        domains=domains,
        inter_domain=Link(wan_bw_Bps, wan_lat_s),
    )


def cross_domain_tokens(routes: np.ndarray, rank: int, size: int) -> np.ndarray:
    """`[E]` tokens rank `rank` sends to ranks outside its domain (`size` ranks per domain),
    from its integer routes `routes[E, D]` (`RankRouting.routes`, the split the dispatcher
    sends)."""
    other = np.arange(routes.shape[1]) // size != rank // size  # [D]
    return routes[:, other].sum(axis=1)


class DomainTraffic:
    """At every training forward of each `MoE` layer of `model`, the tokens this rank sends
    across domains per expert: `cross[i]` is `[L, E]` for forward i (layers in module order),
    from the layer's `last_counts` and `routing` (exact when the router drops nothing: counts
    precede capacity drops). `close()` removes the hooks."""

    def __init__(self, model: nn.Module, size: int) -> None:
        self.layers: list[MoE] = find_moe_layers(model)
        if not self.layers:
            raise ConfigError("the model has no poise.nn.MoE layer", field="model")
        if size < 1:
            raise ConfigError(f"must be >= 1, got {size}", field="domain_size")
        self.size = size
        self.cross: list[np.ndarray] = []
        self._row: list[np.ndarray] = []
        self._handles = [
            m.register_forward_hook(lambda mod, a, o, i=i: self._record(i, mod))
            for i, m in enumerate(self.layers)
        ]

    def _record(self, index: int, layer: nn.Module) -> None:
        assert isinstance(layer, MoE)
        if not layer.training:
            return
        routes = layer.routing.routes(layer.last_counts.detach().cpu().numpy())
        self._row.append(cross_domain_tokens(routes, layer.rank, self.size))
        if index == len(self.layers) - 1:
            self.cross.append(np.stack(self._row))
            self._row = []

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
