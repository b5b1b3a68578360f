"""Steps taken in turns by runs that share one host: a paired comparison between whole runs.

Two runs on one machine compared one after the other meet different machines: on a shared
2-core host the same static run's tokens/s moves 10-15% between runs (other processes, clock
frequency), more than balancing changes a step. Run side by side, they would take each other's
cores. Taking turns step by step, each run's step k runs alone, right before or after the other
run's step k: the machine's drift falls on both alike within seconds, and neither takes the other's
cores (as `benchmarks/ep_step.py` rotates its models within one process).

    turns = StepTurns.open("/dev/shm/pair", slot=0, slots=2, rank=rank, group=None)
    turns.arrive()               # every rank: until every run has started up
    for step in range(start, steps):
        turns.wait(step)         # every rank: until the runs before this one have done step k
        ...                      # the step
        turns.hand_over(step)    # every rank; then rank 0 passes the turn on
    turns.finish(steps)          # every rank: until every run has done its last step

The turn is an 8-byte counter in a file every run opens (`path`; a fresh file for each set of
runs: a counter left by an earlier set lets its runs through at once). In step k the runs go in
the order of their slots when k is even and in the reverse order when k is odd (A B, B A, A B,
...: with the same order every step, identical runs measured the second one 1-2% slower, and
each run now follows the others as often as itself). Run `slot` at place `p` of step k may start
it once the counter is at least `k * slots + p`; when every rank of that run is done (a barrier
on its group), its rank 0 sets the counter to `k * slots + p + 1`. Only the
run whose turn it is writes the counter, and it only grows; a run whose own step comes next
(the order reversed) goes on without reading it, on every rank alike. A rank waiting for
another run first sleeps `SLEEP_SHARE` of the shortest of its last `RECENT` waits (the other
runs' steps change little from one step to the next; a rank that slept past its turn would hold
up its run's first collective and lengthen the step measured), then reads the counter every
`POLL_S`: a waiting run wakes a few hundred times a turn, not thousands (each wake-up
interrupts the running run's ranks).
A run that fails marks the file abandoned (`abandon`, a third counter at offset 16) and the
others raise a `TurnsError` at their next wait; one that stops without a word leaves them
waiting: after `timeout_s` they raise one naming the file, the step and the counter.

Start-up and shut-down take cores too (imports, building the model; saving the trace, closing
the group): `arrive` holds every run's first step until all runs have started (a second counter
at offset 8, which each run's rank 0 increments under a file lock), and `finish` holds each run
at its end until the last run has done its last step. A turn file whose other runs never start
(a `turns` setting left in a config run alone) is not waited on for ever in silence: after
`NOTE_AFTER_S` rank 0 says in one line what it waits for and for how long, and after
`start_timeout_s` (`START_TIMEOUT_S`, or `timeout_s` if shorter) `arrive` raises one
`TurnsError` naming the file and how many runs arrived.

What a run does in the background must stop while it does not hold the turn (the Balancer's
planner, a Trans still in flight: `Balancer.pause`), or it would run on the other run's time;
the training loop does that around `wait` and `hand_over`.
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from poise.core.errors import PoiseError
from poise.nn import comm

POLL_S = 1e-3  # seconds between two reads of the counter while waiting (a waiting rank sleeps)
SLEEP_SHARE = 0.5  # a wait first sleeps this share of the shortest of the last RECENT waits
RECENT = 4
START_TIMEOUT_S = 120.0  # how long `arrive` waits for the other runs to start
NOTE_AFTER_S = 5.0  # a start-up wait this long is announced (rank 0, one line)
_COUNTER = struct.Struct("<q")  # little-endian int64s: the turn at offset 0, arrivals at 8
TURN, ARRIVED, ABANDONED = 0, _COUNTER.size, 2 * _COUNTER.size


class TurnsError(PoiseError):
    """A run waited longer than its timeout for its turn, or the turn file cannot be used."""


@dataclass
class StepTurns:
    """Run `slot` of `slots` taking steps in turns through the counter file `path`; `rank` is
    this process's rank in its run, `group` the run's process group (None: the default group,
    or none at all in a one-process run)."""

    path: Path
    slot: int
    slots: int
    rank: int
    group: dist.ProcessGroup | None
    fd: int
    timeout_s: float = 600.0
    start_timeout_s: float = START_TIMEOUT_S
    recent_waits: list[float] = field(default_factory=list)  # the last waits for other runs
    handed: int = -1  # the counter this run's last `hand_over` set (or sets, on other ranks)

    @classmethod
    def open(
        cls,
        path: str | Path,
        slot: int,
        slots: int,
        rank: int,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float | None = None,
    ) -> StepTurns:
        """Open (creating if needed) the counter file; every rank of every run calls this.
        `timeout_s` bounds every wait for a turn, `start_timeout_s` (at most `timeout_s`) the
        wait in `arrive` for the other runs to start (None: `START_TIMEOUT_S`)."""
        if not 0 <= slot < slots:
            raise TurnsError(f"slot {slot} is not one of 0..{slots - 1}", field="turns_slot")
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise TurnsError(f"cannot open the turn file {p}: {exc}", field="turns") from None
        start = START_TIMEOUT_S if start_timeout_s is None else start_timeout_s
        return cls(p, slot, slots, rank, group, fd, timeout_s, min(start, timeout_s))

    def place(self, step: int) -> int:
        """This run's place in step `step`'s order: its slot on even steps, the reverse on odd
        ones (0 1, 1 0, 0 1, ...), so that each run follows the other runs as often as itself."""
        return self.slot if step % 2 == 0 else self.slots - 1 - self.slot

    def counter(self, at: int = TURN) -> int:
        """The counter at offset `at` (0 in a file not yet written)."""
        raw = os.pread(self.fd, _COUNTER.size, at)
        return _COUNTER.unpack(raw)[0] if len(raw) == _COUNTER.size else 0

    def arrive(self) -> float:
        """This run has started up: count it (rank 0, under a file lock), then block until
        every run has; the seconds waited. Collective over the run's group."""
        _barrier(self.group)
        if self.rank == 0:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                os.pwrite(self.fd, _COUNTER.pack(self.counter(ARRIVED) + 1), ARRIVED)
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
        t0 = time.perf_counter()
        deadline = t0 + self.start_timeout_s
        noted = self.rank != 0
        while (seen := self.counter(ARRIVED)) < self.slots:
            self._check_abandoned("to start")
            waited = time.perf_counter() - t0
            if not noted and waited >= NOTE_AFTER_S:
                noted = True
                print(
                    f"poise: run {self.slot} waits for {self.slots - seen} other run(s) to start "
                    f"taking turns in {self.path} (up to {self.start_timeout_s:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
            if time.perf_counter() > deadline:
                raise TurnsError(
                    f"{seen} of {self.slots} runs started taking turns in {self.path} within "
                    f"{self.start_timeout_s:g} s; start the other run(s) with the same turn file, "
                    "or run without `turns`",
                    field="turns",
                )
            time.sleep(POLL_S)
        return time.perf_counter() - t0

    def wait(self, step: int) -> float:
        """Block until this run may start step `step` (0-based, the same numbering in every
        run); the seconds waited."""
        want = step * self.slots + self.place(step)
        if want <= self.handed:  # this run's own step came just before (the order reversed)
            return 0.0
        t0 = time.perf_counter()
        if self.counter() < want and self.recent_waits:
            time.sleep(min(SLEEP_SHARE * min(self.recent_waits), self.timeout_s))
        self._until(TURN, want, f"for its turn at step {step}")
        waited = time.perf_counter() - t0
        self.recent_waits = [*self.recent_waits[-(RECENT - 1) :], waited]
        return waited

    def finish(self, steps: int) -> float:
        """Block until every run has done its step `steps - 1` (this run's last); the seconds
        waited."""
        return self._until(TURN, steps * self.slots, f"for the others to end step {steps - 1}")

    def abandon(self) -> None:
        """This run fails: the other runs stop waiting for it (they raise at their next wait)."""
        os.pwrite(self.fd, _COUNTER.pack(self.slot + 1), ABANDONED)

    def _until(self, at: int, want: int, what: str) -> float:
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        while (seen := self.counter(at)) < want:
            self._check_abandoned(what)
            if time.perf_counter() > deadline:
                raise TurnsError(
                    f"run {self.slot} of {self.slots} waited {self.timeout_s:g} s {what} in "
                    f"{self.path} (counter {seen}, needs {want}): another run stopped or is "
                    "far behind",
                    field="turns",
                )
            time.sleep(POLL_S)
        return time.perf_counter() - t0

    def _check_abandoned(self, what: str) -> None:
        if gone := self.counter(ABANDONED):
            raise TurnsError(
                f"run {gone - 1} of {self.slots} failed; run {self.slot} stops waiting "
                f"{what} in {self.path}",
                field="turns",
            )

    def hand_over(self, step: int) -> None:
        """Step `step` is done on this rank: once it is on every rank of the run, rank 0 passes
        the turn to the next run. Collective over the run's group."""
        _barrier(self.group)
        self.handed = step * self.slots + self.place(step) + 1
        if self.rank == 0:
            os.pwrite(self.fd, _COUNTER.pack(self.handed), TURN)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        comm.barrier(group=group)


__all__ = ["NOTE_AFTER_S", "POLL_S", "START_TIMEOUT_S", "StepTurns", "TurnsError"]
