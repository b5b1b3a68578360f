"""Balancing other people's MoE models: the protocol a layer implements to be balanced, and
adapters that convert, in place, torchtitan's MoE and Hugging Face's sparse MoE blocks into
modules holding a `poise.nn.MoE`.

    from poise.adapters import convert_hf_moe, convert_torchtitan_moe
    convert_hf_moe(model)            # Mixtral / Qwen-MoE blocks (transformers 5)
    convert_torchtitan_moe(model)    # torchtitan.models.common.moe.MoE (torchtitan 0.3)
    apply_expert_parallel(model, group, num_slots=E // D + 1)   # then the README's snippet

- `protocol`: `BalanceableMoE`, what the Balancer reads from a layer, and `find_balanceable`;
- `routing`: `SourceRouter` (routing by the source library's own gate) and `CastExperts`;
- `hf`, `torchtitan`: the two adapters, each importing its library only when called.
"""

from poise.adapters.hf import PoiseSparseMoeBlock, convert_hf_moe
from poise.adapters.protocol import BalanceableMoE, StackedExperts, find_balanceable
from poise.adapters.torchtitan import PoiseTorchtitanMoE, convert_torchtitan_moe

__all__ = [
    "BalanceableMoE",
    "PoiseSparseMoeBlock",
    "PoiseTorchtitanMoE",
    "StackedExperts",
    "convert_hf_moe",
    "convert_torchtitan_moe",
    "find_balanceable",
]
