"""Expert parallelism on a `DeviceMesh`, beside FSDP2 (`fully_shard`) for the dense parameters.

    mesh = ep_mesh(ep=2)                      # ("dp", "ep"): EP groups of 2 contiguous ranks
    apply_expert_parallel(model, mesh["ep"])  # the experts: expert parallel over "ep"
    shard_dense(model, mesh)                  # the rest: fully_shard over the whole mesh
    opt = HomeRowsAdamW(model.parameters(), home_rows(model), ...)   # after both

`shard_dense` calls `torch.distributed.fsdp.fully_shard` on each block of the model (each module
of its `nn.ModuleList`s that holds parameters) and on the model itself, with every MoE layer's
expert weights in `ignored_params`: the experts stay plain tensors, each rank's own, stepped,
moved and replicated by the Balancer as before, while every dense parameter becomes a `DTensor`
sharded over the mesh (both dimensions flattened: the dense parameters are replicated over all
ranks, so all ranks share them). Each FSDP module reduces with a gradient divide factor of 1 and
sums only (`set_gradient_divide_factor(1.0)`, `set_force_sum_reduction_for_comms(True)`), so a
dense gradient is the sum over the ranks, as Poise's all-reduce makes it
(`poise.train.grad_sync.sync_dense`, `sync_router_grads`): the loss scaling of a run is the same
on both paths. Gloo has no `PREMUL_SUM` or `AVG`, so summing is also what runs on CPU ranks.

`fully_shard` over expert-parallel weights (a `fully_shard(model)` that does not leave them out)
would shard every rank's own slots as if they were one replicated tensor, so that a rank would
compute with other ranks' experts. `Experts.forward` refuses it with one `ConfigError` (field
`fsdp`) on every rank: FSDP marks each module it manages (`_is_fsdp_managed_module`), and an
expert-parallel `Experts` module that carries the mark is one whose weights it manages.

The gradient norm (`poise.nn.grad_norm.squared_norm_sum`) and `HomeRowsAdamW` take DTensor
parameters and gradients beside plain ones: they work on the local shards (`local_tensor`) and
the norm sums a DTensor's squares over the mesh dimensions it is sharded on.

`torch.distributed.tensor` is not imported here (1.7 s of a rank's start-up): a DTensor can only
exist once something imported it, so `is_dtensor` looks it up in `sys.modules`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import ConfigError
from poise.nn.experts import fsdp_refusal
from poise.nn.moe import find_moe_layers

FSDP_FIELD = "fsdp"


def dtensor_type() -> type | None:
    """`torch.distributed.tensor.DTensor` where it has been imported, else None."""
    mod = sys.modules.get("torch.distributed.tensor")
    return None if mod is None else mod.DTensor


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a `DTensor` (without importing `torch.distributed.tensor`)."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the DTensor's own local tensor, outside autograd:
    writing it writes the DTensor); `t` itself for a plain tensor."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def is_device_mesh(obj: Any) -> bool:
    """Whether `obj` is a `torch.distributed.device_mesh.DeviceMesh`."""
    mod = sys.modules.get("torch.distributed.device_mesh")
    return mod is not None and isinstance(obj, mod.DeviceMesh)


def ep_group_of(mesh: Any) -> Any:
    """The process group of expert parallelism on `mesh`: a 1-D mesh's own group, or the group
    of the dimension named `ep` of a larger one. `ConfigError` (field `group`) otherwise."""
    if mesh.ndim == 1:
        return mesh.get_group()
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        raise ConfigError(
            f"a {mesh.ndim}-D device mesh needs a dimension named 'ep' for expert parallelism "
            f"(it has {list(names)}); or pass mesh['ep']",
            field="group",
        )
    return mesh["ep"].get_group()


def ep_mesh(ep: int | None = None, *, device_type: str | None = None) -> Any:
    """A 2-D `DeviceMesh` ("dp", "ep") over the default group's world `W`: EP groups of `ep`
    contiguous ranks (default `W`: plain expert parallelism), `W / ep` of them side by side
    (rank r in EP group r // ep, the expert-data-parallel group r % ep, as
    `poise.runtime.smartmoe.create_groups` lays them out). `device_type`: "cuda" under NCCL,
    else "cpu" (default: from the backend). Collective (it creates the groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("a device mesh needs an initialised process group", field="group")
    world = dist.get_world_size()
    ep = world if ep is None else int(ep)
    if ep < 1 or world % ep:
        raise ConfigError(f"ep={ep} must divide the world size {world}", field="ep")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("dp", "ep"))


def dense_mesh(mesh: Any) -> Any:
    """The 1-D mesh the dense parameters are sharded over: `mesh` itself when 1-D, else its
    dimensions flattened (a dimension of size 1 dropped)."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ConfigError("a multi-dimensional mesh needs dimension names", field="mesh")
    wide = [n for n in names if mesh[n].size() > 1] or [names[-1]]
    if len(wide) == 1:
        return mesh[wide[0]]
    return mesh[tuple(wide)]._flatten("_".join(wide))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules `shard_dense` shards one by one: each module of the model's outermost
    `nn.ModuleList`s (its blocks) that holds a parameter outside the experts."""
    experts = {id(w) for m in find_moe_layers(model) for w in m.experts.weights()}
    units: list[nn.Module] = []
    inside: set[int] = set()  # modules within a unit already chosen
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        for child in module:
            if any(id(p) not in experts for p in child.parameters()):
                units.append(child)
                inside.update(id(m) for m in child.modules())
    return units


def shard_dense(
    model: nn.Module,
    mesh: Any,
    *,
    units: Iterable[nn.Module] | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: Any = None,
) -> nn.Module:
    """`fully_shard` the dense parameters of `model` over `mesh` (a 1-D mesh, or a larger one
    whose dimensions are flattened, `dense_mesh`), leaving every MoE layer's expert weights out,
    with gradients summed over the ranks (divide factor 1). `units`: the modules to shard one
    by one before the model itself (default `shard_units`: its blocks); `reshard_after_forward`,
    `mp_policy`: `fully_shard`'s. Every MoE layer must be expert parallel already
    (`apply_expert_parallel`: `ConfigError`, field `fsdp`, otherwise: experts left out of FSDP
    would not be reduced at all). Collective; returns `model` (now an `FSDPModule`). Build the
    optimizer afterwards: the dense parameters are new (DTensor) parameters."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = find_moe_layers(model)
    for m in layers:
        if not m.expert_parallel:
            raise ConfigError(
                "shard_dense leaves the experts to expert parallelism: call "
                "apply_expert_parallel(model, mesh['ep']) first",
                field=FSDP_FIELD,
            )
        if getattr(m.experts, "_is_fsdp_managed_module", False):
            raise fsdp_refusal()
    experts = {w for m in layers for w in m.experts.weights()}
    flat = dense_mesh(mesh)
    kw: dict[str, Any] = {"mesh": flat, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for unit in shard_units(model) if units is None else list(units):
        fully_shard(unit, ignored_params=experts & set(unit.parameters()), **kw)
    fully_shard(model, ignored_params=experts, **kw)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sums, as Poise's all-reduce
            module.set_force_sum_reduction_for_comms(True)  # SUM only (gloo: no PREMUL_SUM)
    return model


__all__ = [
    "FSDP_FIELD",
    "dense_mesh",
    "dtensor_type",
    "ep_group_of",
    "ep_mesh",
    "is_device_mesh",
    "is_dtensor",
    "local_tensor",
    "shard_dense",
    "shard_units",
]
