"""Slots bounded by device memory alone, for systems whose design sets no slot limit.

FasterMoE shadows as many experts as its greedy finds worth it (He et al., PPoPP '22, §4),
HybridEP gives every GPU of a domain each expert it gathers (Yang et al., arXiv 2510.19470;
`plan.policies.hybrid`), Pro-Prophet sends a hot expert to the devices holding its tokens
(Wang et al., arXiv 2411.10003, Algorithm 1; `plan.policies.prophet`) and FlexMoE's vExperts
(Nie et al., SIGMOD '23) state no cap either: what caps the copies a device holds is its memory.
Poise's own `auto` gets the same room, so that it is compared on the same hardware. (EPLB keeps
its deployment's count of redundant experts.)

A device keeps its home experts' and its blocks' dense state, P (B_dtype + B_opt) per parameter
(`layouts.pool.memory_bytes`), and each further slot holds one expert's weights and their
gradients in every layer (the optimizer state stays at the home, where the gradients are
reduced):

    slots = min(E, homes + floor((M - L (homes P_e + P_d)(B_dtype + B_opt)) / (2 L P_e B_dtype)))

with M the device memory, L the MoE layers, homes = ceil(E / D), P_e an expert's parameters and
P_d a block's dense ones. Activations are not counted (the model has no activation memory), so
this is an upper bound; it never falls below `homes`, the least a placement needs.
"""

from __future__ import annotations

import math

from poise.core.cluster import Cluster
from poise.core.spec import ModelSpec


def memory_bound_slots(cluster: Cluster, spec: ModelSpec) -> int:
    """Slots per device a system without a slot limit reaches on `cluster` for `spec` (the module
    docstring's formula), between ceil(E / D) and E."""
    E, D, L = spec.experts, cluster.num_devices, spec.moe_layers
    homes = max(1, math.ceil(E / D))
    per_param = spec.dtype_bytes + spec.optimizer_bytes_per_param
    resident = L * (homes * spec.expert_params + spec.dense_params_per_block) * per_param
    per_slot = 2.0 * L * spec.expert_params * spec.dtype_bytes
    free = cluster.memory_bytes - resident
    extra = int(free // per_slot) if free > 0 and per_slot > 0 else 0
    return max(homes, min(E, homes + extra))
