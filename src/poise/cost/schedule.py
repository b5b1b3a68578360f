"""Schedules: how one training step's MoE operations overlap, turned into time per layer.

Each schedule combines the phase times of `poise.cost.phases.PhaseTimes` (seconds per layer,
slowest device) into the time a layer adds to one training step (forward + backward):

- `sync` (no overlap; FasterMoE's baseline of 3 computations and 4 all-to-alls):
      T = FNEC + BNEC + 2 (A_d + A_c) + FEC + BEC + Trans + Agg + Mig
  with A_d, A_c the dispatch and combine all-to-alls and BEC = 2 FEC.
- `pipelined(n)` (FasterMoE smart schedule / Tutel overlap degree): dispatch, expert compute and
  combine split into n chunks overlap, forward and backward alike. Dispatch and combine share
  the same links, so the pipeline has two resources, the links (busy a + b) and the experts (c):
      T_moe(a, c, b) = (a + c + b) / n + (n - 1) / n * max(a + b, c)
  the plain sum for n = 1, tending to max(a + b, c) plus one chunk of fill and drain. Its ideal
  speed-up, (a + b + c) / max(a + b, c), is at most 2 (FasterMoE §5.5, Fig. 12: an ideal of up
  to 1.71x per layer, up to 1.42x achieved).
- `prophet` (Pro-Prophet's block-wise scheduler, after its eq. 8): Trans of a block's replicas
  hides under the forward expert and non-expert compute of the block before it, Agg under the
  backward compute:
      T = sync terms without Trans/Agg + max(0, Trans - FEC - FNEC) + max(0, Agg - BEC - BNEC)
  Planning for the next step hides under the step's all-to-alls (`planning_s`).
- `padded` (DeepSpeed-MoE's dispatcher without token dropping): the `sync` timing, on loads
  padded to capacity (`traffic.padded_counts`): DeepSpeed's top-k gating with
  `drop_tokens=False` sets the capacity to the largest per-rank expert count in the world (an
  all-reduce of the maximum of `exp_counts`) and dispatches a `[E, capacity, d_model]` buffer
  per rank, so every (rank, expert) pair moves and computes that many rows, padding included.
  A policy's plan under `padded` is priced on the padded loads (DeepSpeed-MoE = `static` under
  `padded`).
- `hybrid` (HybridEP's overlap, reconstructed from its description): the expert all-gather inside
  a domain (Trans) starts as the layer does and hides under the pre-expert (non-MoE) forward
  compute; the gradients' reduction back (Agg) under the non-MoE backward compute:
      T = sync terms without Trans/Agg + max(0, Trans - FNEC) + max(0, Agg - BNEC)

Migration is never hidden: it moves optimizer state between steps. Planning is charged in full
except under `prophet`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from poise.core.errors import ConfigError
from poise.cost.phases import PhaseTimes


@dataclass(frozen=True)
class Schedule:
    """`kind` is sync, pipelined, prophet, hybrid or padded; `chunks` the pipeline depth
    (pipelined)."""

    kind: str = "sync"
    chunks: int = 1

    @property
    def name(self) -> str:
        return f"pipelined({self.chunks})" if self.kind == "pipelined" else self.kind

    @property
    def pads(self) -> bool:
        """Whether loads are padded to capacity before pricing (`padded`, DeepSpeed-MoE)."""
        return self.kind == "padded"

    def layer_time(self, p: PhaseTimes) -> np.ndarray:
        """Seconds each layer adds to a step, `[L]`."""
        n = self.chunks
        moe_fwd = _pipeline(p.dispatch_s, p.expert_fwd_s, p.combine_s, n)
        moe_bwd = _pipeline(p.combine_s, p.expert_bwd_s, p.dispatch_s, n)
        base = p.non_moe_fwd_s + p.non_moe_bwd_s + moe_fwd + moe_bwd + p.migrate_s
        # The dispatcher's host work runs on the device's own thread between the collectives:
        # it adds under every schedule (`poise.cost.host`; zero without measured host costs).
        base = base + p.dispatch_host_fwd_s + p.dispatch_host_bwd_s
        if self.kind == "prophet":
            hidden_trans = np.maximum(0.0, p.trans_s - p.expert_fwd_s - p.non_moe_fwd_s)
            hidden_agg = np.maximum(0.0, p.agg_s - p.expert_bwd_s - p.non_moe_bwd_s)
            return base + hidden_trans + hidden_agg
        if self.kind == "hybrid":
            exposed_trans = np.maximum(0.0, p.trans_s - p.non_moe_fwd_s)
            exposed_agg = np.maximum(0.0, p.agg_s - p.non_moe_bwd_s)
            return base + exposed_trans + exposed_agg
        return base + p.trans_s + p.agg_s

    def planning_s(self, plan_s: float, a2a_s: float) -> float:
        """Seconds a planner run of `plan_s` adds to the step it is made in, given the step's
        all-to-all time `a2a_s` (all layers, forward and backward). Pro-Prophet's scheduler runs
        the planner under the all-to-all; the other schedules wait for it."""
        if self.kind == "prophet":
            return max(0.0, plan_s - a2a_s)
        return plan_s


def _pipeline(a: np.ndarray, c: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    if n <= 1:
        return a + c + b
    return (a + c + b) / n + (n - 1) / n * np.maximum(a + b, c)


def parse_schedule(text: str) -> Schedule:
    """`sync`, `prophet`, `hybrid`, `padded`, `pipelined`, `pipelined(4)` or `pipelined:4`."""
    text = text.strip()
    if text in ("sync", "prophet", "hybrid", "padded"):
        return Schedule(text, 1)
    m = re.fullmatch(r"pipelined(?:\((\d+)\)|:(\d+))?", text)
    if m:
        chunks = int(m.group(1) or m.group(2) or 4)
        if chunks < 1:
            raise ConfigError("pipeline chunks must be >= 1", source=text, field="schedule")
        return Schedule("pipelined", chunks)
    raise ConfigError(
        "unknown schedule (known: sync, pipelined(n), prophet, hybrid, padded)",
        source=text,
        field="schedule",
    )
