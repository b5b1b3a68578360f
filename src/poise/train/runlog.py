"""`RunLog`: what rank 0 of a training run writes as it goes (console, `metrics.jsonl`,
TensorBoard)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poise.train.config import TrainConfig
from poise.train.tboard import TensorBoardLog
from poise.util.atomic import atomic_write_text


class RunLog:
    """Rank 0's outputs: console (a rich progress bar on a terminal, plain lines otherwise),
    `metrics.jsonl`, TensorBoard (`poise.train.tboard`, unless `tensorboard: false`). Other
    ranks log nothing. The live view names the worst layer (largest CV of tokens per expert)."""

    def __init__(self, cfg: TrainConfig, out: Path, active: bool, start: int, quiet: bool):
        self.cfg, self.out, self.active, self.quiet = cfg, out, active, quiet
        self.progress = None
        self.task = None
        self.tb = None
        self.metrics = None
        if not active:
            return
        from rich.console import Console

        self.console = Console(stderr=False, highlight=False)
        path = out / "metrics.jsonl"
        kept = []
        if start > 0 and path.exists():  # resuming: drop lines of steps after the checkpoint
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= start:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue
        atomic_write_text(path, "".join(x + "\n" for x in kept))
        self.metrics = path.open("a", encoding="utf-8")
        if cfg.tensorboard:
            try:
                self.tb = TensorBoardLog(out / "tb", purge_step=start + 1 if start else None)
            except ImportError:  # TensorBoard absent: no events (the written config says so)
                self.tb = None
        if cfg.progress and not quiet and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=cfg.steps, completed=start, info="")
            self.progress.start()

    def print(self, text: str) -> None:
        if self.active and not self.quiet:
            self.console.print(text, markup=False, soft_wrap=True)

    def step(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        assert self.metrics is not None
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        s = record["step"]
        if self.tb is not None:
            self.tb.step(record)
        worst = worst_layer_text(record)
        info = f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s  {worst}"
        if self.progress is not None:
            self.progress.update(self.task, completed=s, info=info)
        if s % self.cfg.log_every == 0 or s == self.cfg.steps or "val_loss" in record:
            loads = " ".join(f"{x:.2f}" for x in record["max_over_mean"])
            line = (
                f"step {s}/{self.cfg.steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"{record['tokens_per_s']:,.0f} tok/s  max/mean [{loads}]  "
                f"plan changes {record['plan_changes']}  {worst}"
            )
            if "val_loss" in record:
                line += f"  val {record['val_loss']:.4f}"
            self.print(line)
        if record.get("switched") or record.get("decision") == "revert":
            self.print(f"step {s}: {record['reason']}")  # why the layout changed here

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.tb is not None:
            self.tb.close()


def worst_layer_text(record: dict[str, Any]) -> str:
    """The step's worst MoE layer for the console, e.g. `worst layer 2: cv 0.61, experts
    max/mean 2.10, devices 1.35, dropped 0` (empty without expert loads in `record`)."""
    cv = record.get("cv") or []
    if not cv:
        return ""
    layer = int(record.get("worst_layer", 0))
    expert = record.get("expert_max_over_mean") or [1.0] * len(cv)
    device = record.get("max_over_mean") or [1.0] * len(cv)
    dropped = record.get("dropped_tokens") or [0] * len(cv)
    return (
        f"worst layer {layer}: cv {cv[layer]:.2f}, experts max/mean {expert[layer]:.2f}, "
        f"devices {device[layer]:.2f}, dropped {dropped[layer]}"
    )
