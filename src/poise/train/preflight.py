"""Checks of a training run before any rank starts: what would otherwise fail inside a rank,
with an allocator traceback, the OOM killer or a write error.

- memory: `training_bytes_per_rank` (the model's weights, gradients and AdamW moments, and a
  lower bound on the activations) against the memory the ranks share (`poise.core.budget`; on
  the CPU all ranks of this host share it, on CUDA each rank has its device's);
- the corpus cache: the folder must exist or be creatable, and be writable.

The vocabulary against the byte-level data is a config check (`train.config`, field
`model_args.vocab_size`), so every entry point runs it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from poise.core.budget import check_fits
from poise.core.errors import ConfigError

# Bytes a trained parameter holds: fp32 weight, fp32 gradient, AdamW's two fp32 moments.
BYTES_PER_PARAM = 4 + 4 + 8


def model_params(mcfg: Any, ranks: int, spare_slots: int) -> tuple[float, float]:
    """`(dense, experts)` parameters one rank holds of a `GPTConfig`: every dense tensor
    (the embedding, which the output head shares; attention; dense FFNs; routers) and its expert
    slots, `E / ranks +
    spare_slots` experts of `3 * d_model * d_expert` (gate, in and out) in each MoE layer."""
    d, layers, moe_layers = mcfg.d_model, mcfg.layers, mcfg.moe_layers
    dense_layers = layers - moe_layers
    dense = mcfg.vocab_size * d + layers * 4.0 * d * d + dense_layers * 3.0 * d * mcfg.d_ff
    dense += moe_layers * d * mcfg.num_experts  # routers
    slots = min(mcfg.num_experts, -(-mcfg.num_experts // ranks) + spare_slots)
    experts = moe_layers * slots * 3.0 * d * mcfg.d_expert
    return dense, experts


def activation_bytes(mcfg: Any, tokens: int) -> float:
    """A lower bound on the fp32 activations the backward keeps for `tokens` tokens a rank: per
    layer the residual, attention's inputs and outputs (about 8 d), each token's top-k expert
    rows (3 d_expert each) and the attention scores (heads x context)."""
    per_token = 8.0 * mcfg.d_model + 3.0 * mcfg.top_k * mcfg.d_expert + mcfg.heads * mcfg.context
    return 4.0 * tokens * mcfg.layers * per_token


def training_bytes_per_rank(cfg: Any, ranks: int) -> float:
    """The estimate `check_memory` compares: parameters x `BYTES_PER_PARAM` plus
    `activation_bytes` of one micro-batch's share (`batch / ranks` sequences of `context`)."""
    mcfg = cfg.model_config()
    dense, experts = model_params(mcfg, ranks, cfg.spare_slots)
    tokens = -(-cfg.batch // ranks) * mcfg.context
    return BYTES_PER_PARAM * (dense + experts) + activation_bytes(mcfg, tokens)


def check_memory(cfg: Any, ranks: int) -> None:
    """One `ConfigError` (field `model_args`) when the estimate cannot fit: on the CPU, `ranks`
    ranks' estimates against this host's available memory; on CUDA, one rank's against its
    device's memory."""
    per_rank = training_bytes_per_rank(cfg, ranks)
    what = f"training model {cfg.model} on {ranks} rank(s) (weights, gradients, AdamW, activations)"
    hint = "use a smaller model (model_args), a smaller batch or more ranks"
    device = str(getattr(cfg, "device", "auto"))
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            have = torch.cuda.get_device_properties(0).total_memory
            if per_rank > have:
                raise ConfigError(
                    f"{what} needs about {per_rank / 2**30:.1f} GiB a rank, more than the GPU's "
                    f"{have / 2**30:.1f} GiB; {hint}",
                    source="config",
                    field="model_args",
                )
        return
    check_fits(ranks * per_rank, what, source="config", field="model_args", hint=hint)


def check_cache_writable(cache: Path) -> None:
    """One `ConfigError` (field `cache_dir`) when the corpus cache folder cannot be created or a
    file cannot be written in it: tried for real (creating the folder, which the corpus would
    create anyway, and a temporary file), since permission bits do not say it (root passes
    them, read-only and virtual file systems refuse anyway)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, prefix=".poise-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"the corpus cache {cache} cannot be written ({exc.strerror or exc}); set cache_dir "
            "or $POISE_CACHE to a writable folder",
            source="config",
            field="cache_dir",
        ) from None


def check_before_start(cfg: Any, ranks: int) -> None:
    """Every check of this module, before any rank starts."""
    from poise.train.data import default_cache_dir

    check_memory(cfg, ranks)
    check_cache_writable(Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir())


__all__ = ["check_before_start", "check_cache_writable", "check_memory", "training_bytes_per_rank"]
