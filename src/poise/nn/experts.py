"""Experts: the FFNs of one rank's expert slots, held as stacked weights.

Slot `i` holds `w_in[i] [D, H]`, `w_out[i] [H, D]` and, for SwiGLU, `w_gate[i] [D, H]`:

    GELU:    y = gelu(x @ w_in[i]) @ w_out[i]
    SwiGLU:  y = (silu(x @ w_gate[i]) * (x @ w_in[i])) @ w_out[i]

`forward(x [T, D], tokens_per_slot [S])` takes the rows grouped by slot in slot order (the first
`tokens_per_slot[0]` rows go to slot 0, ...). Every slot row of every parameter is independent:
the runtime moves rows between ranks and reads or writes `param.data[i]`, `param.grad[i]` and the
optimizer's state rows. Slots with zero tokens work forward and backward (their gradient rows
are zero).

Two implementations, same mathematics:

- `"grouped"`: `torch._grouped_mm` (one call per weight). It needs float32, bfloat16 or float16
  (bfloat16 only on CUDA) and row strides that are multiples of 16 bytes, i.e. `D` and `H`
  multiples of 4 (fp32) or 8 (16-bit); `grouped_mm_problem` says why it cannot run.
- `"loop"`: `torch.mm` per slot inside a hand-written autograd function that runs each slot's
  whole FFN in blocks of rows (`block_rows`: a `[rows, H]` activation of `BLOCK_BYTES`) while
  the block is still in cache, writing straight into preallocated outputs and gradients (no
  concatenation, no zero-filled gradient per slot).

`"auto"` (the default) picks `"grouped"` on CUDA where it can run and `"loop"` elsewhere: on the
CPU, torch's grouped GEMM is itself a loop of GEMMs over the whole `[T, H]` activation (fresh,
cache-cold memory every step), and the blocked loop measures faster (`benchmarks/moe_layer.py
--experts-impl grouped`, figures in docs/benchmarks.md).

Under `torch.compile` the loop runs as one custom op (`poise::slot_loop_ffn`, its backward
`poise::slot_loop_ffn_backward`) that reads the slot sizes inside, so the graph has no
data-dependent size; the grouped GEMM is traced for bfloat16 only (its fake kernel's limit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from poise.core.errors import ConfigError, PoiseError
from poise.nn.host import upload

Activation = Literal["swiglu", "gelu"]
ExpertsImpl = Literal["auto", "grouped", "loop"]
ACTIVATIONS: tuple[str, ...] = ("swiglu", "gelu")
IMPLS: tuple[str, ...] = ("auto", "grouped", "loop")


class ExpertsInputError(PoiseError):
    """Rows and `tokens_per_slot` that do not fit the experts."""


def grouped_mm_problem(
    dtype: torch.dtype, device: torch.device, d_model: int, d_expert: int
) -> str:
    """Why `torch._grouped_mm` cannot run these experts ("" when it can)."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    allowed = (torch.bfloat16,) if device.type == "cuda" else _GROUPED_CPU_DTYPES
    if dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        return f"torch._grouped_mm on {device.type} needs {names}, not {dtype}"
    size = torch.empty((), dtype=dtype).element_size()
    for name, n in (("d_model", d_model), ("d_expert", d_expert)):
        if (n * size) % 16:
            return (
                f"{name}={n} gives rows of {n * size} bytes; "
                "torch._grouped_mm needs a multiple of 16"
            )
    return ""


_GROUPED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Experts(nn.Module):
    """`num_slots` expert FFNs with weights stacked over slots.

    Parameters: `w_in [S, D, H]`, `w_gate [S, D, H]` (SwiGLU only; `None` for GELU),
    `w_out [S, H, D]`, with `D = d_model`, `H = d_expert`. `impl`: `"auto"`, `"grouped"` or
    `"loop"` (see the module docstring); it can be changed later through the attribute."""

    w_gate: nn.Parameter | None
    # Set by `apply_expert_parallel` on a group of several ranks: each rank's slots are its own
    # (never one tensor sharded or replicated over the ranks, as FSDP would take them).
    expert_parallel: bool = False

    def __init__(
        self,
        num_slots: int,
        d_model: int,
        d_expert: int,
        activation: Activation = "swiglu",
        *,
        impl: ExpertsImpl = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("num_slots", num_slots), ("d_model", d_model), ("d_expert", d_expert)):
            if int(value) < 1:
                raise ConfigError(f"must be >= 1, got {value}", field=f"experts.{name}")
        if activation not in ACTIVATIONS:
            raise ConfigError(
                f"must be one of {', '.join(ACTIVATIONS)}, got {activation!r}",
                field="experts.activation",
            )
        self.num_slots = int(num_slots)
        self.d_model = int(d_model)
        self.d_expert = int(d_expert)
        self.activation: Activation = activation
        self.impl = impl
        kw = {"device": device, "dtype": dtype}
        S, D, H = self.num_slots, self.d_model, self.d_expert
        self.w_in = nn.Parameter(torch.empty(S, D, H, **kw))
        self.w_gate = nn.Parameter(torch.empty(S, D, H, **kw)) if activation == "swiglu" else None
        self.w_out = nn.Parameter(torch.empty(S, H, D, **kw))
        self.reset_parameters()

    @property
    def impl(self) -> ExpertsImpl:
        return self._impl

    @impl.setter
    def impl(self, value: ExpertsImpl) -> None:
        if value not in IMPLS:
            raise ConfigError(
                f"must be one of {', '.join(IMPLS)}, got {value!r}", field="experts.impl"
            )
        self._impl: ExpertsImpl = value

    def weights(self) -> list[nn.Parameter]:
        """The stacked parameters in a fixed order: `w_in`, `w_gate` (SwiGLU), `w_out`."""
        return [w for w in (self.w_in, self.w_gate, self.w_out) if w is not None]

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Every slot drawn like `nn.Linear`: uniform in +-1/sqrt(fan_in)."""
        for slot in range(self.num_slots):
            self.init_slot(slot, generator)

    @torch.no_grad()
    def init_slot(self, slot: int, generator: torch.Generator | None = None) -> None:
        """Draw slot `slot`'s weights (on the CPU from `generator`, then copied over)."""
        for w in self.weights():
            fan_in = w.shape[1]
            bound = 1.0 / math.sqrt(fan_in)
            row = torch.empty(w.shape[1:], dtype=torch.float32)
            row.uniform_(-bound, bound, generator=generator)
            w[slot].copy_(row)

    def resolved_impl(self, x: torch.Tensor) -> Literal["grouped", "loop"]:
        """The implementation `forward` uses for input `x`; raises `ConfigError` when
        `"grouped"` is forced where it cannot run."""
        problem = grouped_mm_problem(x.dtype, x.device, self.d_model, self.d_expert)
        if not problem and torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
            # torch._grouped_mm's fake (meta) kernel takes bfloat16 only: under torch.compile
            # other dtypes run the per-slot loop (`slot_loop_ffn`).
            problem = f"torch._grouped_mm under torch.compile needs bfloat16, not {x.dtype}"
        if self.impl == "grouped":
            if problem:
                raise ConfigError(problem, field="experts.impl")
            return "grouped"
        if self.impl == "loop" or problem or x.device.type != "cuda":
            return "loop"
        return "grouped"

    def forward(
        self, x: torch.Tensor, tokens_per_slot: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """`x [T, D]` rows grouped by slot in slot order; `tokens_per_slot [S]` -> `[T, D]`.

        Raises `ConfigError` (field `fsdp`) where `fully_shard` manages expert-parallel weights
        (`poise.nn.fsdp`): FSDP marks every module whose parameters it manages."""
        if self.expert_parallel and getattr(self, "_is_fsdp_managed_module", False):
            raise fsdp_refusal()
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ExpertsInputError(
                f"expected [T, {self.d_model}] rows, got {tuple(x.shape)}", field="experts.x"
            )
        x = x.contiguous()
        w_in, w_gate, w_out = self.w_in, self.w_gate, self.w_out
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # Under autocast the GEMMs run in the autocast dtype, as nn.Linear's would: cast the
            # rows and the weights once (gradients flow back to the fp32 parameters) and run
            # the kernels with autocast off, so every buffer has one dtype.
            dtype = torch.get_autocast_dtype(device_type)
            with torch.autocast(device_type, enabled=False):
                x, w_in, w_out = x.to(dtype), w_in.to(dtype), w_out.to(dtype)
                w_gate = None if w_gate is None else w_gate.to(dtype)
                return self._run(x, tokens_per_slot, w_in, w_gate, w_out)
        return self._run(x, tokens_per_slot, w_in, w_gate, w_out)

    def _run(
        self,
        x: torch.Tensor,
        tokens_per_slot: torch.Tensor | Sequence[int],
        w_in: torch.Tensor,
        w_gate: torch.Tensor | None,
        w_out: torch.Tensor,
    ) -> torch.Tensor:
        impl = self.resolved_impl(x)
        if impl == "grouped" and x.shape[0] > 0:
            counts = (
                tokens_per_slot.to(x.device)
                if isinstance(tokens_per_slot, torch.Tensor)
                else upload(list(tokens_per_slot), x.device)  # host ints: no wait on CUDA
            )
            self._check_counts_shape(counts.shape[0])
            return _grouped_ffn(x, counts, w_in, w_gate, w_out)
        if torch.compiler.is_compiling():  # one opaque op: static shapes in the graph
            counts = (
                tokens_per_slot.to(x.device)
                if isinstance(tokens_per_slot, torch.Tensor)
                else torch.tensor(list(tokens_per_slot), dtype=torch.long, device=x.device)
            )
            self._check_counts_shape(counts.shape[0])
            return slot_loop_ffn(x, counts.long(), w_in, w_out, w_gate)[0]
        counts_list = _as_int_list(tokens_per_slot)
        self._check_counts(counts_list, x.shape[0])
        return _SlotLoopFFN.apply(x, counts_list, w_in, w_out, w_gate)

    def _check_counts_shape(self, n: int) -> None:
        if n != self.num_slots:
            raise ExpertsInputError(
                f"tokens_per_slot has {n} entries for {self.num_slots} slots",
                field="experts.tokens_per_slot",
            )

    def _check_counts(self, counts: list[int], rows: int) -> None:
        self._check_counts_shape(len(counts))
        if min(counts, default=0) < 0 or sum(counts) != rows:
            raise ExpertsInputError(
                f"tokens_per_slot {counts} must be >= 0 and sum to the {rows} rows",
                field="experts.tokens_per_slot",
            )

    def extra_repr(self) -> str:
        return (
            f"num_slots={self.num_slots}, d_model={self.d_model}, d_expert={self.d_expert}, "
            f"activation={self.activation!r}, impl={self.impl!r}"
        )


def _as_int_list(counts: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(counts, torch.Tensor):
        return [int(c) for c in counts.tolist()]
    return [int(c) for c in counts]


def fsdp_refusal() -> ConfigError:
    """The one error for `fully_shard` managing expert-parallel weights."""
    return ConfigError(
        "fully_shard manages this MoE layer's expert-parallel weights: every rank holds its own "
        "experts, which FSDP would shard as one tensor (a rank would compute with another "
        "rank's experts). Leave them out: poise.nn.shard_dense(model, mesh), or "
        "fully_shard(..., ignored_params=<every MoE layer's experts.weights()>)",
        field="fsdp",
    )


# ----------------------------------------------------------------------------- grouped GEMM
def _grouped_ffn(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_out: torch.Tensor,
) -> torch.Tensor:
    """The FFN with `torch._grouped_mm`; `counts [S]` on x's device (no host sync)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    if x.device.type != "cpu":
        # Some GPUs' grouped GEMM writes non-zero gradients for empty groups (pytorch #172439).
        nonempty = counts > 0
        w_in = _ZeroEmptySlotGrad.apply(w_in, nonempty)
        w_out = _ZeroEmptySlotGrad.apply(w_out, nonempty)
        if w_gate is not None:
            w_gate = _ZeroEmptySlotGrad.apply(w_gate, nonempty)
    h = torch._grouped_mm(x, w_in, offs=offs)
    a = F.gelu(h) if w_gate is None else F.silu(torch._grouped_mm(x, w_gate, offs=offs)) * h
    y = torch._grouped_mm(a, w_out, offs=offs)
    # _grouped_mm's backward refuses expanded gradients (e.g. from y.sum()).
    return _ContiguousGrad.apply(y)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _ZeroEmptySlotGrad(torch.autograd.Function):
    """Identity on `w [S, ...]` whose backward zeroes the gradient rows of empty slots."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, nonempty: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(nonempty)
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (nonempty,) = ctx.saved_tensors
        mask = nonempty.view(-1, *([1] * (grad.dim() - 1)))
        return torch.where(mask, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None


# ----------------------------------------------------------------------------- per-slot loop
def _slot_ranges(counts: list[int], max_rows: int) -> list[tuple[int, int, int]]:
    """`(slot, start, stop)` blocks of rows: each slot with rows cut into near-equal blocks of
    at most `max_rows` rows (in row order)."""
    out = []
    start = 0
    for slot, n in enumerate(counts):
        blocks = -(-n // max_rows)
        for b in range(blocks):
            lo, hi = start + n * b // blocks, start + n * (b + 1) // blocks
            out.append((slot, lo, hi))
        start += n
    return out


BLOCK_BYTES = 4 << 20  # one block's [rows, H] activation: well inside this CPU's L3 (32 MiB)


def block_rows(d_expert: int, dtype: torch.dtype) -> int:
    """Rows per block of the per-slot loop: `[rows, d_expert]` activations of `BLOCK_BYTES`."""
    size = torch.empty((), dtype=dtype).element_size()
    return max(16, BLOCK_BYTES // (d_expert * size))


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


class _SlotLoopFFN(torch.autograd.Function):
    """The FFN slot by slot: `x [T, D]`, `counts` (host ints), `w_in [S, D, H]`,
    `w_out [S, H, D]`, `w_gate [S, D, H] | None` -> `[T, D]`.

    Rows run in blocks (a slot's rows cut into blocks of at most `block_rows`): each block's
    GEMMs and activation run back to back while its `[rows, H]` activation is in cache. Saves
    what autograd would (`x`, pre-activations, activations), one tensor per block: buffers of a
    block's size are recycled by the allocator from step to step, where one `[T, H]` buffer
    would be fresh memory (page faults) every step. SwiGLU recomputes `silu(g)` in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        counts: list[int],
        w_in: torch.Tensor,
        w_out: torch.Tensor,
        w_gate: torch.Tensor | None,
    ) -> torch.Tensor:
        y = x.new_empty(x.shape)
        saved: list[torch.Tensor] = []
        blocks = _slot_ranges(counts, block_rows(w_in.shape[2], x.dtype))
        for slot, s, e in blocks:
            xs = x[s:e]
            h = torch.mm(xs, w_in[slot])
            if w_gate is None:
                a = F.gelu(h)
                saved += [h, a]
            else:
                g = torch.mm(xs, w_gate[slot])
                a = F.silu(g).mul_(h)
                saved += [h, a, g]
            torch.mm(a, w_out[slot], out=y[s:e])
        ctx.counts, ctx.blocks = counts, blocks
        ctx.save_for_backward(x, w_in, w_out, w_gate, *saved)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_in, w_out, w_gate, *saved = ctx.saved_tensors
        gx, gw_in, gw_out, gw_gate = _slot_loop_backward(
            gy, x, w_in, w_out, w_gate, saved, ctx.counts, ctx.blocks, ctx.needs_input_grad[0]
        )
        return gx, None, gw_in, gw_out, gw_gate


def _slot_loop_backward(
    gy: torch.Tensor,
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    w_gate: torch.Tensor | None,
    saved: Sequence[torch.Tensor],
    counts: list[int],
    blocks: list[tuple[int, int, int]],
    need_x: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-slot loop's backward: `gy [T, D]` and the forward's `saved` (per block: `h, a`
    for GELU, `h, a, g` for SwiGLU, each `[rows, H]`) -> `(gx [T, D] | None, gw_in, gw_out,
    gw_gate)`. Rows past the blocks (`sum(counts) < T`) get a zero `gx`."""
    per_slot = 2 if w_gate is None else 3
    gy = gy.contiguous()
    gx = torch.empty_like(x) if need_x else None
    if gx is not None and sum(counts) < x.shape[0]:
        gx[sum(counts) :].zero_()
    grads = [torch.empty_like(w_in), torch.empty_like(w_out)]
    if w_gate is not None:
        grads.append(torch.empty_like(w_gate))
    gw_in, gw_out = grads[0], grads[1]
    for slot, n in enumerate(counts):
        if n == 0:
            for gw in grads:
                gw[slot].zero_()
    first = {}
    for i, (slot, s, e) in enumerate(blocks):
        first.setdefault(slot, i)
        acc = first[slot] != i  # later blocks of a slot add to its weight gradients
        h, a, *rest = saved[i * per_slot : (i + 1) * per_slot]
        xs, gys = x[s:e], gy[s:e]
        _mm_into(gw_out[slot], a.t(), gys, acc)
        ga = torch.mm(gys, w_out[slot].t())  # d(activation) [n, H]
        if w_gate is None:
            gh = torch.ops.aten.gelu_backward(ga, h)
            _mm_into(gw_in[slot], xs.t(), gh, acc)
            if gx is not None:
                torch.mm(gh, w_in[slot].t(), out=gx[s:e])
            continue
        (g,) = rest
        gg = torch.ops.aten.silu_backward(ga * h, g)
        gh = ga.mul_(F.silu(g))
        _mm_into(gw_in[slot], xs.t(), gh, acc)
        _mm_into(grads[2][slot], xs.t(), gg, acc)
        if gx is not None:
            out = gx[s:e]
            torch.mm(gh, w_in[slot].t(), out=out)
            out.addmm_(gg, w_gate[slot].t())
    gw_gate = grads[2] if w_gate is not None else None
    return gx, gw_in, gw_out, gw_gate


# ----------------------------------------------------------------------------- compiled loop
# Under torch.compile the per-slot loop runs as one opaque custom op: its slot sizes are read
# from `counts` inside the op (eager code, a host read of `[S]` ints: free on the CPU, one wait
# on a GPU, where "auto" runs the grouped GEMM instead wherever it can), so the traced graph has
# static shapes and no data-dependent size (`.tolist()` would break the graph, and unbacked
# sizes need `capture_scalar_outputs`). Same kernels and blocks as `_SlotLoopFFN`, so the
# compiled layer computes what the eager one does. The saved activations are whole `[T, H]`
# buffers (a custom op's outputs have a fixed number), each block writing its rows.


def _op_counts(counts: torch.Tensor, rows: int) -> list[int]:
    values = [int(c) for c in counts.tolist()]
    if min(values, default=0) < 0 or sum(values) > rows:
        raise ExpertsInputError(
            f"tokens_per_slot {values} must be >= 0 and sum to at most the {rows} rows",
            field="experts.tokens_per_slot",
        )
    return values


@torch.library.custom_op("poise::slot_loop_ffn", mutates_args=())
def slot_loop_ffn(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    w_gate: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x [T, D]` rows by slot, `counts [S]` (int64; summing to at most T: rows past them are
    left out and give 0) -> `(y [T, D], h, a, g)` with the saved `[T, H]` activations
    (`g` empty `[0, H]` for GELU)."""
    values = _op_counts(counts, x.shape[0])
    T, H = x.shape[0], w_in.shape[2]
    h, a = x.new_empty(T, H), x.new_empty(T, H)
    g = x.new_empty(T if w_gate is not None else 0, H)
    y = x.new_empty(x.shape)
    y[sum(values) :].zero_()
    for slot, s, e in _slot_ranges(values, block_rows(H, x.dtype)):
        xs = x[s:e]
        torch.mm(xs, w_in[slot], out=h[s:e])
        if w_gate is None:
            a[s:e] = F.gelu(h[s:e])
        else:
            torch.mm(xs, w_gate[slot], out=g[s:e])
            torch.mul(F.silu(g[s:e]), h[s:e], out=a[s:e])
        torch.mm(a[s:e], w_out[slot], out=y[s:e])
    return y, h, a, g


@slot_loop_ffn.register_fake
def _(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    w_gate: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H = x.shape[0], w_in.shape[2]
    g = x.new_empty(T if w_gate is not None else 0, H)
    return x.new_empty(x.shape), x.new_empty(T, H), x.new_empty(T, H), g


@torch.library.custom_op("poise::slot_loop_ffn_backward", mutates_args=())
def slot_loop_ffn_backward(
    gy: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    w_gate: torch.Tensor | None,
    h: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`slot_loop_ffn`'s backward -> `(gx [T, D], gw_in, gw_out, gw_gate)` (`gw_gate` empty
    for GELU)."""
    values = _op_counts(counts, x.shape[0])
    blocks = _slot_ranges(values, block_rows(w_in.shape[2], x.dtype))
    saved: list[torch.Tensor] = []
    for _slot, s, e in blocks:
        saved += [h[s:e], a[s:e]] if w_gate is None else [h[s:e], a[s:e], g[s:e]]
    gx, gw_in, gw_out, gw_gate = _slot_loop_backward(
        gy, x, w_in, w_out, w_gate, saved, values, blocks, True
    )
    assert gx is not None
    return gx, gw_in, gw_out, gw_gate if gw_gate is not None else w_in.new_empty(0)


@slot_loop_ffn_backward.register_fake
def _(
    gy: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    w_gate: torch.Tensor | None,
    h: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gw_gate = torch.empty_like(w_gate) if w_gate is not None else w_in.new_empty(0)
    return torch.empty_like(x), torch.empty_like(w_in), torch.empty_like(w_out), gw_gate


def _slot_loop_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, counts, w_in, w_out, w_gate = inputs
    _y, h, a, g = output
    ctx.gelu = w_gate is None
    ctx.save_for_backward(x, counts, w_in, w_out, w_gate, h, a, g)


def _slot_loop_grad(
    ctx: Any, gy: torch.Tensor, *_saved_grads: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    x, counts, w_in, w_out, w_gate, h, a, g = ctx.saved_tensors
    gx, gw_in, gw_out, gw_gate = slot_loop_ffn_backward(
        gy.contiguous(), x, counts, w_in, w_out, None if ctx.gelu else w_gate, h, a, g
    )
    return gx, None, gw_in, gw_out, None if ctx.gelu else gw_gate


slot_loop_ffn.register_autograd(_slot_loop_grad, setup_context=_slot_loop_setup)


__all__ = [
    "ACTIVATIONS",
    "IMPLS",
    "Experts",
    "ExpertsInputError",
    "fsdp_refusal",
    "grouped_mm_problem",
]
