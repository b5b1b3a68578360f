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


def slow_gemm_cluster(
    devices: int = 2, one_link: bool = True, name: str = "test-slow-gemms"
) -> Cluster:
    """A test cluster of `devices` CPU ranks on one node whose expert GEMMs are slow next to its
    links, so that moving compute off a busy rank pays for a small expert's Trans and Agg and
    the `tiny` model's plans replicate: 5e10 FLOP/s at efficiency 1.0 for every dtype, half rows
    16, links of 4 GB/s and 30 us. These are the round figures the `cpu-2` preset carried
    before it took this machine's calibration (206.2 GFLOP/s, half rows 39.6, 1.68 GB/s,
    145 us: docs/benchmarks.md, "Calibration"), under which such plans no longer pay; not a
    measurement. `one_link`: the ranks share one link (`Link.shared_by` = `devices`), as
    `runtime.plan_inputs.default_cluster` models the processes of one host; memory 8 GiB each."""
    link = Link(4e9, 30e-6, devices if one_link else 1)
    return Cluster(
        name=name,
        devices_per_node=devices,
        nodes_per_domain=1,
        domains=1,
        peak_flops=5e10,
        memory_bytes=8 * 2**30,
        intra_node=link,
        inter_node=link,
        inter_domain=link,
        gemm_half_rows=16.0,
    )


def slow_gemm_cluster_file(root: str | Path, devices: int = 2, one_link: bool = True) -> str:
    """`slow_gemm_cluster` saved (atomically) as a YAML file under `root`, for a training run's
    `cluster` field, which takes a preset's name or a file; returns the path."""
    path = Path(root) / f"test-slow-gemms-{devices}{'-one-link' if one_link else ''}.yaml"
    slow_gemm_cluster(devices, one_link).save(path)
    return str(path)


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


def replica_case():
    """tests/test_cost.py's hand-computed case: 2 devices, experts homed on d0, d1; counts
    [[10, 30], [20, 40]]; the candidate replicates e1 on d0 (d0's 30 e1-tokens stay home).
    toy_spec: token 16 B, expert 256 B, 128 FLOP per token forward; 1e9 B/s, 1e9 FLOP/s.
    Static: d1 computes 70 tokens, d0 sends 30 -> busy = 3 * 70 * 128 + 2 * 30 * 16 = 27,840 ns.
    Replica: loads [60, 40], d0 sends 20 -> busy = 3 * 60 * 128 + 2 * 20 * 16 = 23,680 ns;
    Trans + Agg = 2 * 256 = 512 ns. Returns `(cost, static, replica, counts[L, D, E])`."""
    import numpy as np

    from poise.core.placement import Assignment, Placement, Plan, transfers_between
    from poise.cost.model import CostModel

    spec = toy_spec(experts=2)
    cost = CostModel(toy_cluster(bw=1e9, flops=1e9), spec)
    p = Placement.from_homes(np.array([[0, 1]]), 2, 2)
    static = Plan("static", p, Assignment.to_home(p), transfers_between(None, p, spec))
    r = p.copy()
    r.copies[0, 0, 1] = 1
    replica = Plan("r", r, Assignment.to_home(r), transfers_between(p, r, spec))
    counts = np.array([[[10, 30], [20, 40]]], dtype=float)
    return cost, static, replica, counts


def measured_rows(periods_s, ids: bool = False):
    """`[n, len(MEASURED)]` measurement rows (`[n, 1 + len(MEASURED)]` with step ids 1..n
    first where `ids`) that are all zero but their periods."""
    import numpy as np

    from poise.runtime.selfcal.fit import MEASURED, PERIOD

    periods_s = np.asarray(periods_s, dtype=float)
    out = np.zeros((len(periods_s), len(MEASURED)))
    out[:, PERIOD] = periods_s
    if ids:
        out = np.concatenate([np.arange(1, len(out) + 1)[:, None].astype(float), out], axis=1)
    return out


def probes_reading(counts, clocks_s):
    """`Probes` on `counts[L, D, E]` whose probe i ran `clocks_s[i]` slower than its one
    neighbour (the paired clock's `d_i`), every period about 1 ms."""
    import numpy as np

    from poise.runtime.control.clock import Probes

    n = len(clocks_s)
    steps = np.stack([counts] * n)
    return Probes(
        steps, measured_rows(1e-3 + np.asarray(clocks_s)), steps, measured_rows(np.full(n, 1e-3)),
        np.arange(n),
    )  # fmt: skip


def replica_job(probes=None, steps: int = 4, **changes):
    """A calibrating `PlanningJob` with `replica_case`'s replica plan in force for `steps` steps
    (as many as `probes` has, where given) of the same counts, their rows empty but their
    periods (1 ms), policy `static`, forecast `last`; `changes` replace any field."""
    import dataclasses

    import numpy as np

    from poise.plan.predict import Predictor
    from poise.runtime.control.job import PlanningJob
    from poise.runtime.selfcal.fit import Fit

    cost, static, replica, counts = replica_case()
    n = len(probes) if probes is not None else steps
    history = np.stack([counts] * n)
    job = PlanningJob(
        history=history, fit_counts=history, fit_rows=measured_rows(np.full(n, 1e-3), ids=True),
        settled=np.ones(n, dtype=bool), current=replica, static=static, prior=cost.cluster,
        spec=toy_spec(experts=2), previous=Fit(), policy="static", predictor=Predictor("last"),
        options={}, slots=2, horizon=10, split_tokens=False, probes=probes,
    )  # fmt: skip
    return dataclasses.replace(job, **changes)


def one_rank_balancer(replan_every: int, plan_lag: int, policy: str = "auto", **config):
    """A one-layer MoE (8 wide, 4 experts top-2) on one rank with a spare slot, its AdamW and a
    Balancer re-planning every `replan_every` steps on one modelled CPU device; `config`:
    further `BalancerConfig` fields. Returns `(model, optimizer, balancer)`."""
    import torch

    from poise.nn import MoE, MoEConfig, apply_expert_parallel
    from poise.runtime.balancer import Balancer, BalancerConfig
    from poise.runtime.plan_inputs import default_cluster

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)))
    apply_expert_parallel(model, None, num_slots=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = BalancerConfig(cluster=default_cluster(1), plan_lag=plan_lag, **config)
    return model, opt, Balancer(model, opt, policy, replan_every, cfg)


def one_rank_steps(model, opt, balancer, steps: int) -> None:
    """`steps` training steps of a one-rank model taking `[16, 8]` inputs, as the loop runs
    them (the Balancer's `reduce_replicas` before the optimizer, `step` after it)."""
    import torch

    for _ in range(steps):
        model(torch.randn(16, 8)).square().mean().backward()
        balancer.reduce_replicas()
        opt.step()
        balancer.step()
        opt.zero_grad()


def spy_jobs(balancer, what=lambda job, requested_at: requested_at) -> list:
    """`what(job, requested at)` of every planning job `balancer` submits from now on (default
    the step it was requested at), in a list that fills as the steps run."""
    planner = balancer.planning.planner
    submit = planner.submit
    seen: list = []

    def spy(fn, requested_at, adopt_at):
        seen.append(what(fn.args[0], requested_at))
        return submit(fn, requested_at=requested_at, adopt_at=adopt_at)

    planner.submit = spy
    return seen


def train_dense_and_experts(model, opt, rank: int, steps: int, loss_of, balancer=None) -> dict:
    """`steps` training steps of a converted model on this rank: `loss_of(model, gen)` draws
    the step's batch from `gen` (seeded by the rank) and returns its loss; after `backward` the
    routers' gradients are summed over the ranks (`sync_router_grads`) and so are the other
    non-expert gradients (one all-reduce, as data parallelism with SUM); with a `balancer`, its
    `reduce_replicas()` before and `step()` after the optimizer step. Returns the losses and,
    with a balancer, the steps that switched plans and the homes moved."""
    import torch
    import torch.distributed as dist

    from poise.nn import find_moe_layers, sync_router_grads

    layers = find_moe_layers(model)
    skip = {id(p) for m in layers for p in [*m.experts.weights(), *m.router.parameters()]}
    dense = [p for p in model.parameters() if id(p) not in skip and p.requires_grad]
    gen = torch.Generator().manual_seed(11 + rank)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, gen)
        loss.backward()
        sync_router_grads(model)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(dense, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        if balancer is not None:
            balancer.reduce_replicas()
        opt.step()
        if balancer is not None:
            balancer.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    out: dict = {"losses": losses}
    if balancer is not None:
        balancer.close()
        stats = list(balancer.stats)
        out["switched_at"] = [s.step for s in stats if s.switched]
        out["moved_homes"] = sum(s.moved_homes for s in stats)
    return out


def eager_balancer(model, opt, policy: str = "eplb", replan_every: int = 2):
    """A Balancer over `model`'s layers on the world group that adopts every plan that differs
    from the one in force (guard and self-calibration off), priced on a toy cluster of fast
    links and slow GEMMs, where balancing always looks worth its transfers."""
    import torch.distributed as dist

    from poise.runtime.balancer import Balancer, BalancerConfig

    W = dist.get_world_size()
    cluster = toy_cluster(devices_per_node=W, bw=1e12, flops=1e6)
    config = BalancerConfig(cluster=cluster, guard=False, calibrate=False)
    return Balancer(model, opt, policy, replan_every, config)


def assert_balanced_trains_as_static(per_rank: list[dict], tol: float = 1e-5) -> None:
    """Each rank's `{"static": ..., "balanced": ...}` (`train_dense_and_experts` results): a plan
    took effect under the Balancer, and its losses equal static EP's within `tol`."""
    for got in per_rank:
        static, balanced = got["static"], got["balanced"]
        assert balanced["switched_at"], "no plan took effect"
        pairs = zip(static["losses"], balanced["losses"], strict=True)
        diff = max(abs(x - y) for x, y in pairs)
        assert diff <= tol, (diff, static["losses"], balanced["losses"])
