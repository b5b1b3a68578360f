"""Experts: the grouped-GEMM and per-slot implementations against a naive per-slot reference,
forward and backward, with empty slots; the rules of `torch._grouped_mm`; slot independence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.errors import ConfigError
from poise.nn.experts import Experts, ExpertsInputError, grouped_mm_problem


def naive(experts: Experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for slot, n in enumerate(counts):
        xs = x[start : start + n]
        start += n
        h = xs @ experts.w_in[slot]
        gate = experts.w_gate
        a = F.gelu(h) if gate is None else F.silu(xs @ gate[slot]) * h
        outs.append(a @ experts.w_out[slot])
    return torch.cat(outs) if outs else x.new_zeros(0, experts.d_model)


def grads_of(experts: Experts, x: torch.Tensor, counts: list[int], use_naive: bool) -> list:
    experts.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = naive(experts, x, counts) if use_naive else experts(x, counts)
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    (y * g).sum().backward()
    return [y.detach(), x.grad] + [w.grad.clone() for w in experts.weights()]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_matches_naive_reference_with_empty_slots(activation: str, impl: str):
    torch.manual_seed(0)
    experts = Experts(5, 8, 12, activation, impl=impl)  # type: ignore[arg-type]
    counts = [3, 0, 6, 0, 2]
    x = torch.randn(11, 8)
    got = grads_of(experts, x, counts, use_naive=False)
    want = grads_of(experts, x, counts, use_naive=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for w in got[2:]:
        assert w[1].abs().max() == 0 and w[3].abs().max() == 0  # empty slots: zero gradient


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_no_tokens_at_all_still_gives_zero_gradients(impl: str):
    experts = Experts(3, 8, 8, "gelu", impl=impl)  # type: ignore[arg-type]
    x = torch.zeros(0, 8, requires_grad=True)
    y = experts(x, torch.zeros(3, dtype=torch.long))
    assert y.shape == (0, 8)
    y.sum().backward()
    assert all(w.grad is not None and w.grad.abs().max() == 0 for w in experts.weights())


def test_grouped_accepts_expanded_gradients():
    experts = Experts(2, 8, 8, "swiglu", impl="grouped")
    x = torch.randn(5, 8, requires_grad=True)
    experts(x, [2, 3]).sum().backward()  # y.sum() hands on an expanded gradient
    assert x.grad is not None


@settings(max_examples=15, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=5))
def test_loop_and_grouped_agree(counts: list[int]):
    torch.manual_seed(1)
    experts = Experts(len(counts), 8, 4, "swiglu", impl="loop")
    x = torch.randn(sum(counts), 8)
    loop = grads_of(experts, x, counts, use_naive=False)
    experts.impl = "grouped"
    grouped = grads_of(experts, x, counts, use_naive=False)
    for a, b in zip(loop, grouped, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_slot_rows_are_independent():
    torch.manual_seed(2)
    experts = Experts(3, 8, 8, "gelu", impl="loop")
    x = torch.randn(9, 8)
    before = experts(x, [3, 3, 3]).detach()
    with torch.no_grad():
        experts.w_in[1].mul_(2.0)
    after = experts(x, [3, 3, 3]).detach()
    torch.testing.assert_close(after[:3], before[:3], rtol=0, atol=0)
    torch.testing.assert_close(after[6:], before[6:], rtol=0, atol=0)
    assert not torch.allclose(after[3:6], before[3:6])


def test_grouped_mm_rules():
    cpu = torch.device("cpu")
    assert grouped_mm_problem(torch.float32, cpu, 256, 1024) == ""
    assert "multiple of 16" in grouped_mm_problem(torch.float32, cpu, 6, 1024)
    assert "multiple of 16" in grouped_mm_problem(torch.bfloat16, cpu, 256, 12)
    assert "float64" in grouped_mm_problem(torch.float64, cpu, 256, 1024)
    assert "bfloat16" in grouped_mm_problem(torch.float32, torch.device("cuda"), 256, 1024)
    odd = Experts(2, 6, 8, "gelu", impl="grouped")
    with pytest.raises(ConfigError, match="multiple of 16"):
        odd(torch.randn(2, 6), [1, 1])
    odd.impl = "auto"
    assert odd(torch.randn(2, 6), [1, 1]).shape == (2, 6)  # falls back to the loop
    assert Experts(2, 8, 8).resolved_impl(torch.randn(1, 8)) == "loop"  # auto on the CPU


def test_bfloat16_runs_both_ways():
    torch.manual_seed(3)
    experts = Experts(2, 16, 16, "swiglu", dtype=torch.bfloat16)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    loop = experts(x, [4, 2])
    experts.impl = "grouped"
    torch.testing.assert_close(experts(x, [4, 2]), loop, atol=2e-2, rtol=2e-2)


def test_bad_inputs():
    experts = Experts(2, 8, 8, "gelu")
    with pytest.raises(ExpertsInputError, match="sum"):
        experts(torch.randn(4, 8), [1, 2])
    with pytest.raises(ExpertsInputError, match="2 slots"):
        experts(torch.randn(4, 8), [1, 2, 1])
    with pytest.raises(ExpertsInputError, match=r"\[T, 8\]"):
        experts(torch.randn(4, 7), [2, 2])
    with pytest.raises(ConfigError, match="activation"):
        Experts(2, 8, 8, "relu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="impl"):
        experts.impl = "fast"  # type: ignore[assignment]
    assert experts.w_gate is None and len(experts.weights()) == 2


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_loop_blocks_of_rows_match_one_block(activation: str, monkeypatch: pytest.MonkeyPatch):
    import poise.nn.experts as experts_module

    torch.manual_seed(4)
    experts = Experts(3, 8, 16, activation, impl="loop")  # type: ignore[arg-type]
    counts = [40, 0, 23]
    x = torch.randn(63, 8)
    whole = grads_of(experts, x, counts, use_naive=False)
    monkeypatch.setattr(experts_module, "BLOCK_BYTES", 16 * 16 * 4)  # 16-row blocks
    assert experts_module.block_rows(16, torch.float32) == 16
    blocked = grads_of(experts, x, counts, use_naive=False)
    for a, b in zip(blocked, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.002 per operation). The autocast
# outputs below differ from fp32 by at most 0.0018-0.0031 (measured over seeds 0-4, outputs up
# to 0.46); torch's own bf16 rtol is 1.6e-2. These bounds are about twice the measured error,
# and an output scaled by 0.8 fails them (checked in each test).
BF16_ATOL = 6e-3
BF16_RTOL = 1.6e-2


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=BF16_ATOL, rtol=BF16_RTOL)


def test_experts_run_under_bf16_autocast_with_fp32_weights() -> None:
    """Mixed precision: under autocast the expert GEMMs run in bf16 like nn.Linear's would,
    gradients reach the fp32 parameters, and the result is close to the fp32 one."""
    import torch

    from poise.nn.experts import Experts

    torch.manual_seed(0)
    experts = Experts(3, 16, 32, activation="swiglu")
    x = torch.randn(10, 16)
    counts = [4, 0, 6]
    ref = experts(x, counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, counts)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert experts.w_in.grad is not None and experts.w_in.grad.dtype == torch.float32
    assert torch.all(experts.w_in.grad[1] == 0)  # the empty slot gets no gradient
    assert_bf16_close(y.float(), ref)
    with pytest.raises(AssertionError):  # the tolerance catches an output off by 20%
        assert_bf16_close(0.8 * y.float(), ref)


def test_moe_layer_runs_under_bf16_autocast() -> None:
    import torch

    from poise.nn import MoE, MoEConfig

    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=32, d_expert=64, num_experts=4, top_k=2))
    x = torch.randn(2, 8, 32)
    ref = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    (y.float().sum() + moe.last_forward.aux_loss).backward()
    assert moe.experts.w_out.grad is not None
    assert_bf16_close(y.float(), ref)
    with pytest.raises(AssertionError):  # the tolerance catches an output off by 20%
        assert_bf16_close(0.8 * y.float(), ref)
