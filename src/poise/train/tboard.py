"""TensorBoard events for a training run (rank 0): what `RunLog` writes to `OUT/tb/`.

Tags, per step `s` (x axis):
- `loss/train`, `loss/val`, `lr`, `tokens_per_s`, `load/max_over_mean` (mean over MoE layers of
  the device max/mean);
- per MoE layer `l` (`layer{l:02d}`): `moe/layer{l}/cv`, `moe/layer{l}/expert_max_over_mean`,
  `moe/layer{l}/device_max_over_mean`, `moe/layer{l}/dropped_tokens`, `moe/layer{l}/replicas`;
  `moe/plan_changes`;
- `expert_load/layer{l}`: a histogram whose bucket `e` (`[e - 0.5, e + 0.5)`) holds
  `tokens_per_expert[l][e]`: TensorBoard's histogram and distribution tabs then show each layer's
  expert load over time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class TensorBoardLog:
    """A `SummaryWriter` on `folder`; `purge_step` drops events of later steps (resuming)."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=purge_step)

    def step(self, record: dict[str, Any]) -> None:
        """Write one `metrics.jsonl` record's scalars and expert-load histograms."""
        s = int(record["step"])
        w = self.writer
        w.add_scalar("loss/train", record["loss"], s)
        w.add_scalar("tokens_per_s", record["tokens_per_s"], s)
        w.add_scalar("lr", record["lr"], s)
        if "val_loss" in record:
            w.add_scalar("loss/val", record["val_loss"], s)
        device = record.get("max_over_mean") or []
        if device:
            w.add_scalar("load/max_over_mean", float(np.mean(device)), s)
        w.add_scalar("moe/plan_changes", record.get("plan_changes", 0), s)
        per_layer = {
            "cv": record.get("cv") or [],
            "expert_max_over_mean": record.get("expert_max_over_mean") or [],
            "device_max_over_mean": device,
            "dropped_tokens": record.get("dropped_tokens") or [],
            "replicas": record.get("replicas") or [],
        }
        for name, values in per_layer.items():
            for layer, v in enumerate(values):
                w.add_scalar(f"moe/layer{layer:02d}/{name}", float(v), s)
        for layer, counts in enumerate(record.get("tokens_per_expert") or []):
            self.expert_histogram(f"expert_load/layer{layer:02d}", np.asarray(counts), s)

    def expert_histogram(self, tag: str, counts: np.ndarray, step: int) -> None:
        """`counts [E]` as a histogram over expert ids (bucket e holds expert e's tokens)."""
        E = counts.size
        if E == 0:
            return
        ids = np.arange(E, dtype=np.float64)
        n = counts.astype(np.float64)
        total = float(n.sum())
        self.writer.add_histogram_raw(
            tag,
            min=0.0,
            max=float(E - 1),
            num=total,
            sum=float((ids * n).sum()),
            sum_squares=float((ids * ids * n).sum()),
            bucket_limits=(ids + 0.5).tolist(),
            bucket_counts=n.tolist(),
            global_step=step,
        )

    def close(self) -> None:
        self.writer.close()


__all__ = ["TensorBoardLog"]
