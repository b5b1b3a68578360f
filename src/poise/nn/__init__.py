"""The MoE layer, compute only, and expert parallelism attached from outside (torch).

from poise.nn import MoE, MoEConfig, apply_expert_parallel
model = MyModel(moe=MoE(MoEConfig(d_model=512, d_expert=1024, num_experts=8, top_k=2)))
apply_expert_parallel(model, dist.group.WORLD)     # with several ranks: any world dividing E
y = model(x)                                       # x [B, T, M]
(loss(y) + moe.last_forward.aux_loss).backward()
sync_router_grads(model)                           # with several ranks
raise_if_nonfinite(model)        # at the step boundary (the Balancer does it in reduce_replicas)

mesh = ep_mesh(ep=2)                               # FSDP2 beside EP: ("dp", "ep") DeviceMesh
apply_expert_parallel(model, mesh["ep"]); shard_dense(model, mesh)   # poise.nn.fsdp
"""

from poise.nn.comm import comm_device
from poise.nn.config import MoEConfig
from poise.nn.dispatch import (
    Dispatcher,
    NonFiniteInputError,
    RankRouting,
    RoutingMismatchError,
)
from poise.nn.expert_parallel import apply_expert_parallel, check_ranks_agree
from poise.nn.experts import Experts, ExpertsInputError, grouped_mm_problem
from poise.nn.fsdp import ep_mesh, shard_dense
from poise.nn.moe import (
    ForwardRecord,
    MoE,
    check_world,
    default_slots,
    find_moe_layers,
    install_bias_update,
    raise_if_nonfinite,
    sync_router_grads,
)
from poise.nn.router import ReplayRouter, Router, Routing, capacity_keep
from poise.nn.slots import SlotMap, slot_maps

__all__ = [
    "Dispatcher",
    "Experts",
    "ExpertsInputError",
    "ForwardRecord",
    "MoE",
    "MoEConfig",
    "NonFiniteInputError",
    "RankRouting",
    "ReplayRouter",
    "Router",
    "Routing",
    "RoutingMismatchError",
    "SlotMap",
    "apply_expert_parallel",
    "capacity_keep",
    "check_ranks_agree",
    "check_world",
    "comm_device",
    "default_slots",
    "ep_mesh",
    "find_moe_layers",
    "grouped_mm_problem",
    "install_bias_update",
    "raise_if_nonfinite",
    "shard_dense",
    "slot_maps",
    "sync_router_grads",
]
