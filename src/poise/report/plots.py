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


def step_time_plot(step_s: Mapping[str, np.ndarray], path: str | Path, title: str) -> None:
    """Step time (seconds) per policy over the replayed steps: `step_s[name]` is `[S]`."""
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    for name, series in step_s.items():
        ax.plot(np.arange(len(series)), series, label=name, linewidth=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(title)
    _save(fig, path)


def breakdown_plot(
    phases: Mapping[str, Mapping[str, float]],
    path: str | Path,
    title: str,
    step_s: Mapping[str, float] | None = None,
) -> None:
    """Stacked bars: mean seconds of work per step in each phase (`phases[policy][phase]`), one
    bar per policy in the given order; `step_s[policy]`, if given, is marked on each bar (under
    an overlapping schedule the step is shorter than the work)."""
    names = list(phases)
    keys = [k for k in next(iter(phases.values())) if any(phases[n][k] > 0 for n in names)]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2.5), 4.2))
    bottom = np.zeros(len(names))
    colors = plt.get_cmap("tab20")
    for i, key in enumerate(keys):
        values = np.array([phases[n][key] for n in names])
        ax.bar(names, values, bottom=bottom, label=key.removesuffix("_s"), color=colors(i))
        bottom += values
    if step_s is not None:
        ax.scatter(
            names,
            [step_s[n] for n in names],
            marker="_",
            s=600,
            color="black",
            zorder=3,
            label="step time",
        )
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1.0), loc="upper left")
    ax.set_title(title)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    _save(fig, path)
