"""`MoEConfig`: everything that defines one MoE layer's computation, in one frozen dataclass.

    cfg = MoEConfig(d_model=512, d_expert=1024, num_experts=8, top_k=2, balance_coef=0.01)
    moe = MoE(cfg)                       # compute-only: all E experts, one device

Where the experts live (the process group, the slots per device) is not part of it: that is
attached from outside by `poise.nn.apply_expert_parallel`. Every rank of an expert-parallel
group must hold the same config (`digest()` is compared across the ranks when EP is applied).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from poise.core.errors import ConfigError
from poise.nn.experts import ACTIVATIONS, IMPLS, Activation, ExpertsImpl
from poise.nn.router import SCORES, Score
from poise.util.digest import digest


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: `M = d_model` (model width), `H = d_expert` (each expert's hidden width),
    `E = num_experts`, `K = top_k`.

    - `activation`: the experts' FFN, "swiglu" or "gelu";
    - router: `score` ("softmax" | "sigmoid"), `renormalize` (None: when `top_k > 1`),
      `balance_coef`, `z_loss_coef` (weights of the auxiliary losses), `expert_bias`
      (DeepSeek-V3's aux-loss-free bias), `capacity_factor` (None: dropless);
    - `overlap_degree`: token all-to-all chunks pipelined with expert compute under EP (1: none);
    - `experts_impl`: "auto" | "grouped" | "loop" (see `poise.nn.experts`);
    - `check_finite`: raise `NonFiniteInputError` on NaN/inf input (on every rank under EP);
    - `init_seed`: expert e is drawn from a generator seeded by (init_seed, e), so its weights
      do not depend on where it lives; None: one draw from torch's global generator when the
      layer is built."""

    d_model: int
    d_expert: int
    num_experts: int
    top_k: int = 2
    activation: Activation = "swiglu"
    score: Score = "softmax"
    renormalize: bool | None = None
    balance_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias: bool = False
    capacity_factor: float | None = None
    overlap_degree: int = 1
    experts_impl: ExpertsImpl = "auto"
    check_finite: bool = True
    init_seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the first field that is out of range."""
        for name in ("d_model", "d_expert", "num_experts", "top_k", "overlap_degree"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"must be an integer >= 1, got {value!r}", field=name)
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"must be at most num_experts={self.num_experts}, got {self.top_k}",
                field="top_k",
            )
        for name, allowed in (
            ("activation", ACTIVATIONS),
            ("score", SCORES),
            ("experts_impl", IMPLS),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"must be one of {', '.join(allowed)}, got {getattr(self, name)!r}",
                    field=name,
                )
        for name in ("balance_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or _is_bool(value) or not 0 <= value < math.inf:
                raise ConfigError(f"must be a finite number >= 0, got {value!r}", field=name)
        cap = self.capacity_factor
        if cap is not None and (
            _is_bool(cap) or not isinstance(cap, int | float) or not 0 < cap < math.inf
        ):
            raise ConfigError(
                f"must be > 0 (or None: dropless), got {cap!r}", field="capacity_factor"
            )
        if self.renormalize is not None and not _is_bool(self.renormalize):
            raise ConfigError(
                f"must be true, false or None, got {self.renormalize!r}", field="renormalize"
            )
        for name in ("expert_bias", "check_finite"):
            if not _is_bool(getattr(self, name)):
                raise ConfigError(f"must be true or false, got {getattr(self, name)!r}", field=name)
        if self.init_seed is not None and (not _is_int(self.init_seed) or self.init_seed < 0):
            raise ConfigError(f"must be an integer >= 0 or None, got {self.init_seed!r}",
                              field="init_seed")  # fmt: skip

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with `changes` (validated)."""
        return dataclasses.replace(self, **changes)

    def digest(self) -> int:
        """A digest of the fields every rank of an expert-parallel group must agree on (all but
        `init_seed`, which only matters through the weights, and `experts_impl`/`check_finite`,
        which do not change the mathematics)."""
        skip = {"init_seed", "experts_impl", "check_finite"}
        return digest(*((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                        if f.name not in skip))  # fmt: skip


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["MoEConfig"]
