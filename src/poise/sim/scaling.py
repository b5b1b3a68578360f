"""Driving a large modelled cluster with a trace recorded on few ranks.

A trace holds one row of routing counts per *source device* (`counts[S, L, D0, E]`). To replay
it on D > D0 devices, each modelled device is given one observed row to replay for the whole
run: every observed rank drives D / D0 devices (the first D mod D0 ranks, in a seeded random
order, drive one more), and which devices each drives is a seeded shuffle, so hot senders are
spread over nodes and domains rather than packed together. A device keeps its row's variation
over steps (its drift, its bursts), and the expert totals of a step scale by D / D0 exactly when
D0 divides D (approximately otherwise), so their proportions are kept.

Scaling down (D < D0) keeps D of the observed rows, chosen the same way; each step's tokens per
device stay what the trace recorded.

Steps are produced one at a time (`ScaledTrace.step`), so an 8,192-device replay never holds
the whole scaled trace in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.core.errors import ConfigError


def source_rows(observed: int, devices: int, seed: int = 0) -> np.ndarray:
    """`[devices]` the observed row each modelled device replays (see the module docstring)."""
    if observed < 1 or devices < 1:
        raise ConfigError(
            f"need at least one observed and one modelled device, got {observed} -> {devices}",
            source="trace",
            field="devices",
        )
    rng = np.random.default_rng(seed)
    base, extra = divmod(devices, observed)
    uses = np.full(observed, base)
    uses[rng.permutation(observed)[:extra]] += 1
    rows = np.repeat(np.arange(observed), uses)
    return rows[rng.permutation(devices)]


@dataclass
class ScaledTrace:
    """`counts[S, L, D0, E]` replayed on `devices` modelled devices (`rows[devices]`)."""

    counts: np.ndarray
    rows: np.ndarray

    @classmethod
    def create(cls, counts: np.ndarray, devices: int, seed: int = 0) -> ScaledTrace:
        observed = counts.shape[2]
        same = devices == observed
        return cls(counts, np.arange(observed) if same else source_rows(observed, devices, seed))

    @property
    def steps(self) -> int:
        return int(self.counts.shape[0])

    @property
    def devices(self) -> int:
        return int(self.rows.shape[0])

    @property
    def observed(self) -> int:
        return int(self.counts.shape[2])

    @property
    def scaled(self) -> bool:
        return self.devices != self.observed

    def step(self, s: int) -> np.ndarray:
        """`[L, devices, E]` float64 loads of step `s`."""
        step = self.counts[s]
        if not self.scaled:
            return step.astype(np.float64)
        return step[:, self.rows, :].astype(np.float64)

    def describe(self) -> str:
        """One line for outputs: how the trace was mapped onto the modelled devices."""
        if not self.scaled:
            return f"trace replayed as recorded on {self.devices} devices"
        if self.devices > self.observed:
            per = self.devices / self.observed
            return (
                f"trace scaled from {self.observed} to {self.devices} source devices by "
                f"resampling rows (each observed rank drives {per:g} devices)"
            )
        return (
            f"trace reduced from {self.observed} to {self.devices} source devices "
            f"(a seeded sample of the observed rows)"
        )
