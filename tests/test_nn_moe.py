"""The MoE layer against a naive reference: every expert on every token, masked by the routing.

Single process: outputs, input, router and expert gradients, aux losses. Several gloo ranks
(2 and 4): the same, for static EP, hand-made replicas and the plans of every policy
(replica rows hold copies of the home weights; home grad + replica grads = reference grad)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Assignment, Placement
from poise.nn import (
    MoE,
    MoEConfig,
    NonFiniteInputError,
    RankRouting,
    apply_expert_parallel,
    install_bias_update,
    raise_if_nonfinite,
    slot_maps,
    sync_router_grads,
)
from poise.runtime.launch import run_ranks

from .helpers import toy_cluster, toy_spec

TOL = 1e-5


# ----------------------------------------------------------------------------- reference
def full_weights(E: int, D: int, H: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert weights `[E, ...]` and the router's `[E, D]`, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(E, D, generator=g) * 0.5,
        "w_in": torch.randn(E, D, H, generator=g) / D**0.5,
        "w_gate": torch.randn(E, D, H, generator=g) / D**0.5,
        "w_out": torch.randn(E, H, D, generator=g) / H**0.5,
    }


def tokens(rank: int, T: int, D: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(1000 * seed + rank + 7))


def naive_keep(experts: torch.Tensor, E: int, capacity: int | None) -> torch.Tensor:
    """Drops by hand: first choices in token order, then second choices."""
    T, k = experts.shape
    keep = torch.ones(T, k, dtype=torch.bool)
    if capacity is None:
        return keep
    used = [0] * E
    for j in range(k):
        for t in range(T):
            e = int(experts[t, j])
            keep[t, j] = used[e] < capacity
            used[e] += 1
    return keep


def naive_moe(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    k: int,
    activation: str = "swiglu",
    score: str = "softmax",
    capacity: int | None = None,
    balance_coef: float = 0.0,
    z_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y [T, D], aux loss)` computed densely: every expert on every token."""
    E = w["router"].shape[0]
    logits = x @ w["router"].t()
    p = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    top, idx = p.topk(k, -1)
    if k > 1:
        top = top / top.sum(-1, keepdim=True)
    top = top * naive_keep(idx, E, capacity)
    y = torch.zeros_like(x)
    for e in range(E):
        h = x @ w["w_in"][e]
        a = F.gelu(h) if activation == "gelu" else F.silu(x @ w["w_gate"][e]) * h
        y = y + (top * (idx == e)).sum(-1, keepdim=True) * (a @ w["w_out"][e])
    if x.shape[0] == 0:
        return y, x.new_zeros(())
    probs = p if score == "softmax" else p / p.sum(-1, keepdim=True)
    f = torch.stack([(idx == e).sum() for e in range(E)]).float() / (x.shape[0] * k)
    balance = E * (f * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return y, balance_coef * balance + z_coef * z


def upstream(rank: int, T: int, D: int) -> torch.Tensor:
    """A fixed gradient for y (the loss is `(y * upstream).sum() + aux`)."""
    return torch.randn(T, D, generator=torch.Generator().manual_seed(555 + rank))


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One layer configuration run on every rank; `placement`/`assignment` None: static."""

    name: str
    E: int = 8
    D: int = 16
    H: int = 32
    k: int = 2
    activation: str = "swiglu"
    score: str = "softmax"
    slots: int | None = None
    placement: Placement | None = None
    assignment: Assignment | None = None
    overlap: int = 1
    capacity_factor: float | None = None
    balance_coef: float = 0.0
    z_coef: float = 0.0
    T: tuple[int, ...] = (13, 9, 0, 21)
    kw: dict = field(default_factory=dict)

    def tokens_of(self, rank: int) -> int:
        return self.T[rank % len(self.T)]


def build_layer(case: Case, rank: int, world: int) -> MoE:
    """The case's compute-only layer, made expert parallel over the world (or over this process
    alone when the case asks for slots on one rank)."""
    import torch.distributed as dist

    cfg = MoEConfig(
        case.D,
        case.H,
        case.E,
        case.k,
        activation=case.activation,  # type: ignore[arg-type]
        score=case.score,  # type: ignore[arg-type]
        overlap_degree=case.overlap,
        capacity_factor=case.capacity_factor,
        balance_coef=case.balance_coef,
        z_loss_coef=case.z_coef,
        **case.kw,
    )
    moe = MoE(cfg)
    if world > 1 or case.slots is not None:
        apply_expert_parallel(moe, dist.group.WORLD if world > 1 else None, num_slots=case.slots)
    if case.placement is not None:
        maps = slot_maps(case.placement, 0, moe.num_slots)
        moe.set_routing(case.placement, case.assignment, maps[rank])
    w = full_weights(case.E, case.D, case.H)
    moe.load_expert_weights(w)
    with torch.no_grad():
        moe.router.weight.copy_(w["router"])
    return moe


def expert_params(moe: MoE) -> dict[str, torch.Tensor]:
    names = ("w_in", "w_gate", "w_out")
    return {n: getattr(moe.experts, n) for n in names if getattr(moe.experts, n) is not None}


def run_case(case: Case, rank: int, world: int) -> dict:
    """Forward and backward of one case on this rank; what the parent compares."""
    moe = build_layer(case, rank, world)
    T = case.tokens_of(rank)
    x = tokens(rank, T, case.D).requires_grad_()
    y = moe(x)
    loss = (y * upstream(rank, T, case.D)).sum() + moe.last_forward.aux_loss
    loss.backward()
    sync_router_grads(moe)
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "router_grad": moe.router.weight.grad,
        "slots": moe.routing.slots.expert.copy(),
        "grads": {n: w.grad for n, w in expert_params(moe).items()},
        "counts": moe.last_counts.clone(),
    }


def run_cases(rank: int, world: int, cases: list[Case]) -> dict[str, dict]:
    torch.manual_seed(0)
    return {case.name: run_case(case, rank, world) for case in cases}


def check_against_reference(case: Case, results: list[dict]) -> None:
    """Outputs, input grads, router grad (summed over ranks) and per-expert grads (summed over
    every slot holding the expert, homes and replicas) against the naive reference."""
    w = {n: t.clone().requires_grad_() for n, t in full_weights(case.E, case.D, case.H).items()}
    for rank, res in enumerate(results):
        T = case.tokens_of(rank)
        x = tokens(rank, T, case.D).requires_grad_()
        cap = None
        if case.capacity_factor is not None:
            cap = int(np.ceil(case.capacity_factor * T * case.k / case.E))
        y, aux = naive_moe(
            x, w, case.k, case.activation, case.score, cap, case.balance_coef, case.z_coef
        )
        ((y * upstream(rank, T, case.D)).sum() + aux).backward()
        where = f"{case.name} rank {rank}"
        torch.testing.assert_close(res["y"], y.detach(), atol=TOL, rtol=0, msg=where)
        torch.testing.assert_close(res["x_grad"], x.grad, atol=TOL, rtol=0, msg=where)
    for res in results:
        torch.testing.assert_close(
            res["router_grad"], w["router"].grad, atol=TOL, rtol=0, msg=case.name
        )
    for name, ref in w.items():
        if name == "router" or name not in results[0]["grads"]:
            continue
        got = torch.zeros_like(ref)
        for res in results:
            for slot, e in enumerate(res["slots"].tolist()):
                if e >= 0:
                    got[e] += res["grads"][name][slot]
                else:
                    assert res["grads"][name][slot].abs().max() == 0
        torch.testing.assert_close(got, ref.grad, atol=TOL, rtol=0, msg=f"{case.name} {name}")


# ----------------------------------------------------------------------------- single process
@pytest.mark.parametrize(
    ("activation", "score", "balance", "z"),
    [
        ("swiglu", "softmax", 0.0, 0.0),
        ("gelu", "softmax", 0.01, 0.001),
        ("swiglu", "sigmoid", 0.1, 0.0),
    ],
)
def test_single_process_matches_reference(activation: str, score: str, balance: float, z: float):
    case = Case("one", activation=activation, score=score, balance_coef=balance, z_coef=z)
    check_against_reference(case, [run_case(case, 0, 1)])


def test_single_process_capacity_and_top1():
    for case in (Case("cap", capacity_factor=0.75, T=(40,)), Case("top1", k=1, T=(30,))):
        check_against_reference(case, [run_case(case, 0, 1)])


def test_single_process_custom_routing_with_spare_slots():
    placement = Placement.from_homes(np.zeros((1, 8), dtype=np.int64), 1, 10)
    case = Case("spare", slots=10, placement=placement, assignment=Assignment.even(placement))
    check_against_reference(case, [run_case(case, 0, 1)])


def test_batch_shape_last_counts_and_losses():
    moe = MoE(MoEConfig(16, 32, 4, 2, balance_coef=0.01, z_loss_coef=0.001))
    x = torch.randn(3, 5, 16)
    y = moe(x)
    assert y.shape == x.shape
    assert moe.last_counts.shape == (4,) and int(moe.last_counts.sum()) == 3 * 5 * 2
    last = moe.last_forward
    assert last.aux_loss.requires_grad and float(last.balance_loss.detach()) > 0
    assert float(last.z_loss.detach()) > 0
    assert set(last.seconds) == {"gate", "dispatch", "experts", "combine"}


def test_replay_router_drives_the_layer():
    from poise.nn import ReplayRouter
    from poise.trace.trace import Trace

    counts = np.array([[[[30, 10, 0, 20]]], [[[0, 0, 40, 20]]]])  # [steps, 1, 1, 4]
    trace = Trace(counts, np.arange(2), top_k=2, tokens_per_device=30)
    moe = MoE(MoEConfig(16, 32, 4, 2), router=ReplayRouter(16, 4, 2, trace))
    moe(torch.randn(30, 16))
    assert moe.last_counts.tolist() == [30, 10, 0, 20]
    moe.router.set_step(1)
    moe(torch.randn(15, 16))
    assert moe.last_counts.tolist() == [0, 0, 15, 15]  # 40:20 scaled to 30, capped at 15


def test_nan_input_is_one_clear_error_and_can_be_switched_off():
    cfg = MoEConfig(16, 32, 4, 2)
    moe = MoE(cfg)
    x = torch.randn(6, 16)
    x[2, 3] = float("nan")
    moe(x)  # forward only sets a device flag: no host synchronisation
    with pytest.raises(NonFiniteInputError, match="NaN or infinity"):
        raise_if_nonfinite(moe)  # the step boundary
    raise_if_nonfinite(moe)  # the flag was reset
    moe(torch.randn(6, 16))
    raise_if_nonfinite(moe)  # finite input: nothing
    quiet = MoE(cfg.replace(check_finite=False))
    quiet(x)
    raise_if_nonfinite(quiet)  # no check, no error


HOST_SYNCS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist")


def count_host_syncs(monkeypatch, fn) -> dict[str, int]:
    """Run `fn()` with every tensor-to-Python conversion (`HOST_SYNCS`, each a device-to-host
    synchronisation on an accelerator) counted, by name."""
    calls = dict.fromkeys(HOST_SYNCS, 0)
    for name in HOST_SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    fn()
    monkeypatch.undo()
    return calls


def test_forward_does_not_synchronise_with_the_host(monkeypatch):
    """Dropless MoE.forward (with a Balancer's hooks attached) converts no tensor to a Python
    value, the finiteness check included. One process, so there is no counts exchange; the
    one conversion allowed is its equivalent: the grouped GEMM's sizes per slot (one
    `tolist`). Infinity in the input still raises, at the step boundary."""
    from poise.runtime.balancer import Balancer, BalancerConfig
    from poise.runtime.plan_inputs import default_cluster

    torch.manual_seed(0)
    moe = MoE(MoEConfig(16, 32, 4, 2))
    apply_expert_parallel(moe, None, num_slots=5)
    config = BalancerConfig(cluster=default_cluster(1))
    balancer = Balancer(moe, torch.optim.AdamW(moe.parameters()), "auto", 2, config)
    x = torch.randn(24, 16)
    x[3, 1] = float("inf")
    moe(x)  # warm-up (lazy initialisation may convert)
    calls = count_host_syncs(monkeypatch, lambda: moe(x))
    group_sizes = calls.pop("tolist")
    assert calls == dict.fromkeys(calls, 0), calls
    assert group_sizes <= 1  # the grouped GEMM's sizes, as the counts exchange gives them
    with pytest.raises(NonFiniteInputError, match="NaN or infinity"):
        balancer.reduce_replicas()  # the step boundary raises
    balancer.close()


def test_counts_match_bincount_without_its_host_wait():
    """`count_values` against `torch.bincount` (the reference it replaces in the router and the
    dispatcher, whose CUDA kernel reads the input's range on the host): shapes [T, k] and flat,
    a sentinel value, values that leave experts empty, and no values at all."""
    from poise.nn.counts import count_values

    gen = torch.Generator().manual_seed(3)
    for shape, n in (((50, 2), 8), ((7,), 9), ((0, 2), 4), ((40, 3), 64)):
        values = torch.randint(0, max(1, n // 2), shape, generator=gen)
        got = count_values(values, n)
        assert got.dtype == torch.long and got.shape == (n,)
        assert torch.equal(got, torch.bincount(values.reshape(-1), minlength=n)), (shape, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dropless_forward_on_cuda_never_waits_for_the_gpu():
    """On one GPU (no counts exchange) a dropless bf16 layer's forward and backward make no
    host synchronisation at all: CUDA's sync debug mode set to "error" raises on any. Before
    `count_values`, the router's and the dispatcher's `bincount` waited twice each
    (`benchmarks/cuda_syncs.py`)."""
    device = torch.device("cuda")
    moe = MoE(MoEConfig(64, 128, 8, 2), device=device, dtype=torch.bfloat16)
    x = torch.randn(256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().sum().backward()  # warm-up: lazy initialisation may wait
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe(x)
        (y.float().sum() + moe.last_forward.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert moe.experts.resolved_impl(x) == "grouped"
    assert int(moe.last_counts.sum()) == 256 * 2


def test_world_must_fit_the_experts():
    from poise.nn import check_world

    check_world(8, 4)
    check_world(2, 4)
    for experts, world in ((6, 4), (3, 2), (4, 6)):
        with pytest.raises(ConfigError, match="do not fit"):
            check_world(experts, world)
    with pytest.raises(ConfigError, match="slots") as info:
        apply_expert_parallel(MoE(MoEConfig(16, 32, 4, 2)), None, num_slots=3)
    assert info.value.field == "num_slots"


def test_set_routing_refuses_plans_that_do_not_fit():
    moe = MoE(MoEConfig(16, 32, 4, 2))
    placement = Placement.from_homes(np.zeros((1, 4), dtype=np.int64), 1, 6)
    with pytest.raises(PlanError, match="slots"):
        moe.set_routing(placement, Assignment.even(placement), slot_maps(placement, 0, 6)[0])
    two = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 4)
    with pytest.raises(PlanError, match="ranks"):
        moe.set_routing(two, Assignment.even(two), slot_maps(two, 0, 4)[0])


def test_expert_weights_do_not_depend_on_the_slots():
    torch.manual_seed(3)
    one = MoE(MoEConfig(16, 32, 4, 2, init_seed=11))
    two = MoE(MoEConfig(16, 32, 4, 2, init_seed=11))
    apply_expert_parallel(two, None, num_slots=6)
    for name in ("w_in", "w_gate", "w_out"):
        a, b = getattr(one.experts, name), getattr(two.experts, name)
        torch.testing.assert_close(a, b[:4], rtol=0, atol=0)
        assert b[4:].abs().max() == 0


def test_bias_update_hook_runs_before_the_optimizer_step():
    moe = MoE(MoEConfig(16, 32, 4, 1, expert_bias=True))
    opt = torch.optim.SGD(moe.parameters(), lr=0.0)
    handle = install_bias_update(opt, moe, rate=0.5)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 10.0  # every token with x[:, 0] > 0 picks expert 2
    x = torch.randn(32, 16)
    x[:, 0] = x[:, 0].abs() + 1
    moe(x).sum().backward()
    opt.step()
    assert moe.router.expert_bias.tolist() == [0.5, 0.5, -0.5, 0.5]
    assert int(moe.bias_counts.sum()) == 0
    handle.remove()


# ----------------------------------------------------------------------------- several ranks
def policy_cases(world: int, E: int = 8) -> list[Case]:
    """Plans of every policy on skewed loads (hot experts 0 and 1), with two spare slots."""
    from poise.plan.policies import REGISTRY, PlanContext, make_plan

    nodes = 2 if world >= 4 else 1
    cluster = toy_cluster(world // nodes, nodes, 1, bw=1e9, inter_bw=2e8, lat=1e-6, flops=1e9)
    spec = toy_spec(experts=E, layers=1, d_model=16, d_expert=32, top_k=2, tokens=64)
    rng = np.random.default_rng(world)
    loads = rng.integers(1, 5, (1, world, E)).astype(float)
    loads[0, :, 0] += 60
    loads[0, :, 1] += 20
    slots = E // world + 2
    ctx = PlanContext.create(cluster, spec, slots_per_device=slots, history=loads.sum(1)[None])
    cases = []
    for name in sorted(REGISTRY):
        plan = make_plan(name, loads, None, ctx)
        cases.append(Case(f"policy-{name}", E=E, slots=slots, placement=plan.placement,
                          assignment=plan.assignment))  # fmt: skip
    return cases


def replica_cases(world: int) -> list[Case]:
    """Hand-made replicas: expert 0 everywhere, expert 5 on rank 0 too; even and to-home
    assignments; SwiGLU and GELU; aux losses; capacity; overlap chunks."""
    E = 8
    home = (np.arange(E) * world) // E
    placement = Placement.from_homes(home[None, :], world, E // world + 2)
    placement.copies[0, :, 0] = 1
    placement.copies[0, 0, 5] = 1
    even, to_home = Assignment.even(placement), Assignment.to_home(placement)
    slots = E // world + 2
    common = {"E": E, "slots": slots, "placement": placement}
    return [
        Case("static"),
        Case("static-gelu-aux", activation="gelu", balance_coef=0.01, z_coef=0.001),
        Case("static-capacity", capacity_factor=1.0, T=(30, 24, 18, 40)),
        Case("static-overlap3", overlap=3, T=(40, 31, 17, 0)),
        Case("replicas-even", assignment=even, **common),
        Case("replicas-home-gelu", assignment=to_home, activation="gelu", **common),
        Case("replicas-overlap2", assignment=even, overlap=2, **common),
    ]


def _check_results(cases: list[Case], per_rank: list[dict[str, dict]]) -> None:
    for case in cases:
        check_against_reference(case, [r[case.name] for r in per_rank])


@pytest.mark.dist
def test_two_ranks_match_reference_for_every_routing():
    cases = replica_cases(2) + policy_cases(2)
    assert sum(c.placement is not None and c.placement.replicas().any() for c in cases) >= 5
    _check_results(cases, run_ranks(run_cases, 2, cases))


@pytest.mark.dist
def test_four_ranks_match_reference_including_expert_data_parallel():
    cases = replica_cases(4) + policy_cases(4)
    cases.append(Case("edp-2experts-on-4", E=2, T=(11, 0, 7, 5)))  # W > E: two ranks per expert
    cases.append(Case("edp-gelu-top1", E=2, k=1, activation="gelu", T=(6, 9, 3, 5)))
    assert any(c.placement is not None and c.assignment.grouped for c in cases)  # hybrid
    _check_results(cases, run_ranks(run_cases, 4, cases))


def test_static_routing_is_the_static_policy():
    from poise.core.static_ep import static_assignment
    from poise.plan.policies.base import static_placement

    for experts, world in ((8, 2), (8, 8), (2, 4), (4, 8)):
        slots = max(experts // world, 1)
        ref = static_placement(1, experts, world, slots)
        routes = static_assignment(ref).source_weights()[0]  # [Ds, E, Dd]
        maps = slot_maps(ref, 0, slots)
        for rank in range(world):
            lay = RankRouting.static(experts, world, rank, slots)
            np.testing.assert_array_equal(lay.home, ref.home[0])
            np.testing.assert_array_equal(lay.copies, ref.copies[0])
            np.testing.assert_array_equal(lay.slots.expert, maps[rank].expert)
            np.testing.assert_array_equal(lay.weights, routes[rank])
            if world > experts:  # DeepSpeed's EP groups: each expert to the group's own copy
                group = rank // experts * experts
                want = np.zeros((experts, world))
                want[np.arange(experts), group + np.arange(experts)] = 1.0
                np.testing.assert_array_equal(lay.weights, want)
