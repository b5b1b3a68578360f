"""AdamW that steps only the expert rows a rank owns: its home slots.

Spare expert slots (`TrainConfig.spare_slots`) hold replicas, refreshed from their home by
Trans before they are read, or nothing; stepping them is work static EP does not do (with
`S = E/D + 1` slots, `S / (E/D)` times static's expert update, every step).

`HomeRowsAdamW` is `torch.optim.AdamW` (same state: `step`, `exp_avg`, `exp_avg_sq` shaped like
the parameter, so checkpoints and home migration are unchanged) whose step updates only the
first `n` rows of each stacked expert tensor, the home slots (`poise.nn.slots`: homes first).
Each row's update is AdamW's element-wise mathematics, so losses equal static EP's. Every
tensor's `step` advances every step on every rank (also with no home row), so bias corrections
stay identical when a home's moments migrate.

It runs PyTorch's fused AdamW kernel wherever it supports the parameters (`fused_supported`),
else the per-tensor loop, which on the CPU is slower still on rows with zero moments (`sqrt` of
zeros takes a slow path), charging idle experts optimizer time. Fused and loop agree to float
rounding; each matches `torch.optim.AdamW` with the same `fused` flag bit for bit.

Parameters may be `DTensor`s (the dense ones under FSDP2, `poise.nn.fsdp.shard_dense`) beside
plain tensors (the experts): the kernels run on each DTensor's local shard (its gradient's and
moments' shards too, the moments kept as DTensors like the parameter), so one fused call takes
both kinds, where `torch.optim.AdamW` refuses the mix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from poise.core.errors import PlanError
from poise.nn.fsdp import local_tensor
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
    """Per stacked expert parameter of `model` (by `id`), a function giving how many leading
    rows are this rank's home slots under the routing in force."""
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
    """`torch.optim.AdamW` stepping only the home rows of stacked expert tensors. `rows_of`:
    `id(param)` -> leading rows to step (`home_rows(model)`); other parameters step whole.
    `fused`: PyTorch's fused kernel (None: wherever `fused_supported`). AMSGrad, capturable,
    differentiable and maximize are refused (ValueError)."""

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
        supported = fused_supported(p for g in self.param_groups for p in g["params"])
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
                lp = local_tensor(p)  # a DTensor's shard (FSDP), else p
                n = lp.shape[0] if rows is None else rows()
                if n == 0 or lp.numel() == 0:
                    state["step"] += 1  # every rank's count advances alike
                    continue
                params.append(lp[:n])
                grads.append(local_tensor(p.grad)[:n])
                avgs.append(local_tensor(state["exp_avg"])[:n])
                sqs.append(local_tensor(state["exp_avg_sq"])[:n])
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
