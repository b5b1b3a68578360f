"""`TrainConfig`: everything one training run needs, loaded from and saved to YAML.

    cfg = load_config("configs/tiny.yaml")             # unknown keys, wrong types and
    cfg = cfg.replace(policy="static", steps=100)      # impossible values: one ConfigError
    save_config(cfg, "poise-out/train/config.yaml")    # naming the file and the field

A YAML file holds any subset of the fields below (the rest keep their defaults); `model` is a
preset of `poise.models.gpt.MODEL_PRESETS` and `model_args` overrides its shapes
(`{d_model: 256, num_experts: 16}`). `batch` is the global batch in sequences (split evenly over
the ranks) of one micro-batch, `micro_batches` (default 1) the micro-batches whose gradients one
optimizer step sums (gradient accumulation), so a step trains on `batch * micro_batches`
sequences; `context` the sequence length (default: the preset's). `layout` (None: expert
parallelism over all ranks) is a SmartMoE layout such as `"ep=2"` or `"pp1-ep2-edp2"`
(`poise.train.layout`): EP groups of ep ranks, expert-data-parallel replicas. `fsdp` (default
false) shards the dense parameters with FSDP2 (`torch.distributed.fsdp.fully_shard`) over a
`DeviceMesh` ("dp", "ep") of the ranks instead of replicating them and summing their gradients
in Poise's all-reduce; the experts stay expert parallel and balanced (`poise.nn.fsdp`); the
losses are the same.

Balancing settings are the Balancer's, with its defaults (`poise.runtime.config.BalancerConfig`):
`plan_lag`, `predictor`, `probe_every`, `split_tokens`, `retarget`, `host_link`,
`separate_transfers`, `compression` (HybridEP's compressed migration; it changes the
mathematics), `balance_guard` (its `guard`) and `self_calibrate` (its `calibrate`); `cluster`
names the prior the Balancer plans on (None: this host's CPU ranks).

Instruments for benchmarks (`poise.train.instruments`): `free_balancing` (needs `balance_guard`
off) leaves the Balancer's transfers and planning out of each step's time, so the run measures
what its policy's balance is worth with free transfers; `turns` (None: off) is a counter file
shared with other runs on this host that take their steps in turns with this one, step k of run
`turns_slot` of `turns_of` right after step k of the runs before it (`poise.train.turns`); every
set of runs uses a fresh file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from poise.core.errors import ConfigError
from poise.core.fields import read_mapping_file, read_set_value
from poise.runtime.config import BalancerConfig
from poise.train.layout import check_layout_text, parse_layout
from poise.util.atomic import atomic_write_text

if TYPE_CHECKING:
    from poise.layouts.pool import Layout

_BALANCER = BalancerConfig()  # the balancing defaults, kept in one place
POLICIES = ("static", "shadow", "prophet", "vexpert", "permute", "eplb", "hybrid", "auto")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Groups: model, data, optimisation, MoE routing, balancing, run."""

    # model
    model: str = "tiny"
    model_args: dict[str, Any] = field(default_factory=dict)
    context: int | None = None
    # data
    data: str | None = None
    data_glob: str | None = None
    cache_dir: str | None = None
    val_fraction: float = 0.005
    # optimisation
    steps: int = 500
    batch: int = 16
    micro_batches: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    clip: float = 1.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # MoE routing
    aux_loss: float = 0.01
    z_loss: float = 0.0
    bias_rate: float = 0.0
    # balancing
    policy: str = "auto"
    replan_every: int = 10
    plan_lag: int = _BALANCER.plan_lag
    spare_slots: int = 1
    predictor: str = _BALANCER.predictor
    cluster: str | None = None
    compression: float | None = _BALANCER.compression
    split_tokens: bool = _BALANCER.split_tokens
    balance_guard: bool = _BALANCER.guard
    probe_every: int = _BALANCER.probe_every
    retarget: bool = _BALANCER.retarget
    host_link: bool = _BALANCER.host_link
    separate_transfers: bool = _BALANCER.separate_transfers
    self_calibrate: bool = _BALANCER.calibrate
    free_balancing: bool = False  # an instrument (`poise.train.instruments`)
    # parallelism
    layout: str | None = None
    fsdp: bool = False  # dense parameters sharded by FSDP2 (`poise.nn.fsdp`)
    # run
    seed: int = 0
    out: str = "poise-out/train"
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    record_trace: bool = True
    megatron_trace: bool = False  # also each rank's routing as Megatron-Core router traces
    tensorboard: bool = True
    progress: bool = True
    device: str = "auto"
    precision: str = "fp32"
    threads: int = 0
    experts_impl: str = "auto"
    overlap_degree: int = 1
    collective_timeout_s: float = 600.0
    turns: str | None = None  # a counter file shared with runs taking steps in turns
    turns_slot: int = 0
    turns_of: int = 2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = check_value(f.name, getattr(self, f.name), "TrainConfig")
            object.__setattr__(self, f.name, value)
        _check_combined(self, "TrainConfig")

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with `changes`, validated like a file (source "override")."""
        merged = {**self.to_dict(), **changes}
        return config_from_mapping(merged, source="override")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def model_config(self):
        """The `GPTConfig` of this run (preset, overrides, context)."""
        from poise.models.gpt import model_config

        overrides = dict(self.model_args)
        if self.context is not None:
            overrides["context"] = self.context
        return model_config(self.model, overrides, source="config")

    @property
    def balancing(self) -> bool:
        """Whether the policy can replicate or move experts (static cannot)."""
        return self.policy != "static"


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


# -------------------------------------------------------------------------------- schema
# kind, minimum, maximum, choices: one rule per field.
_INT, _NUM, _STR, _BOOL, _MAP = "integer", "number", "string", "boolean", "mapping"


@dataclass(frozen=True)
class _Rule:
    kind: str
    nullable: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low excluded
    high_open: bool = False
    choices: tuple[str, ...] | None = None


def _rules() -> dict[str, _Rule]:
    from poise.models.gpt import MODEL_PRESETS

    return {
        "model": _Rule(_STR, choices=tuple(MODEL_PRESETS)),
        "model_args": _Rule(_MAP),
        "context": _Rule(_INT, nullable=True, low=1),
        "data": _Rule(_STR, nullable=True),
        "data_glob": _Rule(_STR, nullable=True),
        "cache_dir": _Rule(_STR, nullable=True),
        "val_fraction": _Rule(_NUM, low=0, high=1, low_open=True, high_open=True),
        "steps": _Rule(_INT, low=1),
        "batch": _Rule(_INT, low=1),
        "micro_batches": _Rule(_INT, low=1),
        "lr": _Rule(_NUM, low=0, low_open=True),
        "min_lr_ratio": _Rule(_NUM, low=0, high=1),
        "warmup": _Rule(_INT, low=0),
        "clip": _Rule(_NUM, low=0),
        "weight_decay": _Rule(_NUM, low=0),
        "beta1": _Rule(_NUM, low=0, high=1, high_open=True),
        "beta2": _Rule(_NUM, low=0, high=1, high_open=True),
        "eps": _Rule(_NUM, low=0, low_open=True),
        "aux_loss": _Rule(_NUM, low=0),
        "z_loss": _Rule(_NUM, low=0),
        "bias_rate": _Rule(_NUM, low=0),
        "policy": _Rule(_STR, choices=POLICIES),
        "replan_every": _Rule(_INT, low=1),
        "plan_lag": _Rule(_INT, low=0),
        "spare_slots": _Rule(_INT, low=0),
        "predictor": _Rule(_STR),
        "cluster": _Rule(_STR, nullable=True),
        "compression": _Rule(_NUM, nullable=True, low=0, high=1, low_open=True),
        "split_tokens": _Rule(_BOOL),
        "balance_guard": _Rule(_BOOL),
        "probe_every": _Rule(_INT, low=0),
        "retarget": _Rule(_BOOL),
        "host_link": _Rule(_BOOL),
        "free_balancing": _Rule(_BOOL),
        "separate_transfers": _Rule(_BOOL),
        "self_calibrate": _Rule(_BOOL),
        "layout": _Rule(_STR, nullable=True),
        "fsdp": _Rule(_BOOL),
        "seed": _Rule(_INT, low=0),
        "out": _Rule(_STR),
        "checkpoint_every": _Rule(_INT, low=0),
        "keep_checkpoints": _Rule(_INT, low=1),
        "log_every": _Rule(_INT, low=1),
        "eval_every": _Rule(_INT, low=0),
        "eval_batches": _Rule(_INT, low=1),
        "record_trace": _Rule(_BOOL),
        "megatron_trace": _Rule(_BOOL),
        "tensorboard": _Rule(_BOOL),
        "progress": _Rule(_BOOL),
        "device": _Rule(_STR, choices=("auto", "cpu", "cuda")),
        "precision": _Rule(_STR, choices=("fp32", "bf16")),
        "threads": _Rule(_INT, low=0),
        "experts_impl": _Rule(_STR, choices=("auto", "grouped", "loop")),
        "overlap_degree": _Rule(_INT, low=1),
        "collective_timeout_s": _Rule(_NUM, low=0, low_open=True),
        "turns": _Rule(_STR, nullable=True),
        "turns_slot": _Rule(_INT, low=0),
        "turns_of": _Rule(_INT, low=2),
    }


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def check_value(name: str, value: Any, source: str) -> Any:
    """`value` for field `name` checked against its rule; returns it (ints as floats for number
    fields). Raises `ConfigError(source=source, field=name)`."""
    rules = _rules()
    if name not in rules:
        raise ConfigError(f"unknown field (known: {', '.join(rules)})", source=source, field=name)
    rule = rules[name]
    if value is None:
        if rule.nullable:
            return None
        raise ConfigError(f"must be {_a(rule.kind)}, got null", source=source, field=name)
    ok = {
        _INT: isinstance(value, int) and not isinstance(value, bool),
        _NUM: isinstance(value, (int, float)) and not isinstance(value, bool),
        _STR: isinstance(value, str),
        _BOOL: isinstance(value, bool),
        _MAP: isinstance(value, Mapping),
    }[rule.kind]
    if not ok:
        raise ConfigError(f"must be {_a(rule.kind)}, got {value!r}", source=source, field=name)
    if rule.kind == _NUM:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"must be finite, got {value!r}", source=source, field=name)
    if rule.kind in (_INT, _NUM):
        if rule.low is not None and (value <= rule.low if rule.low_open else value < rule.low):
            op = ">" if rule.low_open else ">="
            raise ConfigError(
                f"must be {op} {rule.low:g}, got {value!r}", source=source, field=name
            )
        if rule.high is not None and (value >= rule.high if rule.high_open else value > rule.high):
            op = "<" if rule.high_open else "<="
            raise ConfigError(
                f"must be {op} {rule.high:g}, got {value!r}", source=source, field=name
            )
    if rule.choices is not None and value not in rule.choices:
        raise ConfigError(
            f"must be one of {', '.join(rule.choices)}; got {value!r}", source=source, field=name
        )
    if rule.kind == _MAP:
        value = dict(value)
    return value


def config_from_mapping(m: Mapping[str, Any], source: str = "config") -> TrainConfig:
    """Build and validate a `TrainConfig` from a mapping (a parsed YAML file)."""
    values = {str(k): check_value(str(k), v, source) for k, v in m.items()}
    try:
        return TrainConfig(**values)
    except ConfigError as exc:  # a combined check: name the file, not the class
        raise ConfigError(exc.message, source=source, field=exc.field) from None


BYTE_VOCAB = 256  # token values of the byte-level data (`poise.train.data`)


def _check_combined(cfg: TrainConfig, source: str) -> None:
    """What single fields cannot say: the model shapes (preset, `model_args`, `context`), the
    predictor, and the parts of `layout` that do not depend on the world size (syntax, pp = 1,
    ep dividing the experts; `resolve_layout` checks the rest)."""
    from poise.models.gpt import model_config
    from poise.plan.predict import parse_predictor

    overrides = dict(cfg.model_args)
    if cfg.context is not None:
        overrides["context"] = cfg.context
    mcfg = model_config(cfg.model, overrides, source=source)
    if mcfg.vocab_size < BYTE_VOCAB:
        raise ConfigError(
            f"must be at least {BYTE_VOCAB}: the data is byte-level (token values 0-255), so a "
            f"smaller vocabulary fails at the first embedding lookup; got {mcfg.vocab_size}",
            source=source,
            field="model_args.vocab_size",
        )
    if cfg.layout is not None:
        check_layout_text(cfg.layout, mcfg.num_experts, mcfg.moe_layers, source)
    try:
        parse_predictor(cfg.predictor)
    except ConfigError as exc:
        raise ConfigError(exc.message, source=source, field="predictor") from None
    if cfg.turns_slot >= cfg.turns_of:
        raise ConfigError(
            f"must be below turns_of ({cfg.turns_of}), got {cfg.turns_slot}",
            source=source,
            field="turns_slot",
        )
    if cfg.plan_lag > cfg.replan_every:
        raise ConfigError(
            f"must be at most replan_every ({cfg.replan_every}), got {cfg.plan_lag}",
            source=source,
            field="plan_lag",
        )
    if cfg.probe_every == 1:
        raise ConfigError(
            "must be 0 (off) or >= 2: a probe step needs neighbours run with the replicas",
            source=source,
            field="probe_every",
        )
    if cfg.free_balancing and cfg.balance_guard:
        raise ConfigError(
            "needs balance_guard off: free balancing leaves the transfers unpaid, so the "
            "guard's prices would be wrong",
            source=source,
            field="free_balancing",
        )


def load_config(path: str | Path) -> TrainConfig:
    """Read a YAML (or JSON) config file; every error names the file and the field."""
    return config_from_mapping(read_mapping_file(path), source=str(path))


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write `cfg` as YAML (atomically): every field, so the file alone reproduces the run."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    atomic_write_text(path, text)


def parse_override(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` (VALUE read as YAML: `3`, `0.1`, `null`, `{d_model: 64}`) -> (key, value)."""
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError("expected KEY=VALUE", source=item, field="--set")
    return key, read_set_value(raw, item, "--set")


def resolve_layout(cfg: TrainConfig, world: int, source: str | None = None) -> Layout | None:
    """The `Layout` of `cfg.layout` on `world` ranks (None without one, after checking that the
    world fits the experts as plain expert parallelism needs). Raises one `ConfigError` naming
    `source` (default "config") and the field `layout` when the layout does not fit: ep must
    divide both the world and the number of experts, pp must be 1."""
    from poise.nn.moe import check_world

    mcfg = cfg.model_config()
    if cfg.layout is None:
        check_world(mcfg.num_experts, world)
        return None
    where = source or "config"
    check_layout_text(cfg.layout, mcfg.num_experts, mcfg.moe_layers, where)
    return parse_layout(cfg.layout, world, mcfg.num_experts, mcfg.moe_layers, where, world=world)


__all__ = [
    "POLICIES",
    "TrainConfig",
    "check_value",
    "config_from_mapping",
    "load_config",
    "parse_override",
    "resolve_layout",
    "save_config",
]
