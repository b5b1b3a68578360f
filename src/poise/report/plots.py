"""Plots written as PNG files (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from poise.util.atomic import atomic_write_bytes


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


def loss_curves_plot(
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]], path: str | Path, title: str
) -> None:
    """Training loss per run (`curves[name] = (steps, losses)`) on top; below, each later run's
    absolute difference from the first run's loss at the same steps (log scale; exact zeros are
    drawn at the bottom of the axis)."""
    names = list(curves)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7.5, 5.6), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]}
    )
    styles = ["-", "--", ":", "-."]
    for i, name in enumerate(names):
        steps, losses = (np.asarray(a, dtype=float) for a in curves[name])
        top.plot(steps, losses, styles[i % len(styles)], label=name, linewidth=1.6)
    top.set_ylabel("training loss (nats/byte)")
    top.grid(True, alpha=0.3)
    top.legend()
    top.set_title(title)
    ref_steps, ref = (np.asarray(a, dtype=float) for a in curves[names[0]])
    floor = 1e-9
    for name in names[1:]:
        steps, losses = (np.asarray(a, dtype=float) for a in curves[name])
        common, i_ref, i_run = np.intersect1d(ref_steps, steps, return_indices=True)
        diff = np.abs(losses[i_run] - ref[i_ref])
        bottom.plot(
            common,
            np.maximum(diff, floor),
            ".-",
            markersize=3,
            linewidth=1.0,
            label=f"|{name} - {names[0]}|",
        )
    bottom.set_yscale("log")
    bottom.set_ylim(bottom=floor)
    bottom.set_xlabel("step")
    bottom.set_ylabel("|difference|")
    bottom.grid(True, which="both", alpha=0.3)
    if len(names) > 1:
        bottom.legend(fontsize=8)
    _save(fig, path)


def train_speed_plot(
    step_s: Mapping[str, np.ndarray],
    tokens_per_s: Mapping[str, float],
    path: str | Path,
    title: str,
) -> None:
    """Measured training speed: step time (ms) per step for each policy (left) and the median
    tokens/s per policy (right). `step_s[name]` is `[S]` seconds."""
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10.5, 3.9), gridspec_kw={"width_ratios": [2.4, 1]}
    )
    for name, series in step_s.items():
        series = np.asarray(series, dtype=float) * 1e3
        left.plot(np.arange(1, len(series) + 1), series, label=name, linewidth=1.0, alpha=0.85)
    left.set_xlabel("step")
    left.set_ylabel("step time (ms)")
    left.grid(True, alpha=0.3)
    left.legend()
    names = list(tokens_per_s)
    values = [tokens_per_s[n] for n in names]
    bars = right.bar(names, values, color=[plt.get_cmap("tab10")(i) for i in range(len(names))])
    right.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
    right.set_ylabel("tokens/s (median step)")
    right.margins(y=0.15)
    fig.suptitle(title)
    _save(fig, path)


def layer_load_heatmaps(loads: Mapping[str, np.ndarray], path: str | Path, title: str) -> None:
    """Measured load over time, one heatmap per run: `loads[name]` is `[S, L, D]` tokens each
    rank computed per layer and step; each cell is shown as a ratio to its layer's mean over the
    ranks, columns grouped by layer (L0 r0, L0 r1, L1 r0, ...), one shared colour scale."""
    names = list(loads)
    ratios = {}
    for name in names:
        x = np.asarray(loads[name], dtype=float)
        mean = x.mean(axis=2, keepdims=True)
        ratios[name] = np.divide(x, mean, out=np.ones_like(x), where=mean > 0)
    vmax = max(2.0, max(float(r.max()) for r in ratios.values()))
    _, L, D = next(iter(ratios.values())).shape
    fig, axes = plt.subplots(
        1,
        len(names),
        figsize=(max(4.2, 0.45 * L * D + 1.8) * len(names), 4.2),
        squeeze=False,
        sharey=True,
    )
    image = None
    for ax, name in zip(axes[0], names, strict=True):
        r = ratios[name]
        image = ax.imshow(
            r.reshape(r.shape[0], -1),
            aspect="auto",
            cmap="magma",
            vmin=0,
            vmax=vmax,
            interpolation="nearest",
            extent=(-0.5, L * D - 0.5, r.shape[0] + 0.5, 0.5),
        )
        for b in range(1, L):
            ax.axvline(b * D - 0.5, color="white", linewidth=0.8)
        ax.set_xticks(range(L * D), [f"L{i // D}\nr{i % D}" for i in range(L * D)], fontsize=7)
        ax.set_title(f"{name}: slowest rank / mean {r.max(axis=2).mean():.2f}")
        ax.set_xlabel("layer, rank")
    axes[0][0].set_ylabel("step")
    fig.suptitle(title)
    fig.colorbar(image, ax=axes[0].tolist(), label="rank load / layer mean")
    _save(fig, path)
