"""Figures drawn in worker processes while the caller goes on.

    figures = FigureWorkers(workers=1)     # starts the workers (they import matplotlib now)
    figures.draw("loss_curves_plot", out / "loss.png", curves, title="loss")  # returns at once
    ...
    figures.wait()                          # every file written, or the first error raised

A figure takes 0.2-0.6 s to draw on a 2-core machine and importing matplotlib about 1 s, all
of it Python holding the GIL, so threads do not help; `poise demo` draws its ten figures in two
workers while it simulates and writes the page (docs/benchmarks.md, "Main job"). A figure is
named by its plot function in `poise.report.plots` (so the caller need not import matplotlib)
and its file, and a file is drawn once: a later `draw` of the same path is ignored, so a page
can name a figure that was set drawing before the page was written. The workers
are forked from the project's fork server (`poise.runtime.launch`; the `forkserver` start
method, so they inherit no threads and no torch state of the caller), each ends with the
process that made it (`launch.exit_with`), and every plot function writes its file atomically,
so a figure is either whole on disk or absent. `workers=0` draws in the calling process, at
`draw` (the same files, one after another).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any


def _start_worker(launcher: int) -> None:
    """In a worker: end with `launcher`, and import the plots (matplotlib) before any job."""
    from poise.runtime.launch import exit_with

    exit_with(launcher)
    import poise.report.plots  # noqa: F401


def _ready() -> None:
    """A job that only brings a worker up (its start imports the plots)."""


def _draw(plot: str, path: Path, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """`poise.report.plots.<plot>(*args, path=path, **kwargs)`."""
    from poise.report import plots

    getattr(plots, plot)(*args, path=path, **kwargs)


class FigureWorkers:
    """Draws figures with `workers` processes (0: in the caller, at once). `draw(plot, path,
    *args, **kwargs)` calls `poise.report.plots.<plot>(*args, path=path, **kwargs)` (picklable
    arguments) unless `path` was drawn already; `wait()` returns once every figure is written
    and raises the first error a figure raised. A context manager: leaving it waits, or, on an
    error, drops the figures not started."""

    def __init__(self, workers: int) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        self._futures: list[Future[Any]] = []
        self._paths: set[Path] = set()
        self._pool: ProcessPoolExecutor | None = None
        if workers:
            from poise.runtime.launch import warm_fork_server

            warm_fork_server()  # with its imports, if no run has started it yet
            self._pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("forkserver"),
                initializer=_start_worker,
                initargs=(os.getpid(),),
            )
            for _ in range(workers):  # the pool starts a worker per job while none is idle
                self._futures.append(self._pool.submit(_ready))

    def draw(self, plot: str, path: str | Path, *args: Any, **kwargs: Any) -> None:
        """Draw `poise.report.plots.<plot>` into `path` (class docstring): in a worker (returns
        at once), or here without workers; nothing if `path` was drawn already."""
        path = Path(path)
        if path in self._paths:
            return
        self._paths.add(path)
        if self._pool is None:
            _draw(plot, path, args, kwargs)
            return
        self._futures.append(self._pool.submit(_draw, plot, path, args, kwargs))

    def pids(self) -> list[int]:
        """The workers' process ids (none without workers, or once `wait` has returned)."""
        if self._pool is None:
            return []
        return sorted(self._pool._processes or {})  # the executor's own record of its workers

    def wait(self) -> None:
        """Wait for every figure; the first error a figure raised is raised here. The workers
        end: a later `draw` draws in the caller."""
        try:
            for future in self._futures:
                future.result()
        finally:
            self._close()

    def _close(self) -> None:
        """End the workers, dropping the figures not started; later figures draw here."""
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> FigureWorkers:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.wait()
        else:
            self._close()


__all__ = ["FigureWorkers"]
