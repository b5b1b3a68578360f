"""AdamW that steps only the expert rows a rank owns: its home slots.

A balancing run gives each rank spare expert slots (`TrainConfig.spare_slots`) for replicas.
Replica rows are refreshed from their home by Trans before they are read, and empty rows are
never read, so an optimizer step over them is wasted work that static EP does not do: with
`S = E/D + 1` slots, `torch.optim.AdamW` over the stacked `[S, ...]` expert tensors costs
`S / (E/D)` times static's expert update, every step, whether the plan in force replicates
anything or not.

`HomeRowsAdamW` is `torch.optim.AdamW` (same state: `step`, `exp_avg`, `exp_avg_sq`, shaped
like the parameter, so checkpoints and home migration are unchanged) whose step updates, for
each stacked expert tensor, only its first `n` rows, the home slots (`poise.nn.slots`: homes
come first). Each row's update is AdamW's element-wise mathematics on that row, so losses equal
static EP's. The per-tensor `step` count advances every step on every rank (also where a rank
owns no row of a layer), so bias corrections stay identical when a home's moments migrate.

The step runs PyTorch's fused AdamW kernel wherever it supports the parameters (`fused=None`,
the default: every parameter a float tensor on a device with the kernel, CPU and CUDA among
them), else the per-tensor loop (`fused=False` forces it). On the CPU the loop is about 4 times
slower, and slower still on rows whose moments are zero (an expert no token has reached yet,
under a skewed router): `sqrt` of zeros takes a slow path there, so the loop charges static
EP's idle experts optimizer time that balancing cannot win back (`benchmarks/adamw_kernels.py`,
28 M parameters on one thread: the loop 156 ms with no idle slot and 249 with 13 of 18, the
fused kernel 40-43 either way). Fused and loop agree to float rounding, not bit for bit; each
matches `torch.optim.AdamW` with the same `fused` flag bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from poise.core.errors import PlanError
from poise.nn.moe import find_moe_layers

RowsOf = Callable[[], int]
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Whether PyTorch's fused AdamW kernel takes every tensor of `params`: floating point
    (`FUSED_DTYPES`) on a device type that has the kernel (CPU and CUDA among them)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    return all(p.dtype in FUSED_DTYPES and p.device.type in devices for p in params)


def home_rows(model: nn.Module) -> dict[int, RowsOf]:
    """For each stacked expert parameter of `model` (by `id`), a function giving how many of
    its leading rows are this rank's home slots now (read from the layer's routing in force)."""
    out: dict[int, RowsOf] = {}
    for moe in find_moe_layers(model):

        def rows(moe: Any = moe) -> int:
            home = moe.routing.slots.home
            n = int(home.sum())
            if not bool(home[:n].all()):
                raise PlanError("home slots are not the leading slots", field="placement.slots")
            return n

        for w in moe.experts.weights():
            if w.shape[0] == moe.num_slots:
                out[id(w)] = rows
    return out


class HomeRowsAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` stepping only the home rows of stacked expert tensors.

    `rows_of` maps `id(param)` to a function giving the number of leading rows to step (from
    `home_rows(model)`); other parameters are stepped whole. `fused`: PyTorch's fused kernel
    (None: wherever `fused_supported`; module docstring). AMSGrad, capturable, differentiable
    and maximize modes are not supported (ValueError)."""

    def __init__(
        self,
        params: Iterable[Any],
        rows_of: dict[int, RowsOf] | None = None,
        fused: bool | None = None,
        **kwargs: Any,
    ) -> None:
        for flag in ("amsgrad", "capturable", "differentiable", "maximize"):
            if kwargs.get(flag):
                raise ValueError(f"HomeRowsAdamW does not support {flag}=True")
        if fused and kwargs.get("foreach"):
            raise ValueError("HomeRowsAdamW takes fused or foreach, not both")
        super().__init__(params, **kwargs)  # torch's checks of fused=True would not apply here
        self.rows_of = dict(rows_of or {})
        every = [p for g in self.param_groups for p in g["params"]]
        supported = fused_supported(every)
        if fused and not supported:
            raise ValueError(
                "fused=True needs float parameters on a device with PyTorch's fused AdamW kernel"
            )
        self.fused = supported and not kwargs.get("foreach") if fused is None else fused

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if self.fused and state["step"].device != p.device:  # the kernel reads it on p's device
            state["step"] = state["step"].to(p.device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("HomeRowsAdamW does not support sparse gradients")
                state = self._state(p)
                rows = self.rows_of.get(id(p))
                n = p.shape[0] if rows is None else rows()
                if n == 0:
                    state["step"] += 1  # every rank's count advances alike
                    continue
                params.append(p[:n])
                grads.append(p.grad[:n])
                avgs.append(state["exp_avg"][:n])
                sqs.append(state["exp_avg_sq"][:n])
                steps.append(state["step"])
            if not params:
                continue
            adamw(
                params,
                grads,
                avgs,
                sqs,
                [],
                steps,
                foreach=None if self.fused else group["foreach"],
                fused=self.fused,
                amsgrad=False,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
        return loss
