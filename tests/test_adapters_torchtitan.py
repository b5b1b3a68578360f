"""torchtitan's MoE converted in place (`poise.adapters.torchtitan`) computes what it did and
trains under the Balancer as static EP does.

A tiny randomly initialised model of two torchtitan 0.3 MoE layers (dim 32, hidden 48, top-2 of
8 experts; one softmax router with `route_norm`, `route_scale` and shared experts, one sigmoid
router with an expert bias), fp32 weights: after `convert_torchtitan_moe` the outputs and
every weight's gradient equal the original's within 1e-6 (the converted experts compute in
bfloat16 from the fp32 weights, as torchtitan's grouped experts do); the input's gradient,
which comes back through both libraries' bf16 backward, within 1e-3 of its size. On 2 gloo
ranks it trains under an eager Balancer with plan changes and the losses of static EP within
1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch

from poise.runtime.launch import run_ranks

titan = pytest.importorskip("torchtitan.models.common.moe")

D, F, E, K, VOCAB, STEPS = 32, 48, 8, 2, 64, 8
TOL = 1e-6


def _moe_config(score: str, shared: bool):
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def lin(i: int, o: int):
        return Linear.Config(in_features=i, out_features=o)

    experts = titan.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)
    return titan.MoE.Config(
        num_experts=E,
        routed_experts=titan.RoutedExperts.Config(
            inner_experts=experts,
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
        router=titan.TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=lin(D, E),
            top_k=K,
            score_func=score,
            route_norm=True,
            route_scale=2.5 if shared else 1.0,
        ),
        shared_experts=FeedForward.Config(w1=lin(D, F), w2=lin(F, D), w3=lin(D, F))
        if shared
        else None,
    )


class Tiny(torch.nn.Module):
    """Embedding, two residual torchtitan MoE layers (`layers[i].moe`, as torchtitan nests
    them), an output head: `ids [B, L] -> logits [B, L, VOCAB]`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Module(), "1": torch.nn.Module()})
        self.layers["0"].moe = titan.MoE(_moe_config("softmax", shared=True))
        self.layers["1"].moe = titan.MoE(_moe_config("sigmoid", shared=False))
        self.head = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.layers.values():
            h = h + block.moe(h)
        return self.head(h)


def _tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        model.layers["1"].moe.expert_bias_E.copy_(torch.randn(E, generator=gen) * 0.01)
    return model


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), ids.view(-1))


def test_a_converted_model_gives_the_outputs_and_gradients_of_the_original() -> None:
    from poise.adapters import PoiseTorchtitanMoE, convert_torchtitan_moe

    ref = _tiny()
    conv = copy.deepcopy(ref)
    assert convert_torchtitan_moe(conv) == ["layers.0.moe", "layers.1.moe"]
    assert all(isinstance(b.moe, PoiseTorchtitanMoE) for b in conv.layers.values())
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    a, b = ref(ids), conv(ids)
    diffs = {"logits": (a - b).abs().max().item()}
    _loss(ref, ids).backward()
    _loss(conv, ids).backward()
    named = dict(ref.named_parameters())
    pairs = []  # (name, gradient after, gradient before)
    for name, p in conv.named_parameters():
        if ".moe.moe.experts." not in name:
            src = name.replace("moe.moe.router.weight", "moe.router.gate.weight")
            pairs.append((name, p.grad, named[src].grad))
    for i in ("0", "1"):
        old = ref.layers[i].moe.routed_experts.inner_experts
        new = conv.layers[i].moe.moe.experts
        for n, got, want in (("w_gate", new.w_gate, old.w1_EFD), ("w_in", new.w_in, old.w3_EFD),
                             ("w_out", new.w_out, old.w2_EDF)):  # fmt: skip
            pairs.append((f"layers.{i}.{n}", got.grad, want.grad.mT))
    grads = {n: ((g - w).abs().max().item(), w.abs().max().item()) for n, g, w in pairs}
    # computing the experts in fp32 instead is more precise than torchtitan's bf16: not equal
    fp32 = copy.deepcopy(ref)
    convert_torchtitan_moe(fp32, compute_dtype=None)
    print(diffs, grads, "fp32 experts:", (fp32(ids) - a).abs().max().item())
    assert diffs["logits"] <= TOL, diffs
    for name, (diff, size) in grads.items():
        if name == "emb.weight":
            # the input's gradient comes back through the experts' bf16 backward, whose two
            # libraries round their sums apart (a bf16 ulp of 2^-8 at most, here far below)
            assert diff <= 1e-3 * size, (name, diff, size)
        else:
            assert diff <= TOL, (name, diff, size)


def test_torchtitans_balancing_buffers_stay_reachable() -> None:
    from poise.adapters import convert_torchtitan_moe

    ref = _tiny()
    conv = copy.deepcopy(ref)
    convert_torchtitan_moe(conv)
    layer = conv.layers["1"].moe
    assert layer.expert_bias_E is layer.moe.router.expert_bias
    torch.testing.assert_close(layer.expert_bias_E, ref.layers["1"].moe.expert_bias_E)
    assert conv.layers["0"].moe.expert_bias_E is not None  # load_balance_coeff's default
    counted = layer.tokens_per_expert_E.clone()
    conv(torch.randint(0, VOCAB, (2, 8)))
    assert (layer.tokens_per_expert_E - counted).sum().item() == 2 * 8 * K
    with torch.no_grad():  # torchtitan's optimizer pre-step hook updates the bias in place
        layer.expert_bias_E.add_(1.0)
    assert layer.moe.router.expert_bias.min().item() > 0.9


def _train_ranks(rank: int, W: int) -> dict:
    import torch.distributed as dist

    from poise.adapters import convert_torchtitan_moe
    from poise.nn import apply_expert_parallel
    from tests.helpers import eager_balancer, train_dense_and_experts

    def loss_of(model, gen):
        return _loss(model, torch.randint(0, VOCAB, (4, 16), generator=gen))

    out = {}
    for balanced in (False, True):
        model = _tiny()
        convert_torchtitan_moe(model)
        with torch.no_grad():  # a skewed router: experts 0 and 1 hot
            for block in model.layers.values():
                block.moe.moe.router.weight[:2] *= 4.0
        apply_expert_parallel(model, dist.group.WORLD, num_slots=E // W + 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        balancer = eager_balancer(model, opt) if balanced else None
        result = train_dense_and_experts(model, opt, rank, STEPS, loss_of, balancer)
        out["balanced" if balanced else "static"] = result
    return out


@pytest.mark.dist
def test_a_converted_torchtitan_model_trains_under_the_balancer_as_static_ep_does() -> None:
    from tests.helpers import assert_balanced_trains_as_static

    assert_balanced_trains_as_static(run_ranks(_train_ranks, 2))


def test_torchtitans_optimizers_container_is_looked_through() -> None:
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from poise.adapters import convert_torchtitan_moe
    from poise.runtime.moves.optimizer_state import ExpertStates

    model = _tiny()
    convert_torchtitan_moe(model)
    groups = [
        ParamGroupConfig(pattern=r"\.moe\.experts\.", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 1e-3}),
        ParamGroupConfig(pattern=r".*", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3}),
    ]  # fmt: skip
    config = OptimizersContainer.Config(param_groups=groups, implementation="for-loop")
    container = OptimizersContainer(config, model_parts=[model])
    _loss(model, torch.randint(0, VOCAB, (2, 8))).backward()
    container.step()
    experts = [w for b in model.layers.values() for w in b.moe.moe.experts.weights()]
    states = ExpertStates(container, experts)
    assert len(container.optimizers) == 2 and not container.state  # the container's own: empty
    inner = container.optimizers[0]
    assert all(states.owners[id(p)] is inner for p in experts)
    assert states.state.get(experts[0])["exp_avg"] is inner.state[experts[0]]["exp_avg"]
