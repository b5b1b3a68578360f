"""The expert-parallel MoE layer: router, experts, dispatcher, slots (torch).

from poise.nn import MoE
moe = MoE(d_model=512, d_expert=1024, num_experts=8, top_k=2)   # any world dividing E
y = moe(x)                                                     # x [B, S, D]
(loss(y) + moe.aux_loss).backward()
sync_router_grads(model)                                       # with several ranks
"""

from poise.nn.dispatch import (
    Dispatcher,
    Layout,
    LayoutMismatchError,
    NonFiniteInputError,
)
from poise.nn.experts import Experts, ExpertsInputError, grouped_mm_problem
from poise.nn.moe import (
    MoE,
    check_world,
    default_slots,
    install_bias_update,
    moe_layers,
    sync_router_grads,
)
from poise.nn.router import ReplayRouter, Router, Routing, capacity_keep
from poise.nn.slots import SlotMap, slot_maps

__all__ = [
    "Dispatcher",
    "Experts",
    "ExpertsInputError",
    "Layout",
    "LayoutMismatchError",
    "MoE",
    "NonFiniteInputError",
    "ReplayRouter",
    "Router",
    "Routing",
    "SlotMap",
    "capacity_keep",
    "check_world",
    "default_slots",
    "grouped_mm_problem",
    "install_bias_update",
    "moe_layers",
    "slot_maps",
    "sync_router_grads",
]
