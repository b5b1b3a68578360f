"""Small builders shared by tests: a toy cluster and model with round numbers, and the
benchmark scripts loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from poise.core.cluster import Cluster, Link
from poise.core.spec import ModelSpec


def toy_cluster(
    devices_per_node: int = 2,
    nodes: int = 1,
    domains: int = 1,
    bw: float = 1e9,
    inter_bw: float | None = None,
    wan_bw: float | None = None,
    lat: float = 0.0,
    flops: float = 1e9,
    nics_per_node: int | None = None,
) -> Cluster:
    """Round numbers for hand computation: no small-GEMM loss, latency `lat` on every level,
    `flops` FLOP/s for every compute dtype. `nics_per_node`: None, one link per device at every
    level; else that many NICs per node (each shared by devices_per_node / nics devices) and one
    uplink per domain."""
    shared = devices_per_node // nics_per_node if nics_per_node else 1
    uplink = devices_per_node * nodes if nics_per_node else 1
    return Cluster(
        name="toy",
        devices_per_node=devices_per_node,
        nodes_per_domain=nodes,
        domains=domains,
        peak_flops=flops,
        memory_bytes=1e12,
        intra_node=Link(bw, lat),
        inter_node=Link(inter_bw or bw, lat, shared),
        inter_domain=Link(wan_bw or inter_bw or bw, lat, uplink),
    )


def toy_spec(
    experts: int = 2,
    layers: int = 1,
    d_model: int = 4,
    d_expert: int = 8,
    top_k: int = 1,
    tokens: int = 100,
    non_moe: float = 0.0,
) -> ModelSpec:
    """fp32 GELU experts: expert bytes = 2*d_model*d_expert*4, token bytes = 4*d_model."""
    return ModelSpec(
        name="toy",
        d_model=d_model,
        d_expert=d_expert,
        experts=experts,
        top_k=top_k,
        moe_layers=layers,
        dtype_bytes=4,
        tokens_per_device=tokens,
        non_moe_flops_per_token=non_moe,
        optimizer_bytes_per_param=8.0,
    )


def tiny_train_config(root: str, name: str, **overrides: object):
    """A `TrainConfig` of the `tiny` GPT-MoE sized for multi-rank tests (context 32, global batch
    8, no aux loss, no eval, quiet), writing under `root/name`; `overrides` change any field."""
    from poise.train import TrainConfig

    base: dict[str, object] = dict(
        model="tiny",
        context=32,
        batch=8,
        warmup=3,
        lr=1e-3,
        aux_loss=0.0,
        spare_slots=2,
        replan_every=2,
        eval_every=0,
        checkpoint_every=0,
        log_every=1000,
        progress=False,
        tensorboard=False,
        cache_dir=f"{root}/cache",
        out=f"{root}/{name}",
    )
    base.update(overrides)
    return TrainConfig(**base)


def train_residual_moe(
    model, opt, rank: int, steps: int, tokens: int, d_model: int, balancer=None, each_step=None
) -> list[float]:
    """This rank's loss per step of a residual stack of MoE layers (`model.blocks`) regressing
    random targets: inputs and targets drawn from a generator seeded by the rank, router
    gradients summed over the ranks before each optimizer step; with a `balancer`, its
    `reduce_replicas()` before and `step()` after the optimizer step; `each_step(s)` called
    before step s's forward (e.g. a replayed router's `set_step`)."""
    import torch

    from poise.nn import sync_router_grads

    gen = torch.Generator().manual_seed(7 + rank)
    losses = []
    for s in range(steps):
        if each_step is not None:
            each_step(s)
        x = torch.randn(tokens, d_model, generator=gen) + 1.0
        target = torch.randn(tokens, d_model, generator=gen)
        y = x
        for block in model.blocks:
            y = y + block(y)
        loss = ((y - target) ** 2).mean()
        loss.backward()
        sync_router_grads(model)
        if balancer is not None:
            balancer.reduce_replicas()
        opt.step()
        if balancer is not None:
            balancer.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def assert_priced_as_the_cost_model(plan, cost, loads, device_load_rtol: float = 0.0) -> None:
    """A plan's cost (which a policy may hand `finish_plan` from its own search) equals
    `cost.price` of the plan on `loads` with its migrations: every phase and layer time to
    rtol 1e-9, the computed tokens to `device_load_rtol` (0: bit for bit)."""
    import numpy as np

    from poise.cost.phases import PHASE_NAMES

    fresh = cost.price(plan.placement, plan.assignment, loads, plan.transfers.migrations)
    np.testing.assert_allclose(plan.cost.layer_s, fresh.layer_s, rtol=1e-9)
    np.testing.assert_allclose(plan.cost.device_load, fresh.device_load, rtol=device_load_rtol)
    for name in PHASE_NAMES:
        np.testing.assert_allclose(
            getattr(plan.cost.phases, name), getattr(fresh.phases, name), rtol=1e-9, err_msg=name
        )


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/NAME.py` as the module `bench_NAME` (registered in `sys.modules`, so that its
    dataclasses resolve). A script that imports its sibling modules (`peers`) needs
    `BENCHMARKS` on `sys.path` first (`monkeypatch.syspath_prepend(str(BENCHMARKS))`)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
