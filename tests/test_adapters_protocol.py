"""The protocol a layer implements to be balanced (`poise.adapters.protocol`), and the expert
moments found inside optimizer containers (`poise.runtime.moves.optimizer_state`).

`poise.nn.MoE` implements `BalanceableMoE`; the Balancer finds the outermost modules that do. An
optimizer container (here one like torchtitan's: a torch `Optimizer` whose own `state` stays
empty, its `optimizers` holding the moments) is looked through: on 2 gloo ranks a Balancer whose
plans move homes trains with the container as static EP does with one AdamW, within 1e-5.
Containers it cannot see into, and optimizers that miss an expert tensor, are refused with one
`ConfigError`.
"""

from __future__ import annotations

import pytest
import torch

from poise.core.errors import ConfigError
from poise.runtime.launch import run_ranks

from .helpers import train_residual_moe

E, D_MODEL, D_EXPERT, TOKENS, STEPS = 8, 8, 16, 64, 10


class Container(torch.optim.Optimizer):
    """Several optimizers stepped as one, as torchtitan's `OptimizersContainer`: an `Optimizer`
    over every parameter whose own `state` stays empty."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def step(self, closure=None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class Hidden:
    """A wrapper that steps an optimizer it does not show."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._inner = optimizer

    def step(self) -> None:
        self._inner.step()


def _model(group=None):
    from poise.nn import MoE, MoEConfig, apply_expert_parallel

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        [MoE(MoEConfig(D_MODEL, D_EXPERT, E, 2, init_seed=i)) for i in range(2)]
    )
    W = 1 if group is None else torch.distributed.get_world_size(group)
    apply_expert_parallel(model, group, num_slots=E // W + 2)
    with torch.no_grad():
        for block in model.blocks:
            block.router.weight[:2] += 0.5
    return model


def _expert_params(model) -> list:
    return [w for b in model.blocks for w in b.experts.weights()]


def _split_adamw(model) -> Container:
    experts = {id(p) for p in _expert_params(model)}
    rest = [p for p in model.parameters() if id(p) not in experts]
    kw = {"lr": 1e-2, "eps": 1e-6}
    return Container(
        [torch.optim.AdamW(_expert_params(model), **kw), torch.optim.AdamW(rest, **kw)]
    )


def test_poise_moe_implements_the_protocol_and_the_outermost_is_found() -> None:
    from poise.adapters import BalanceableMoE, find_balanceable
    from poise.nn import MoE, MoEConfig

    moe = MoE(MoEConfig(8, 16, 4, 2))
    assert isinstance(moe, BalanceableMoE)
    assert not isinstance(moe.router, BalanceableMoE)
    assert not isinstance(moe.experts, BalanceableMoE)
    model = torch.nn.Sequential(moe, torch.nn.Linear(8, 8), MoE(MoEConfig(8, 16, 4, 2)))
    assert find_balanceable(model) == [model[0], model[2]]
    assert find_balanceable(moe) == [moe]


def test_the_moments_are_read_from_the_inner_optimizer_that_holds_them() -> None:
    from poise.runtime.moves.optimizer_state import ExpertStates

    model = _model()
    opt = _split_adamw(model)
    model.blocks[0](torch.randn(16, D_MODEL)).square().mean().backward()
    opt.step()
    params = _expert_params(model)
    states = ExpertStates(opt, params)
    assert not opt.state  # the container's own state is empty: it would be read by mistake
    assert states.owners[id(params[0])] is opt.optimizers[0]
    assert states.state.get(params[0])["exp_avg"] is opt.optimizers[0].state[params[0]]["exp_avg"]
    assert len(states.state) == 3  # block 0's three tensors have state; block 1 had no grads


def test_a_container_it_cannot_see_into_or_missing_an_expert_is_refused() -> None:
    from poise.runtime.balancer import Balancer

    model = _model()
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="cannot see the optimizer state inside Hidden"):
        Balancer(model, Hidden(plain), "static")
    experts = {id(p) for p in _expert_params(model)}
    dense_only = torch.optim.AdamW([p for p in model.parameters() if id(p) not in experts])
    with pytest.raises(ConfigError, match="no optimizer"):
        Balancer(model, Container([dense_only]), "static")
    twice = Container(
        [torch.optim.AdamW(model.parameters()), torch.optim.AdamW(model.parameters())]
    )
    with pytest.raises(ConfigError, match="2 optimizer"):
        Balancer(model, twice, "static")


def _container_ranks(rank: int, W: int) -> dict:
    import torch.distributed as dist

    from tests.helpers import eager_balancer

    model = _model(dist.group.WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    static = train_residual_moe(model, opt, rank, STEPS, TOKENS, D_MODEL)
    model = _model(dist.group.WORLD)
    container = _split_adamw(model)
    balancer = eager_balancer(model, container, "eplb")
    balanced = train_residual_moe(model, container, rank, STEPS, TOKENS, D_MODEL, balancer)
    balancer.close()
    stats = list(balancer.stats)
    return {
        "static": static,
        "balanced": balanced,
        "switched_at": [s.step for s in stats if s.switched],
        "moved_homes": sum(s.moved_homes for s in stats),
    }


@pytest.mark.dist
def test_homes_move_with_their_moments_out_of_an_optimizer_container() -> None:
    for got in run_ranks(_container_ranks, 2):
        print(got["switched_at"], got["moved_homes"])
        assert got["switched_at"] and got["moved_homes"] > 0
        diff = max(abs(a - b) for a, b in zip(got["static"], got["balanced"], strict=True))
        assert diff <= 1e-5, (diff, got["static"], got["balanced"])
