"""Training GPT-MoE models with live expert-parallel balancing.

    from poise.train import TrainConfig, train, load_config
    result = train(load_config("configs/tiny.yaml").replace(steps=100))

- `data`: byte-level corpus (the Python standard library by default), cached and memory-mapped;
- `config`: `TrainConfig` with YAML load/save and validation;
- `checkpoint`: placement-independent checkpoints, atomic writes, resume at any world size;
- `loop`: `train()` on torch.distributed (`torchrun -m poise.train CONFIG` or `poise train`).

Names are imported lazily, so `import poise.train` stays cheap.
"""

from __future__ import annotations

from poise.util.lazy import lazy_getattr

_EXPORTS = {
    "Corpus": "data",
    "DataError": "data",
    "Sampler": "data",
    "build_corpus": "data",
    "TrainConfig": "config",
    "load_config": "config",
    "save_config": "config",
    "CheckpointError": "checkpoint",
    "TrainResult": "loop",
    "lr_at": "loop",
    "train": "loop",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
