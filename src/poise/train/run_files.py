"""What a training run writes beside its metrics: the routing trace and the summary.

    counts, steps = previous_trace(checkpoint_path, start, (L, D, E))  # on resume
    routing_trace(counts, steps, meta, top_k, tokens_per_device).save(out / "trace.npz")
    write_summary(out / "summary.json", summary)                        # rank 0, at the end
    for line in closing_lines(result, totals, out): print(line)

`trace.npz` holds the routing counts `[steps, layers, ranks, experts]` as a
`poise.trace.trace.Trace`, rewritten at every checkpoint and at the end; a resumed run keeps
the steps before its checkpoint. `summary.json` is the run's `TrainResult` with the policy,
model and device (every file written atomically).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from poise.core.finite import json_text
from poise.trace.trace import Trace
from poise.util.atomic import atomic_write_text


def previous_trace(
    checkpoint: str | Path, start: int, shape: tuple[int, int, int]
) -> tuple[list[np.ndarray], list[int]]:
    """The routing counts `[L, D, E]` and steps recorded before step `start` in the run whose
    checkpoint file is `checkpoint` (its `trace.npz`, two folders up); empty where there is
    none, it does not load, or its `[L, D, E]` is not `shape` (other ranks or layers)."""
    path = Path(checkpoint).parent.parent / "trace.npz"
    try:
        trace = Trace.load(path)
    except Exception:
        return [], []
    if trace.counts.shape[1:] != tuple(shape):
        return [], []
    keep = trace.step_ids < start
    return list(trace.counts[keep]), [int(s) for s in trace.step_ids[keep]]


def routing_trace(
    counts: list[np.ndarray],
    steps: list[int],
    meta: Mapping[str, Any],
    top_k: int,
    tokens_per_device: int,
) -> Trace:
    """The run's `Trace` from its per-step counts `[L, D, E]` and 0-based steps, named after
    `meta["policy"]`."""
    return Trace(
        counts=np.stack(counts).astype(np.int64),
        step_ids=np.asarray(steps, dtype=np.int64),
        top_k=top_k,
        tokens_per_device=tokens_per_device,
        name=f"train-{meta['policy']}",
        meta={"source": "poise train", **meta},
    )


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    """`summary` as indented JSON, atomically."""
    atomic_write_text(path, json_text(summary, str(path)))


def closing_lines(res: Any, totals: Mapping[str, float], out: Path) -> list[str]:
    """The console's last two lines for a `TrainResult` and the seconds by phase `totals`."""
    done = (
        f"done: {len(res.losses)} steps, final loss {res.losses[-1]:.4f}"
        + (f", val {res.val[-1][1]:.4f}" if res.val else "")
        + f", {res.tokens_per_s:,.0f} tok/s (median), {res.plan_changes} plan changes;"
        + (
            f" EDP replicas {'identical' if res.replicas_agree else 'DIFFER'};"
            if res.replicas_agree is not None
            else ""
        )
        + f" outputs in {out}"
    )
    spent = sum(totals.values()) or 1.0
    phases = ", ".join(f"{k} {100 * v / spent:.0f}%" for k, v in totals.items() if v)
    return [done, f"time by phase: {phases}"]


__all__ = ["closing_lines", "previous_trace", "routing_trace", "write_summary"]
