"""Hugging Face sparse MoE blocks converted in place (`poise.adapters.hf`) compute what they did
and train under the Balancer as static EP does.

Tiny randomly initialised Mixtral and Qwen2-MoE causal LMs (2 layers, hidden 32, top-2 of 4
and 8 experts; Qwen2-MoE with its shared expert and sigmoid gate), fp32: after `convert_hf_moe`
every MoE block's output, the logits, the loss with the router's load-balancing loss, the
recorded router logits and every gradient (the experts' through the fused `gate_up_proj`
layout) equal the original's within 1e-6. On 2 gloo ranks the converted Mixtral trains under
an eager Balancer with plan changes and the losses of static EP within 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch

from poise.core.errors import ConfigError
from poise.runtime.launch import run_ranks

transformers = pytest.importorskip("transformers")

TOL = 1e-6
STEPS, VOCAB, SEQ = 8, 64, 12


def _tiny(kind: str, seed: int = 0, **changes):
    """A tiny randomly initialised causal LM of `kind` ("mixtral" or "qwen2_moe"), fp32."""
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True, router_aux_loss_coef=0.02, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, **{**common, **changes}
        )
        return transformers.MixtralForCausalLM(config).float()
    config = transformers.Qwen2MoeConfig(
        intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=8, norm_topk_prob=False, **{**common, **changes},
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config).float()


def _block_outputs(model) -> list:
    """Forward hooks keeping each layer's MoE block output."""
    out: list = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda m, a, y: out.append(y.detach().clone()))
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_converted_model_gives_the_outputs_and_gradients_of_the_original(kind: str) -> None:
    from poise.adapters import PoiseSparseMoeBlock, convert_hf_moe
    from poise.adapters.hf import stack_experts

    ref = _tiny(kind)
    conv = copy.deepcopy(ref)
    assert convert_hf_moe(conv) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(isinstance(layer.mlp, PoiseSparseMoeBlock) for layer in conv.model.layers)
    blocks_ref, blocks_conv = _block_outputs(ref), _block_outputs(conv)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    a, b = ref(input_ids=ids, labels=ids), conv(input_ids=ids, labels=ids)
    diffs = {
        "blocks": max(
            (x - y).abs().max().item() for x, y in zip(blocks_ref, blocks_conv, strict=True)
        ),
        "logits": (a.logits - b.logits).abs().max().item(),
        "loss": abs(a.loss.item() - b.loss.item()),
        "aux_loss": abs(a.aux_loss.item() - b.aux_loss.item()),
        "router_logits": max(
            (x - y).abs().max().item()
            for x, y in zip(a.router_logits, b.router_logits, strict=True)
        ),
    }
    assert len(b.router_logits) == 2 and a.aux_loss.item() > 0
    a.loss.backward()
    b.loss.backward()
    named = dict(ref.named_parameters())
    dense = 0.0
    for name, p in conv.named_parameters():
        if ".moe.experts." in name:
            continue
        # the router's weight is the gate's own (tied): named once, under the router
        src = name.replace("mlp.moe.router.weight", "mlp.gate.weight")
        src = src.replace("mlp.moe.router.source.", "mlp.gate.")
        dense = max(dense, (p.grad - named[src].grad).abs().max().item())
    expert = 0.0
    for old, new in zip(ref.model.layers, conv.model.layers, strict=True):
        e = old.mlp.experts
        g_gate, g_in, g_out = stack_experts(e, e.gate_up_proj.grad, e.down_proj.grad)
        x = new.mlp.moe.experts
        for got, want in ((x.w_gate, g_gate), (x.w_in, g_in), (x.w_out, g_out)):
            expert = max(expert, (got.grad - want).abs().max().item())
    diffs.update(dense_grads=dense, expert_grads=expert)
    print(kind, diffs)
    assert max(diffs.values()) <= TOL, diffs


def test_the_weights_are_kept_in_poises_layout() -> None:
    from poise.adapters import convert_hf_moe

    ref = _tiny("qwen2_moe")
    conv = copy.deepcopy(ref)
    convert_hf_moe(conv)
    old, new = ref.model.layers[0].mlp, conv.model.layers[0].mlp
    F = old.experts.gate_up_proj.shape[1] // 2
    torch.testing.assert_close(new.moe.experts.w_gate, old.experts.gate_up_proj[:, :F].mT)
    torch.testing.assert_close(new.moe.experts.w_in, old.experts.gate_up_proj[:, F:].mT)
    torch.testing.assert_close(new.moe.experts.w_out, old.experts.down_proj.mT)
    assert new.moe.router.weight is new.moe.router.source.weight
    assert new.shared_expert is not None and new.shared_expert_gate is not None
    assert new.moe.router.renormalize is False  # Qwen2-MoE's norm_topk_prob


def test_what_poise_cannot_compute_alike_is_refused() -> None:
    from poise.adapters import convert_hf_moe

    with pytest.raises(ConfigError, match="SiLU"):
        convert_hf_moe(_tiny("mixtral", hidden_act="gelu"))
    with pytest.raises(ConfigError, match="no sparse MoE block"):
        convert_hf_moe(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def _mixtral_loss(model, gen):
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    return model(input_ids=ids, labels=ids).loss


def _train_ranks(rank: int, W: int) -> dict:
    import torch.distributed as dist

    from poise.adapters import convert_hf_moe
    from poise.nn import apply_expert_parallel
    from tests.helpers import eager_balancer, train_dense_and_experts

    out = {}
    for balanced in (False, True):
        model = _tiny("mixtral", seed=0)
        convert_hf_moe(model)
        with torch.no_grad():  # a skewed router: experts 0 and 1 hot
            for layer in model.model.layers:
                layer.mlp.moe.router.weight[:2] *= 4.0
        apply_expert_parallel(model, dist.group.WORLD, num_slots=4 // W + 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        balancer = eager_balancer(model, opt) if balanced else None
        result = train_dense_and_experts(model, opt, rank, STEPS, _mixtral_loss, balancer)
        out["balanced" if balanced else "static"] = result
    return out


@pytest.mark.dist
def test_a_converted_mixtral_trains_under_the_balancer_as_static_ep_does() -> None:
    from tests.helpers import assert_balanced_trains_as_static

    assert_balanced_trains_as_static(run_ranks(_train_ranks, 2))
