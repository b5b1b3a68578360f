"""Fault injection: kill one training rank at a chosen step and phase, to prove restarts work.

    poise train configs/tiny.yaml --nproc 2 --max-restarts 1 --fail-at-step 7 --fail-rank 1
    POISE_FAIL_AT_STEP=7 POISE_FAIL_RANK=1 POISE_FAIL_PHASE=migrate torchrun ... -m poise.train ...

A `Fault` names the step (1-based: the step-th optimizer step of the run), the rank and the
phase in which the rank dies:

- `step`: at the start of the step, before its forward;
- `forward`, `backward`: after the forward / backward of the step;
- `agg`, `trans`, `migrate`: in the middle of the Balancer applying a plan: right after this rank
  launched the first exchange of the first Agg (replica gradients to homes), Trans (weights to
  replicas) or migration (weights and AdamW moments to new homes) at or after that step, so its
  peers are inside the same collective when it dies;
- `checkpoint`: in the first checkpoint at or after that step: rank 0 (which writes it) dies
  half-way through writing the file, another rank as it enters the checkpoint's gather.

The rank dies by SIGKILL (no cleanup, no flush of open files: what a crashed node does). The
fault fires in the first attempt only (`POISE_RESTART_COUNT` unset or 0, as set by
`poise train --max-restarts`, or torchrun's `TORCHELASTIC_RESTART_COUNT`), so a restarted run
passes the same step. Settings come from the environment, so they reach ranks started by any
launcher; `poise train --fail-at-step/--fail-rank/--fail-phase` sets them.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from poise.core.errors import ConfigError

ENV_STEP = "POISE_FAIL_AT_STEP"
ENV_RANK = "POISE_FAIL_RANK"
ENV_PHASE = "POISE_FAIL_PHASE"
ENV_RESTART = "POISE_RESTART_COUNT"
ENV_ELASTIC_RESTART = "TORCHELASTIC_RESTART_COUNT"
PHASES = ("step", "forward", "backward", "agg", "trans", "migrate", "checkpoint")
TRANSFER_PHASES = {"agg": "agg_async", "trans": "trans_async", "migrate": "migrate"}


@dataclass(frozen=True)
class Fault:
    """Kill rank `rank` in `phase` of step `step` (1-based)."""

    step: int
    rank: int = 0
    phase: str = "step"

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ConfigError(f"must be >= 1, got {self.step}", source=ENV_STEP, field="step")
        if self.rank < 0:
            raise ConfigError(f"must be >= 0, got {self.rank}", source=ENV_RANK, field="rank")
        if self.phase not in PHASES:
            raise ConfigError(
                f"must be one of {', '.join(PHASES)}; got {self.phase!r}",
                source=ENV_PHASE,
                field="phase",
            )

    def env(self) -> dict[str, str]:
        """The environment variables that carry this fault to the ranks."""
        return {ENV_STEP: str(self.step), ENV_RANK: str(self.rank), ENV_PHASE: self.phase}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Fault | None:
        """The fault the environment asks for, or None (no `POISE_FAIL_AT_STEP`)."""
        env = os.environ if env is None else env
        if not env.get(ENV_STEP):
            return None
        return cls(
            step=_env_int(env, ENV_STEP),
            rank=_env_int(env, ENV_RANK) if env.get(ENV_RANK) else 0,
            phase=env.get(ENV_PHASE) or "step",
        )


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"must be an integer, got {env[name]!r}", source=name) from None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times the launcher has restarted this run (0 in the first attempt)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_RESTART) or env.get(ENV_ELASTIC_RESTART) or "0"
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"must be an integer, got {raw!r}", source=ENV_RESTART) from None


def die() -> None:
    """End this process at once with SIGKILL, as a crash would (stdout/stderr flushed first so
    the log says why)."""
    print(f"poise: fault injection: killing rank pid {os.getpid()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector:
    """Fires `fault` on `rank` in the first attempt. The training loop calls `at(step, phase)`
    for the loop phases; `install()` wraps the Balancer's transfer functions and the checkpoint
    writer so the other phases fire inside them; `uninstall()` restores them."""

    def __init__(self, fault: Fault | None, rank: int, *, kill: Callable[[], None] = die) -> None:
        self.fault = fault
        self.rank = rank
        self.armed = fault is not None and fault.rank == rank and restart_count() == 0
        self.step = 0  # 1-based step the loop is in
        self._kill = kill
        self._restore: list[tuple[Any, str, Any]] = []

    def at(self, step: int, phase: str) -> None:
        """The loop reached `phase` of step `step` (1-based)."""
        self.step = step
        if self._due(phase):
            self._kill()

    def _due(self, phase: str) -> bool:
        f = self.fault
        return self.armed and f is not None and f.phase == phase and self.step >= f.step

    def install(self) -> None:
        if not self.armed or self.fault is None or self._restore:
            return
        phase = self.fault.phase
        if phase in TRANSFER_PHASES:
            self._wrap_transfer(phase, TRANSFER_PHASES[phase])
        elif phase == "checkpoint":
            self._wrap_checkpoint()

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _wrap_transfer(self, phase: str, function: str) -> None:
        """Inside `transfers.<function>` (when due): die right after its first `exchange` has
        been launched, so the peers are inside that collective."""
        from poise.runtime.moves import transfers

        outer = getattr(transfers, function)
        exchange = transfers.exchange
        inside = {"on": False}

        def exchange_then_die(*args: Any, **kwargs: Any) -> Any:
            result = exchange(*args, **kwargs)
            if inside["on"]:
                self._kill()
            return result

        def watched(*args: Any, **kwargs: Any) -> Any:
            inside["on"] = self._due(phase)
            try:
                return outer(*args, **kwargs)
            finally:
                inside["on"] = False

        self._patch(transfers, "exchange", exchange_then_die)
        self._patch(transfers, function, watched)

    def _wrap_checkpoint(self) -> None:
        """Inside a checkpoint (when due): rank 0 writes half of the bytes, then dies; another
        rank dies as it enters the gather of the checkpoint's tensors."""
        import io

        from poise.train import checkpoint

        serialize, snapshot = checkpoint._serialize, checkpoint.snapshot

        def die_then_snapshot(*args: Any, **kwargs: Any) -> Any:
            if self.rank != 0 and self._due("checkpoint"):
                self._kill()
            return snapshot(*args, **kwargs)

        def half_then_die(obj: Any, fh: Any) -> None:
            if not self._due("checkpoint"):
                serialize(obj, fh)
                return
            buf = io.BytesIO()
            serialize(obj, buf)
            data = buf.getvalue()
            fh.write(data[: len(data) // 2])
            fh.flush()
            self._kill()

        self._patch(checkpoint, "_serialize", half_then_die)
        self._patch(checkpoint, "snapshot", die_then_snapshot)
