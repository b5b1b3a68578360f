"""The shape of an MoE model, as far as planning and pricing need it.

Derived quantities (per MoE layer):

- expert parameters  P_e = m * d_model * d_expert  (m = 2 weight matrices for GELU, 3 for SwiGLU)
- expert bytes       W_e = P_e * dtype_bytes        (what Trans sends and Agg returns)
- migration bytes    M_e = P_e * (dtype_bytes + optimizer_bytes_per_param)
- forward FLOPs per routed token  F_t = 2 * P_e     (backward is twice forward)
- bytes per routed token on the wire  B_t = d_model * dtype_bytes

Compute is priced in `compute_dtype` (`core.cluster.DTYPES`: fp32, tf32, bf16, fp16; the
device's rate for it is `Cluster.gemm_flops`). Left out, it follows `dtype_bytes`: 4 -> fp32,
2 -> bf16 (`gemm_dtype`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poise.core.cluster import DTYPES
from poise.core.errors import ConfigError
from poise.core.fields import get_int, get_number, get_str, read_mapping_file, reject_unknown

DEFAULT_COMPUTE_DTYPE = {4: "fp32", 2: "bf16"}


def resolve_compute_dtype(compute_dtype: str | None, dtype_bytes: int, source: str) -> str:
    """`compute_dtype` checked against `DTYPES`, or (None) the default for `dtype_bytes`:
    4 -> fp32, 2 -> bf16. Anything else raises `ConfigError` naming `compute_dtype`."""
    if compute_dtype is None:
        if dtype_bytes in DEFAULT_COMPUTE_DTYPE:
            return DEFAULT_COMPUTE_DTYPE[dtype_bytes]
        raise ConfigError(
            f"no default for dtype_bytes {dtype_bytes} (4 -> fp32, 2 -> bf16): give one of "
            f"{', '.join(DTYPES)}",
            source=source,
            field="compute_dtype",
        )
    if compute_dtype not in DTYPES:
        raise ConfigError(
            f"must be one of {', '.join(DTYPES)}, got {compute_dtype!r}",
            source=source,
            field="compute_dtype",
        )
    return compute_dtype


# What a model's sizes can mean (a value past them passes as an integer but makes figures that
# mean nothing: d_model 2^40 priced a step at 4e20 ms). Widths: 2^20, over 50x the widest public
# model (GPT-3's d_model 12,288); experts: 2^20, "Mixture of A Million Experts" (He, 2024);
# top_k: as many as experts; MoE layers: 1,024 (public models have at most about 100);
# tokens per device and step: 2^24 (public micro-batches are at most about 10^6 tokens).
SIZE_BOUNDS = {
    "d_model": 2**20,
    "d_expert": 2**20,
    "experts": 2**20,
    "top_k": 2**20,
    "moe_layers": 1024,
    "tokens_per_device": 2**24,
}


@dataclass(frozen=True)
class ModelSpec:
    """`tokens_per_device` counts tokens (not token-expert pairs) entering a MoE layer on each
    device per step; `non_moe_flops_per_token` is the forward FLOPs of the rest of one block
    (attention, projections) per token (None: 24 * d_model**2, a GPT block's dense part without
    its FFN, at 2 FLOPs per multiply-add and a short context). `compute_dtype`: the dtype its
    GEMMs run in (`DTYPES`; None: from `dtype_bytes`, see `gemm_dtype`)."""

    name: str
    d_model: int
    d_expert: int
    experts: int
    top_k: int
    moe_layers: int
    dtype_bytes: int = 2
    tokens_per_device: int = 4096
    non_moe_flops_per_token: float | None = None
    optimizer_bytes_per_param: float = 12.0
    activation: str = "gelu"
    compute_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "d_model",
            "d_expert",
            "experts",
            "top_k",
            "moe_layers",
            "dtype_bytes",
            "tokens_per_device",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"must be >= 1, got {getattr(self, name)}", source=self.name, field=name
                )
        if self.top_k > self.experts:
            raise ConfigError(
                f"top_k {self.top_k} exceeds experts {self.experts}",
                source=self.name,
                field="top_k",
            )
        if self.activation not in ("gelu", "swiglu"):
            raise ConfigError("must be gelu or swiglu", source=self.name, field="activation")
        resolve_compute_dtype(self.compute_dtype, self.dtype_bytes, self.name)

    @property
    def gemm_dtype(self) -> str:
        """The dtype compute is priced in: `compute_dtype`, or from `dtype_bytes` (4 -> fp32,
        2 -> bf16)."""
        return resolve_compute_dtype(self.compute_dtype, self.dtype_bytes, self.name)

    @property
    def expert_matrices(self) -> int:
        return 3 if self.activation == "swiglu" else 2

    @property
    def expert_params(self) -> int:
        return self.expert_matrices * self.d_model * self.d_expert

    @property
    def expert_bytes(self) -> float:
        return float(self.expert_params * self.dtype_bytes)

    @property
    def migration_bytes(self) -> float:
        return float(self.expert_params * (self.dtype_bytes + self.optimizer_bytes_per_param))

    @property
    def token_bytes(self) -> float:
        return float(self.d_model * self.dtype_bytes)

    @property
    def flops_per_token_fwd(self) -> float:
        """Forward FLOPs of one expert for one routed token."""
        return 2.0 * self.expert_params

    @property
    def non_moe_flops_fwd(self) -> float:
        """Forward FLOPs of one block's non-MoE part per token."""
        if self.non_moe_flops_per_token is not None:
            return float(self.non_moe_flops_per_token)
        return 24.0 * self.d_model**2

    @property
    def dense_params_per_block(self) -> float:
        """P_d: replicated (non-expert) parameters of one block, F_d / 2 (F_d the block's dense
        forward FLOPs per token, 2 FLOPs per multiply-add)."""
        return self.non_moe_flops_fwd / 2.0

    @property
    def dense_params(self) -> int:
        """Replicated parameters of all the MoE blocks, `moe_layers` x P_d: their gradients are
        all-reduced across the devices every step."""
        return int(self.moe_layers * self.dense_params_per_block)

    def with_(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> ModelSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        reject_unknown(data, fields, source)
        kwargs: dict[str, Any] = {"name": get_str(data, "name", source, default=Path(source).stem)}
        for key in ("d_model", "d_expert", "experts", "top_k", "moe_layers"):
            kwargs[key] = get_int(data, key, source, minimum=1, maximum=SIZE_BOUNDS[key])
        kwargs["dtype_bytes"] = get_int(
            data, "dtype_bytes", source, default=2, minimum=1, maximum=8
        )
        kwargs["tokens_per_device"] = get_int(
            data,
            "tokens_per_device",
            source,
            default=4096,
            minimum=1,
            maximum=SIZE_BOUNDS["tokens_per_device"],
        )
        kwargs["non_moe_flops_per_token"] = get_number(
            data, "non_moe_flops_per_token", source, default=None, non_negative=True
        )
        kwargs["optimizer_bytes_per_param"] = get_number(
            data, "optimizer_bytes_per_param", source, default=12.0, non_negative=True
        )
        kwargs["activation"] = get_str(
            data, "activation", source, default="gelu", choices=("gelu", "swiglu")
        )
        kwargs["compute_dtype"] = get_str(
            data, "compute_dtype", source, default=None, choices=DTYPES
        )
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(exc.message, source=source, field=exc.field) from None

    @classmethod
    def load(cls, path: str | Path) -> ModelSpec:
        return cls.from_dict(read_mapping_file(path), str(path))


MODELS: dict[str, ModelSpec] = {
    # The SmartMoE-AE trace's model: GPT-style, 24 MoE layers, 32 experts, top-2; the planner
    # benchmark's shape (d_model 1024, d_expert 2048, fp16, 8,192 tokens per device).
    "smartmoe-gpt": ModelSpec(
        "smartmoe-gpt",
        d_model=1024,
        d_expert=2048,
        experts=32,
        top_k=2,
        moe_layers=24,
        dtype_bytes=2,
        tokens_per_device=8192,
        compute_dtype="fp16",
    ),
    # Pro-Prophet's GPT-S/M/L (16 experts, one MoE layer per block).
    "gpt-s": ModelSpec(
        "gpt-s",
        d_model=768,
        d_expert=3072,
        experts=16,
        top_k=1,
        moe_layers=12,
        tokens_per_device=8192,
    ),
    "gpt-m": ModelSpec(
        "gpt-m",
        d_model=1024,
        d_expert=4096,
        experts=16,
        top_k=1,
        moe_layers=24,
        tokens_per_device=8192,
    ),
    "gpt-l": ModelSpec(
        "gpt-l",
        d_model=1536,
        d_expert=6144,
        experts=16,
        top_k=1,
        moe_layers=24,
        tokens_per_device=8192,
    ),
    # A 256-expert, 8-layer model for the Zipf planner case.
    "zipf-256": ModelSpec(
        "zipf-256",
        d_model=2048,
        d_expert=1408,
        experts=256,
        top_k=8,
        moe_layers=8,
        dtype_bytes=2,
        tokens_per_device=8192,
        activation="swiglu",
    ),
    # The `tiny` training preset (2 CPU ranks).
    "tiny": ModelSpec(
        "tiny",
        d_model=128,
        d_expert=512,
        experts=8,
        top_k=2,
        moe_layers=4,
        dtype_bytes=4,
        tokens_per_device=2048,
    ),
}


def get_model(spec: str) -> ModelSpec:
    """A named model or a YAML/JSON path."""
    if spec in MODELS:
        return MODELS[spec]
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return ModelSpec.load(path)
    raise ConfigError(
        f"unknown model (known: {', '.join(MODELS)}) and no such file", source=spec, field="model"
    )
