"""Each rank's routing as Megatron-Core router traces (`megatron_trace: true`), a step at a time.

    trace = StepRouterTrace(out / "megatron-trace", rank, start)
    for each micro-batch: forward; trace.keep(model)   # the MoE layers' choices [T, k]
    trace.write(step)                                   # one record per layer: every micro-batch
    trace.close()

A step's record of a layer holds its micro-batches' choices one after the other, so the file
has one record per step, layer and rank, as `poise.trace.megatron.import_megatron` reads it
(a second record for the same step is an error there). `layer` is the block's index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from poise.nn.moe import MoE
from poise.trace.megatron import MegatronTraceWriter


class StepRouterTrace:
    """Collects the step's expert choices of every `MoE` layer and writes them at its end
    (`poise.trace.megatron.MegatronTraceWriter`; `start`: on resume, later steps are dropped)."""

    def __init__(self, folder: str | Path, rank: int, start: int = 0) -> None:
        self.writer = MegatronTraceWriter(folder, rank, start)
        self._choices: dict[int, list[np.ndarray]] = {}

    def keep(self, model: nn.Module) -> None:
        """After a micro-batch's forward: a copy of each MoE layer's choices `[T, k]`."""
        for name, moe in model.named_modules():
            if isinstance(moe, MoE) and moe.last_forward.choices is not None:
                layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
                self._choices.setdefault(layer, []).append(moe.last_forward.choices.cpu().numpy())

    def write(self, step: int) -> None:
        """The step's (0-based) records, one per layer, and a flush."""
        for layer, choices in self._choices.items():
            self.writer.record(step, layer, np.concatenate(choices))
        self._choices.clear()
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


__all__ = ["StepRouterTrace"]
