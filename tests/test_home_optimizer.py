"""`HomeRowsAdamW`: AdamW on the home rows of stacked expert tensors, nothing on the others.

Reference: `torch.optim.AdamW` itself with the same `fused` flag (the home rows must match it
bit for bit; the rows it skips must be left exactly as they were)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poise.core.errors import PlanError
from poise.core.placement import Assignment, Placement
from poise.nn import MoE, MoEConfig
from poise.nn.dispatch import RankRouting
from poise.nn.slots import SlotMap, slot_maps
from poise.runtime.home_optimizer import HomeRowsAdamW, fused_supported, home_rows

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _pair(
    rows: int, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.optim.AdamW, HomeRowsAdamW]:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3, 4))
    b = torch.nn.Parameter(torch.randn(5, 3, 4))
    b.data.copy_(a.data)
    dense_a, dense_b = torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.zeros(7))
    dense_b.data.copy_(dense_a.data)
    ref = torch.optim.AdamW(
        [{"params": [a], "weight_decay": 0.1}, {"params": [dense_a], "weight_decay": 0.0}],
        fused=fused,
        **HYPER,
    )
    ours = HomeRowsAdamW(
        [{"params": [b], "weight_decay": 0.1}, {"params": [dense_b], "weight_decay": 0.0}],
        {id(b): lambda: rows},
        fused=fused,
        **HYPER,
    )
    return (a, dense_a), (b, dense_b), ref, ours


def _steps(ref_params, our_params, ref, ours, n: int = 4) -> None:
    for _ in range(n):
        for pa, pb in zip(ref_params, our_params, strict=True):
            g = torch.randn_like(pa)
            pa.grad, pb.grad = g.clone(), g.clone()
        ref.step()
        ours.step()


@pytest.mark.parametrize("fused", [True, False])
def test_home_rows_match_adamw_bit_for_bit_and_the_others_are_untouched(fused: bool):
    (a, dense_a), (b, dense_b), ref, ours = _pair(rows=3, fused=fused)
    assert ours.fused is fused
    before = b.detach().clone()
    _steps((a, dense_a), (b, dense_b), ref, ours)
    assert torch.equal(b[:3], a[:3])
    assert torch.equal(ours.state[b]["exp_avg"][:3], ref.state[a]["exp_avg"][:3])
    assert torch.equal(b[3:], before[3:])  # replica and empty slots: no optimizer work
    assert not ours.state[b]["exp_avg"][3:].any()
    assert torch.equal(dense_b, dense_a)  # other parameters: AdamW whole
    assert float(ours.state[b]["step"]) == float(ref.state[a]["step"]) == 4.0


def test_a_rank_without_homes_still_counts_the_step():
    (a, dense_a), (b, dense_b), ref, ours = _pair(rows=0)
    before = b.detach().clone()
    _steps((a, dense_a), (b, dense_b), ref, ours, n=3)
    assert torch.equal(b, before)
    assert float(ours.state[b]["step"]) == 3.0  # bias corrections agree when moments migrate


def test_state_dict_round_trips_through_plain_adamw():
    (a, dense_a), (b, dense_b), ref, ours = _pair(rows=5)
    _steps((a, dense_a), (b, dense_b), ref, ours, n=2)
    ref.load_state_dict(ours.state_dict())
    assert torch.equal(ref.state[a]["exp_avg_sq"], ours.state[b]["exp_avg_sq"])


def test_unsupported_modes_are_refused():
    with pytest.raises(ValueError, match="amsgrad"):
        HomeRowsAdamW([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    with pytest.raises(ValueError, match="fused or foreach"):
        HomeRowsAdamW([torch.nn.Parameter(torch.zeros(2))], fused=True, foreach=True)
    ints = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match="fused=True needs"):
        HomeRowsAdamW([ints], fused=True)


@pytest.mark.parametrize("fused", [True, False])
def test_the_step_runs_the_kernel_it_says(fused: bool, monkeypatch):
    """A spy on PyTorch's fused AdamW op: called once per step with the fused kernel, never
    with the loop."""
    calls = []
    real = torch._fused_adamw_

    def spy(*args, **kwargs):
        calls.append(len(args[0]))  # the parameters it stepped
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    (_, _), (b, dense_b), _, ours = _pair(rows=3, fused=fused)
    for p in (b, dense_b):
        p.grad = torch.randn_like(p)
    ours.step()
    assert calls == ([1, 1] if fused else [])  # one call per group of one parameter


def test_the_fused_kernel_is_the_default_where_it_applies():
    """CPU float tensors take the fused kernel unless told otherwise; foreach keeps the loop;
    the fused step equals the loop's to float rounding (the same AdamW)."""
    p = torch.nn.Parameter(torch.randn(4, 8))
    assert fused_supported([p]) and HomeRowsAdamW([p]).fused
    assert not HomeRowsAdamW([p], foreach=True).fused
    assert not HomeRowsAdamW([p], fused=False).fused
    assert not fused_supported([torch.zeros(2, dtype=torch.int64)])
    (_, _), (b1, d1), _, fused = _pair(rows=3, fused=True)
    (_, _), (b2, d2), _, loop = _pair(rows=3, fused=False)
    torch.manual_seed(1)
    for _ in range(3):
        for x, y in ((b1, b2), (d1, d2)):
            x.grad = torch.randn_like(x)
            y.grad = x.grad.clone()
        fused.step()
        loop.step()
    torch.testing.assert_close(b1, b2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(d1, d2, rtol=1e-6, atol=1e-7)


def test_home_rows_counts_the_leading_home_slots_of_each_layer():
    """A 4-expert layer seen from rank 0 of two ranks, 4 slots: 2 homes, 1 replica, 1 empty."""
    placement = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, 4)
    placement.copies[0, 0, 2] = 1  # rank 0 also holds a replica of expert 2
    slot_map = slot_maps(placement, 0, 4)[0]
    assert slot_map.home.tolist() == [True, True, False, False]
    moe = MoE(MoEConfig(16, 32, 4, 2))
    route = lambda slots: RankRouting.from_plan(  # noqa: E731
        placement, Assignment.even(placement), slots, 0, 0
    )
    moe.routing = route(slot_map)
    rows = home_rows(moe)
    assert set(rows) == {id(w) for w in moe.experts.weights()}
    assert {f() for f in rows.values()} == {2}  # read from the routing in force
    moe.routing = route(
        SlotMap(expert=slot_map.expert[[2, 0, 1, 3]], home=slot_map.home[[2, 0, 1, 3]])
    )
    with pytest.raises(PlanError, match="leading"):
        next(iter(rows.values()))()
