"""What a calibration measures (sizes, repeats) and its errors."""

from __future__ import annotations

from dataclasses import dataclass, replace

from poise.core.errors import ConfigError, PoiseError

KIB = 1024
MIB = 1024 * KIB

WORLD_SIZE = 2
MAX_CALLS = 1000  # timed calls per measured point, at most
DIST_TIMEOUT_S = 120.0  # the gloo ranks must finish within this (warm-up and spawn included)

FULL_ROWS = (8, 32, 128, 512, 2048)
QUICK_ROWS = (8, 64, 512)
FULL_MESSAGE_BYTES = tuple(4 * KIB * 4**i for i in range(7))  # 4 KiB .. 16 MiB
QUICK_MESSAGE_BYTES = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB)  # growth clear of 4 ms stalls
# host costs (`poise.calibrate.host`): tokens of the non-MoE block, tokens per rank through the
# dispatcher, parameters through the optimizer and the clipping
FULL_DENSE_TOKENS = (128, 512, 2048)
QUICK_DENSE_TOKENS = (64, 256)
FULL_DISPATCH_TOKENS = (128, 512, 2048)
QUICK_DISPATCH_TOKENS = (64, 256)
FULL_SLOT_COUNTS = (1, 2, 4)
QUICK_SLOT_COUNTS = (1, 2)


class CalibrationError(PoiseError):
    """Measurements that cannot be fitted, or ranks that did not finish."""


# --------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class CalibrationConfig:
    """What to measure. `rows`: token counts n of the expert GEMMs; `message_bytes`: sizes of
    the collectives (bytes each rank sends for the all-to-all, buffer bytes for the all-reduce).
    Each point is the median of at least `gemm_repeats` / `comm_repeats` timed calls, and of
    enough calls to last `min_time_s`, after `warmup` untimed calls. `threads`: torch intra-op
    threads for the GEMMs and the host costs measured in this process (None: torch's default).

    Host costs (`host=True`; `poise.calibrate.host`): the non-MoE block of the GPT-MoE preset
    `model` (None: `tiny`; its heads, context, vocabulary, experts, top-k, layers; widths
    d_model and d_expert from here) at `dense_tokens` tokens, the token dispatcher on the gloo
    ranks at `dispatch_tokens` tokens per rank, AdamW and the gradient clipping over a rank's
    parameters with each of `slot_counts` expert slots, the model's experts at `rows` rows and
    an all-reduce after compute. Invalid values raise `ConfigError`."""

    d_model: int = 1024
    d_expert: int = 2048
    rows: tuple[int, ...] = FULL_ROWS
    message_bytes: tuple[int, ...] = FULL_MESSAGE_BYTES
    gemm_repeats: int = 5
    comm_repeats: int = 10
    warmup: int = 2
    min_time_s: float = 0.2
    threads: int | None = None
    host: bool = True
    model: str | None = None
    dense_tokens: tuple[int, ...] = FULL_DENSE_TOKENS
    dispatch_tokens: tuple[int, ...] = FULL_DISPATCH_TOKENS
    slot_counts: tuple[int, ...] = FULL_SLOT_COUNTS

    def __post_init__(self) -> None:
        for name in ("d_model", "d_expert", "gemm_repeats", "comm_repeats"):
            _check_positive(getattr(self, name), name)
        if self.warmup < 0:
            raise ConfigError(
                f"must be >= 0, got {self.warmup}", source="calibrate", field="warmup"
            )
        if not 0 <= self.min_time_s <= 60:
            raise ConfigError(
                f"must be in [0, 60], got {self.min_time_s}", source="calibrate", field="min_time_s"
            )
        if self.threads is not None:
            _check_positive(self.threads, "threads")
        for name in ("rows", "message_bytes", "dense_tokens", "dispatch_tokens", "slot_counts"):
            values = getattr(self, name)
            if len(set(values)) < 2:
                raise ConfigError(
                    f"need at least 2 distinct sizes, got {list(values)}",
                    source="calibrate",
                    field=name,
                )
            for v in values:
                _check_positive(v, name)
            if name == "message_bytes" and any(v % 4 for v in values):
                raise ConfigError(
                    "message sizes must be multiples of 4 bytes (float32)",
                    source="calibrate",
                    field=name,
                )

    @classmethod
    def preset(
        cls,
        *,
        quick: bool,
        d_model: int | None = None,
        d_expert: int | None = None,
        threads: int | None = None,
        model: str | None = None,
        host: bool = True,
    ) -> CalibrationConfig:
        """The full or `quick` sizes, with explicit widths and threads taking precedence.
        `model`: a GPT-MoE preset (`poise.models.gpt.MODEL_PRESETS`) whose shapes the host
        costs are measured at; its widths become the defaults of `d_model` and `d_expert`, and
        its own experts give the cluster's GEMM curve (`poise.calibrate.host`, item 4)."""
        if quick:
            base = cls(
                d_model=256,
                d_expert=512,
                rows=QUICK_ROWS,
                message_bytes=QUICK_MESSAGE_BYTES,
                gemm_repeats=3,
                comm_repeats=5,
                warmup=1,
                min_time_s=0.03,
                dense_tokens=QUICK_DENSE_TOKENS,
                dispatch_tokens=QUICK_DISPATCH_TOKENS,
                slot_counts=QUICK_SLOT_COUNTS,
            )
        else:
            base = cls()
        if model is not None:
            widths = model_widths(model)
            d_model = widths[0] if d_model is None else d_model
            d_expert = widths[1] if d_expert is None else d_expert
        return replace(
            base,
            d_model=base.d_model if d_model is None else d_model,
            d_expert=base.d_expert if d_expert is None else d_expert,
            threads=threads,
            model=model,
            host=host,
        )

    def gemm_bytes(self) -> int:
        """float32 bytes the GEMM benchmark holds at its largest row count: weights and their
        gradients (4 d_model d_expert) and activations (x, y, dY, dX: 4 n d_model; h, a, gelu'(h),
        dA, dH: 5 n d_expert)."""
        n = max(self.rows)
        return 4 * (4 * self.d_model * self.d_expert + n * (4 * self.d_model + 5 * self.d_expert))


def model_widths(model: str) -> tuple[int, int]:
    """`(d_model, d_expert)` of a GPT-MoE preset; `ConfigError` naming `--model` if unknown."""
    from poise.models.gpt import MODEL_PRESETS

    if model not in MODEL_PRESETS:
        raise ConfigError(
            f"unknown model preset (known: {', '.join(MODEL_PRESETS)})",
            source=model,
            field="--model",
        )
    cfg = MODEL_PRESETS[model]
    return cfg.d_model, cfg.d_expert


def _check_positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"must be a positive integer, got {value!r}", source="calibrate", field=name
        )
