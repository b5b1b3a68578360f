"""Plots written as PNG files (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from poise.atomic import atomic_write_bytes


def _save(fig: plt.Figure, path: str | Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def device_load_heatmaps(loads: Mapping[str, np.ndarray], path: str | Path, title: str) -> None:
    """One heatmap per entry: `loads[name]` is `[S, D]` tokens per device per step, shown as a
    ratio to the step's mean device load, on one shared colour scale."""
    names = list(loads)
    ratios = {}
    for name in names:
        x = np.asarray(loads[name], dtype=float)
        mean = x.mean(axis=1, keepdims=True)
        ratios[name] = np.divide(x, mean, out=np.ones_like(x), where=mean > 0)
    vmax = max(2.0, max(float(r.max()) for r in ratios.values()))
    fig, axes = plt.subplots(
        1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False, sharey=True
    )
    image = None
    for ax, name in zip(axes[0], names, strict=True):
        image = ax.imshow(
            ratios[name], aspect="auto", cmap="magma", vmin=0, vmax=vmax, interpolation="nearest"
        )
        ax.set_title(f"{name}: max/mean {ratios[name].max(axis=1).mean():.2f}")
        ax.set_xlabel("device")
    axes[0][0].set_ylabel("step")
    fig.suptitle(title)
    fig.colorbar(image, ax=axes[0].tolist(), label="device load / mean")
    _save(fig, path)
