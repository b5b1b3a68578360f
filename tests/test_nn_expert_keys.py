"""Per-expert state-dict keys of expert-parallel MoE layers (`poise.nn.expert_keys`), on one
process: keys name experts, not slots; a load puts each expert in whichever slot holds it; a
full layer's stacked weights load by expert id; a missing home is a missing key; torch's
`get_model_state_dict` / `set_model_state_dict` (torchtitan's checkpointer) resolve the keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poise.core.placement import Assignment, Placement
from poise.nn import MoE, MoEConfig, SlotMap, apply_expert_parallel

CFG = MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, init_seed=5)
WEIGHTS = ("w_gate", "w_in", "w_out")


def _layer(permuted: bool = False) -> MoE:
    """An expert-parallel layer on one process (4 experts, 4 slots); `permuted`: expert e in
    slot (e + 1) % 4, as a plan that moved homes could leave them."""
    moe = MoE(CFG)
    apply_expert_parallel(moe, None)
    if permuted:
        placement = Placement.from_homes(np.zeros((1, 4), dtype=np.int64), 1, 4)
        slots = SlotMap(expert=np.array([3, 0, 1, 2]), home=np.ones(4, dtype=bool))
        moe.set_routing(placement, Assignment.to_home(placement), slots)
    return moe


def test_keys_name_experts_and_load_into_any_slots() -> None:
    full = MoE(CFG)  # every expert, no expert parallelism
    moved = _layer(permuted=True)
    moved.load_expert_weights({n: getattr(full.experts, n) for n in WEIGHTS})
    state = moved.state_dict()
    experts = sorted(k for k in state if k.startswith("experts."))
    assert experts == sorted(f"experts.{w}.expert_{e}" for w in WEIGHTS for e in range(4))
    for w in WEIGHTS:
        for e in range(4):
            assert torch.equal(state[f"experts.{w}.expert_{e}"], getattr(full.experts, w)[e])
    static = _layer()
    with torch.no_grad():
        for w in static.experts.weights():
            w.zero_()
    static.load_state_dict(state)
    for w in WEIGHTS:
        assert torch.equal(getattr(static.experts, w), getattr(full.experts, w))
    # and a full layer's stacked weights (a model without expert parallelism) by expert id
    moved.load_state_dict(full.state_dict())
    for w in WEIGHTS:
        assert torch.equal(getattr(moved.experts, w)[1], getattr(full.experts, w)[0])


def test_a_missing_home_is_a_missing_key() -> None:
    layer = _layer()
    state = layer.state_dict()
    del state["experts.w_in.expert_2"]
    with pytest.raises(RuntimeError, match=r"experts\.w_in\.expert_2"):
        layer.load_state_dict(state)
    missing = layer.load_state_dict(state, strict=False).missing_keys
    assert missing == ["experts.w_in.expert_2"]


def test_torchs_distributed_state_dict_functions_resolve_the_keys() -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    full = MoE(CFG)
    moved = _layer(permuted=True)
    state = get_model_state_dict(moved)
    assert sorted(k for k in state if k.startswith("experts.w_in")) == [
        f"experts.w_in.expert_{e}" for e in range(4)
    ]
    set_model_state_dict(moved, {k: v for k, v in full.state_dict().items()})
    assert torch.equal(moved.experts.w_in[0], full.experts.w_in[3])  # slot 0 holds expert 3


def test_optimizer_moments_are_keyed_per_expert_and_load_into_any_slots() -> None:
    """`register_expert_optimizer_keys`: the AdamW state of a stacked expert weight is one entry
    per expert (`state_dict`), loaded by expert id into another placement's slots; a home whose
    entry is absent is a `KeyError` naming it."""
    from poise.runtime.optimizer_keys import register_expert_optimizer_keys

    def trained(permuted: bool) -> tuple[MoE, torch.optim.Optimizer]:
        moe = _layer(permuted)
        optimizer = torch.optim.AdamW(moe.parameters(), lr=1e-2)
        assert register_expert_optimizer_keys(moe, optimizer) == 1
        moe(torch.randn(6, 8, generator=torch.Generator().manual_seed(1)))[0].pow(
            2
        ).sum().backward()
        optimizer.step()
        return moe, optimizer

    moved, opt = trained(permuted=True)  # expert e in slot (e + 1) % 4
    index = [id(p) for p in moved.parameters()].index(id(moved.experts.w_in))
    entry = opt.state_dict()["state"][index]
    assert sorted(entry["exp_avg"]) == [f"expert_{e}" for e in range(4)]
    for e in range(4):
        assert torch.equal(
            entry["exp_avg"][f"expert_{e}"], opt.state[moved.experts.w_in]["exp_avg"][(e + 1) % 4]
        )
    assert torch.is_tensor(entry["step"]) and entry["step"].dim() == 0  # scalars untouched
    static, static_opt = trained(permuted=False)
    static_opt.load_state_dict(opt.state_dict())
    for w in WEIGHTS:
        got = static_opt.state[getattr(static.experts, w)]["exp_avg_sq"]
        want = opt.state[getattr(moved.experts, w)]["exp_avg_sq"]
        assert torch.equal(got, want[[1, 2, 3, 0]])  # expert e from slot (e + 1) % 4 to slot e
    state = opt.state_dict()
    del state["state"][index]["exp_avg"]["expert_2"]
    with pytest.raises(KeyError, match="expert_2"):
        static_opt.load_state_dict(state)
