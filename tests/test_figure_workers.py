"""`poise.report.figure_workers`: figures drawn by worker processes are the figures drawn in
the caller, byte for byte; a file is drawn once; a figure's error reaches `wait`."""

from __future__ import annotations

import numpy as np
import pytest

from poise.report.figure_workers import FigureWorkers
from poise.report.plots import breakdown_plot, loss_curves_plot

PNG = b"\x89PNG\r\n\x1a\n"


def _phases(seed: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    return {p: {k: float(rng.random()) for k in ("a2a", "experts", "agg")} for p in "abc"}


def _curves(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {n: (np.arange(20), 3 + rng.random(20)) for n in ("static", "auto")}


def test_workers_draw_the_files_the_caller_would(tmp_path) -> None:
    """Two workers draw four figures; each file equals the one the plot function writes in
    this process from the same arguments (Agg's output is deterministic)."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    with FigureWorkers(2) as figures:
        for i in range(2):
            figures.draw("breakdown_plot", there / f"b{i}.png", _phases(i), title=f"b{i}")
            figures.draw("loss_curves_plot", there / f"l{i}.png", _curves(i), title=f"l{i}")
    for i in range(2):
        breakdown_plot(_phases(i), here / f"b{i}.png", title=f"b{i}")
        loss_curves_plot(_curves(i), here / f"l{i}.png", title=f"l{i}")
    for name in ("b0.png", "b1.png", "l0.png", "l1.png"):
        drawn = (there / name).read_bytes()
        assert drawn[:8] == PNG
        assert drawn == (here / name).read_bytes()
    assert (there / "b0.png").read_bytes() != (there / "b1.png").read_bytes()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_file_is_drawn_once(tmp_path, workers: int) -> None:
    """A second `draw` of a path is ignored: the file is the first figure's."""
    first = tmp_path / "first.png"
    breakdown_plot(_phases(0), first, title="x")
    path = tmp_path / "fig.png"
    with FigureWorkers(workers) as figures:
        figures.draw("breakdown_plot", path, _phases(0), title="x")
        figures.draw("breakdown_plot", path, _phases(1), title="x")
    assert path.read_bytes() == first.read_bytes()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_figures_error_reaches_wait(tmp_path, workers: int) -> None:
    figures = FigureWorkers(workers)
    with pytest.raises(AttributeError, match="no_such_plot"):
        figures.draw("no_such_plot", tmp_path / "x.png")
        figures.wait()
    figures = FigureWorkers(workers)
    with pytest.raises(TypeError):
        figures.draw("breakdown_plot", tmp_path / "y.png", _phases(0), colour="red")
        figures.wait()
    assert not (tmp_path / "y.png").exists()


def test_workers_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="workers must be >= 0"):
        FigureWorkers(-1)


def test_after_wait_a_figure_is_drawn_in_the_caller(tmp_path) -> None:
    figures = FigureWorkers(1)
    figures.wait()
    assert figures.pids() == []
    figures.draw("breakdown_plot", tmp_path / "late.png", _phases(0), title="x")
    assert (tmp_path / "late.png").read_bytes()[:8] == PNG  # written before `draw` returned


def test_an_error_inside_the_block_ends_the_workers() -> None:
    with pytest.raises(RuntimeError, match="caller failed"), FigureWorkers(1) as figures:
        assert figures.pids()
        raise RuntimeError("caller failed")
    assert figures.pids() == []
