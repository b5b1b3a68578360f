"""The Balancer's record of the steps it ran: what they routed and measured, and under what.

Per step, aligned (each a `deque` of the last `history` steps): `window`, all ranks' counts
`[L, D, E]` (what the predictor and the policies read; a resumed run may hold older rows that
were not measured); `measured`, the step's id then its `MEASURED` seconds; `layout`: `STATIC`,
`REPLICAS` (a plan with replicas), `OTHER` (a plan without) or `PROBE` (a probe step: the plan's
homes without its replicas); `settled`: not the step that carried a switch; `rank_experts`,
every rank's expert seconds `[D]`; `ran`, the replicas the step ran as `[R, 3]` rows `(layer,
device, expert)` (retargeted ones included, none on a probe step), so that each step is priced on
what ran. From them come the rows the planning job fits and judges (`under_plan`) and the probe
steps with their neighbours (`probe_pairs`). NumPy only.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from poise.runtime.control.clock import Probes
from poise.runtime.selfcal.fit import MEASURED

FIT_WINDOW = 20  # steps under the plan in force that the self-calibration fits
STATIC, REPLICAS, OTHER, PROBE = range(4)  # the layout a recorded step ran under
LAYOUT_NAMES = ("static", "replicas", "homes", "probe")  # as `metrics.jsonl` names them
N_MEASURED = len(MEASURED)


class StepRecords:
    """The last `history` steps' records (module docstring)."""

    def __init__(self, history: int) -> None:
        self.window: deque[np.ndarray] = deque(maxlen=history)  # [L, D, E] per step
        self.measured: deque[np.ndarray] = deque(maxlen=history)
        self.layout: deque[int] = deque(maxlen=history)
        self.settled: deque[bool] = deque(maxlen=history)
        self.rank_experts: deque[np.ndarray] = deque(maxlen=history)
        self.ran: deque[np.ndarray] = deque(maxlen=history)

    def append(
        self,
        counts: np.ndarray,
        row: np.ndarray,
        layout: int,
        settled: bool,
        rank_experts: np.ndarray | None = None,
        ran: np.ndarray | None = None,
    ) -> None:
        """One step: `rank_experts[D]` (None: not measured per rank, NaN in its place); `ran`:
        its replicas `[R, 3]` (None: none)."""
        self.window.append(counts)
        self.ran.append(np.zeros((0, 3), np.int64) if ran is None else np.asarray(ran, np.int64))
        self.measured.append(row)
        self.layout.append(layout)
        self.settled.append(settled)
        D = counts.shape[1]
        self.rank_experts.append(
            np.full(D, np.nan) if rank_experts is None else np.asarray(rank_experts, float)
        )

    def rank_expert_rows(self) -> np.ndarray:
        """`[n, D]` every rank's expert seconds, aligned with `measured_rows` (a copy)."""
        if not self.rank_experts:
            return np.zeros((0, 0))
        return np.stack(self.rank_experts)

    def ran_rows(self, measured: int, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """What the measured rows `rows` (indices among the newest `measured` steps, as
        `under_plan` gives them) ran: their `ran` entries."""
        first = len(self.ran) - measured
        return tuple(self.ran[first + int(i)] for i in rows)

    def measured_rows(self) -> np.ndarray:
        """`[n, 1 + N_MEASURED]` (a copy; empty when nothing was measured)."""
        return np.stack(self.measured) if self.measured else np.zeros((0, 1 + N_MEASURED))

    def not_probe(self) -> np.ndarray:
        """`[n]` bool: the measured rows that were not probe steps."""
        return np.array(self.layout, dtype=np.int64) != PROBE

    def under_plan(self, measured: np.ndarray, since: int) -> np.ndarray:
        """Indices of the newest `FIT_WINDOW` measured rows run under the plan in force since
        step `since`, probe steps left out (they ran another layout)."""
        return np.flatnonzero((measured[:, 0] >= since) & self.not_probe())[-FIT_WINDOW:]

    def probe_pairs(
        self, history: np.ndarray | None = None, measured: np.ndarray | None = None
    ) -> Probes:
        """The probe steps since plans with replicas took over, each with its settled
        neighbours run under them (the rows just before and after it), from `history` and
        `measured` (defaults: the window and the measured rows): the paired clock's samples
        (`poise.runtime.control.clock`). A probe with no such neighbour is left out."""
        history = np.stack(self.window) if history is None else history
        measured = self.measured_rows() if measured is None else measured
        aligned = history[len(history) - len(measured) :]
        layout = np.array(self.layout, dtype=np.int64)
        settled = np.array(self.settled, dtype=bool)
        off = np.flatnonzero((layout != REPLICAS) & (layout != PROBE))
        since = int(off[-1]) + 1 if off.size else 0
        kept: list[int] = []
        pairs: list[int] = []
        pair_of: list[int] = []
        for i in np.flatnonzero(layout[since:] == PROBE) + since:
            near = [
                j
                for j in (i - 1, i + 1)
                if since <= j < len(layout) and layout[j] == REPLICAS and settled[j]
            ]
            if near:
                pairs += near
                pair_of += [len(kept)] * len(near)
                kept.append(int(i))
        ran = tuple(self.ran[j] for j in pairs) if len(self.ran) == len(layout) else None
        return Probes(
            aligned[kept], measured[kept, 1:], aligned[pairs], measured[pairs, 1:],
            np.array(pair_of, dtype=np.int64), ran,
        )  # fmt: skip
