"""Expert parallelism attached from outside: `apply_expert_parallel` on compute-only layers.

On 2 gloo ranks: a model built on one device and then made expert parallel computes what the
single-device model computes (outputs and every gradient, to float rounding); a world that does
not fit the experts and ranks that disagree are `ConfigError`s naming the field; the README's
"The layer in your model" snippet runs as written. One process: counts are buffers, the config
refuses bad values by field, and the helpers that replaced the per-module copies behave."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from poise.core.errors import ConfigError
from poise.nn import MoE, MoEConfig, apply_expert_parallel, comm_device, sync_router_grads
from poise.runtime.launch import run_ranks
from poise.util.digest import digest

M, H, E, K = 8, 16, 4, 2
TOKENS = (11, 7)
README = Path(__file__).resolve().parent.parent / "README.md"


class Net(nn.Module):
    """A dense layer, then an MoE layer with a residual: `[T, M] -> [T, M]`."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.inp = nn.Linear(moe.d_model, moe.d_model)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return h + self.moe(h)


def _net(**cfg: object) -> Net:
    torch.manual_seed(0)
    return Net(MoE(MoEConfig(M, H, E, K, init_seed=5, balance_coef=0.01, **cfg)))  # type: ignore[arg-type]


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + rank)
    return torch.randn(TOKENS[rank], M, generator=g), torch.randn(TOKENS[rank], M, generator=g)


def _loss(net: Net, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, up = _batch(rank)
    y = net(x)
    return y, (y * up).sum() + net.moe.last_forward.aux_loss


# ----------------------------------------------------------------------------- 2 ranks
def _rank_equivalence(rank: int, world: int) -> dict:
    import torch.distributed as dist

    # The single-device model, on every rank's tokens: the reference.
    ref = _net()
    ref_y = []
    for r in range(world):
        y, loss = _loss(ref, r)
        loss.backward()
        ref_y.append(y.detach())
    full = {n: p.detach().clone() for n, p in ref.moe.experts.named_parameters()}
    # The same model, made expert parallel: this rank's tokens only.
    net = _net()
    apply_expert_parallel(net, dist.group.WORLD)
    held = net.moe.routing.slots.expert.tolist()
    weights_equal = all(
        torch.equal(p[slot], full[n][e])
        for n, p in net.moe.experts.named_parameters()
        for slot, e in enumerate(held)
    )
    y, loss = _loss(net, rank)
    loss.backward()
    sync_router_grads(net)
    dense = [net.inp.weight.grad, net.inp.bias.grad]
    for g in dense:
        dist.all_reduce(g)
    out: dict = {"weights_equal": weights_equal, "y": (y.detach() - ref_y[rank]).abs().max()}
    out["router"] = (net.moe.router.weight.grad - ref.moe.router.weight.grad).abs().max()
    pairs = zip(dense, ref.inp.parameters(), strict=True)
    out["dense"] = max((a - b.grad).abs().max() for a, b in pairs)
    ref_grads = dict(ref.moe.experts.named_parameters())
    out["experts"] = max(
        (p.grad[slot] - ref_grads[n].grad[e]).abs().max()
        for n, p in net.moe.experts.named_parameters()
        for slot, e in enumerate(held)
    )
    out["slots"] = net.moe.num_slots
    out["errors"] = _rank_errors(rank)
    return out


def _rank_errors(rank: int) -> dict[str, tuple[str, str | None, str]]:
    """`{case: (error type, field, message)}` for each refusal, on this rank."""
    import torch.distributed as dist

    seen: dict[str, tuple[str, str | None, str]] = {}

    def attempt(name: str, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
            seen[name] = ("none", None, "")
        except ConfigError as exc:
            seen[name] = (type(exc).__name__, exc.field, str(exc))

    world = dist.group.WORLD
    attempt("world", lambda: apply_expert_parallel(MoE(MoEConfig(M, H, 3, K)), world))
    attempt("slots", lambda: apply_expert_parallel(MoE(MoEConfig(M, H, E, K)), world, num_slots=1))
    d_expert = H + 8 * rank
    attempt("config", lambda: apply_expert_parallel(MoE(MoEConfig(M, d_expert, E, K)), world))
    torch.manual_seed(rank)
    attempt("router", lambda: apply_expert_parallel(MoE(MoEConfig(M, H, E, K)), world))
    torch.manual_seed(0)
    twice = MoE(MoEConfig(M, H, E, K))
    apply_expert_parallel(twice, world)
    attempt("twice", lambda: apply_expert_parallel(twice, world))
    return seen


@pytest.mark.dist
def test_expert_parallel_equals_the_single_device_model_and_refuses_by_field() -> None:
    per_rank = run_ranks(_rank_equivalence, 2)
    for rank, r in enumerate(per_rank):
        assert r["weights_equal"] and r["slots"] == E // 2, rank
        for key in ("y", "router", "dense", "experts"):
            assert float(r[key]) < 1e-5, (rank, key, float(r[key]))
        errors = r["errors"]
        assert errors["world"][:2] == ("ConfigError", "world_size"), errors["world"]
        assert errors["slots"][:2] == ("ConfigError", "num_slots"), errors["slots"]
        assert (
            errors["config"][:2] == ("ConfigError", "moe")
            and "configuration" in errors["config"][2]
        )
        assert f"rank(s) [{1 - rank}]" in errors["config"][2]
        assert errors["router"][:2] == ("ConfigError", "moe") and "router" in errors["router"][2]
        assert errors["twice"][:2] == ("ConfigError", "group"), errors["twice"]


def _readme_snippet() -> str:
    text = README.read_text()
    section = text[text.index("## The layer in your model") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README has no python block under 'The layer in your model'"
    return match.group(1)


class _ReadmeModel(nn.Module):
    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _rank_readme(rank: int, world: int) -> dict:
    torch.manual_seed(0)  # routers alike on every rank
    g = torch.Generator().manual_seed(rank)
    scope: dict = {
        "MyModel": _ReadmeModel,
        "batches": [torch.randn(2, 3, 512, generator=g) for _ in range(3)],
        "your_loss": lambda y: y.square().mean(),
    }
    exec(compile(_readme_snippet(), "README.md", "exec"), scope)
    model, balancer = scope["model"], scope["balancer"]
    return {
        "steps": balancer.steps_done,
        "slots": model.moe.num_slots,
        "loss": float(scope["loss"]),
        "replan_every": balancer.replan_every,
    }


@pytest.mark.dist
def test_readme_snippet_runs_on_two_ranks() -> None:
    for r in run_ranks(_rank_readme, 2):
        assert r["steps"] == 3 and r["slots"] == 16 // 2 + 1 and r["replan_every"] == 10
        assert np.isfinite(r["loss"])


# ----------------------------------------------------------------------------- one process
def test_counts_are_buffers_not_state() -> None:
    moe = MoE(MoEConfig(M, H, E, K, expert_bias=True))
    buffers = dict(moe.named_buffers())
    assert set(buffers) >= {"last_counts", "bias_counts"}
    assert buffers["last_counts"].shape == (E,) and buffers["bias_counts"].dtype == torch.long
    assert not {"last_counts", "bias_counts"} & set(moe.state_dict())  # not persistent
    before = moe.last_counts
    moe(torch.randn(6, M))
    assert moe.last_counts is before and int(moe.last_counts.sum()) == 6 * K  # updated in place
    assert torch.equal(moe.bias_counts, moe.last_counts)  # training forward
    moe.eval()
    moe(torch.randn(5, M))
    assert int(moe.bias_counts.sum()) == 6 * K  # eval forwards do not count for the bias
    assert moe.group is None and moe.world == 1 and moe.num_slots == E


def test_single_device_layer_needs_no_process_group() -> None:
    net = _net()
    y, loss = _loss(net, 0)
    loss.backward()
    assert y.shape == (TOKENS[0], M) and net.moe.experts.w_in.grad.shape[0] == E


def test_one_rank_with_spare_slots_computes_the_same() -> None:
    a, b = _net(), _net()
    apply_expert_parallel(b, None, num_slots=E + 2)
    x, _ = _batch(0)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=1e-6)
    assert b.moe.experts.w_in.shape[0] == E + 2 and b.moe.experts.w_in[E:].abs().max() == 0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"d_model": 0}, "d_model"),
        ({"top_k": 5}, "top_k"),
        ({"activation": "relu"}, "activation"),
        ({"score": "max"}, "score"),
        ({"experts_impl": "fast"}, "experts_impl"),
        ({"balance_coef": -1.0}, "balance_coef"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"overlap_degree": 0}, "overlap_degree"),
        ({"expert_bias": "yes"}, "expert_bias"),
        ({"init_seed": -1}, "init_seed"),
    ],
)
def test_config_refuses_bad_values_by_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        MoEConfig(M, H, E, K).replace(**changes)
    assert info.value.field == field


def test_config_digest_ignores_what_does_not_change_the_mathematics() -> None:
    cfg = MoEConfig(M, H, E, K)
    assert cfg.digest() == cfg.replace(init_seed=3, experts_impl="loop").digest()
    assert cfg.digest() != cfg.replace(top_k=1).digest()


def test_digest_and_comm_device() -> None:
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert digest(a, 1.5, "x") == digest(a.copy(), 1.5, "x")
    assert digest(a) != digest(a.reshape(3, 2)) != digest(a.astype(np.int32))
    assert digest(torch.ones(3, dtype=torch.bfloat16)) == digest(torch.ones(3))  # floats as fp32
    assert 0 <= digest(a) < 2**62
    assert comm_device(None, "cpu") == torch.device("cpu")  # no process group: the CPU
