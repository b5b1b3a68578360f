"""A differentiable `all_to_all_single` in two halves, so that work can run while the rows travel:
`start_all_to_all` launches the exchange, `wait_all_to_all` waits for it. Its backward is the
reverse exchange, launched by the wait's backward and awaited by the start's. The dispatcher
(`poise.nn.dispatch`) overlaps token chunks and expert compute with it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from poise.nn import comm


class _Pending:
    """The work handles of one asynchronous all-to-all and of its backward."""

    def __init__(self) -> None:
        self.work: dist.Work | None = None
        self.grad: torch.Tensor | None = None
        self.grad_work: dist.Work | None = None


class _AllToAllStart(torch.autograd.Function):
    """Launch `all_to_all_single` of `send [N, D]` asynchronously; returns the receive buffer
    (valid once `_AllToAllWait` ran). Backward waits for the reverse exchange that
    `_AllToAllWait.backward` launched and returns its result."""

    @staticmethod
    def forward(
        ctx: Any,
        send: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        pending: _Pending,
    ) -> torch.Tensor:
        send = send.contiguous()
        recv = send.new_empty(sum(out_splits), *send.shape[1:])
        pending.work = comm.all_to_all_single(
            recv, send, out_splits, in_splits, group=group, async_op=True
        )
        ctx.pending = pending
        return recv

    @staticmethod
    def backward(ctx: Any, _grad_recv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pending = ctx.pending
        pending.grad_work.wait()
        grad = pending.grad
        pending.grad = pending.grad_work = None
        return grad, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    """Wait for `_AllToAllStart`'s exchange; backward launches the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any,
        recv: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        pending: _Pending,
    ) -> torch.Tensor:
        pending.work.wait()
        pending.work = None
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        ctx.pending = pending
        return recv.view_as(recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        grad = grad.contiguous()
        pending = ctx.pending
        pending.grad = grad.new_empty(sum(in_splits), *grad.shape[1:])
        pending.grad_work = comm.all_to_all_single(
            pending.grad, grad, in_splits, out_splits, group=ctx.group, async_op=True
        )
        return grad, None, None, None, None


Started = tuple[torch.Tensor, tuple[list[int], list[int], Any, _Pending]]


def start_all_to_all(
    send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> Started:
    """Launch the exchange of `send [N, ...]` (`in_splits` rows to each rank, `out_splits` rows
    from each); `wait_all_to_all` on the result gives the received rows `[sum(out_splits), ...]`.
    Differentiable: the backward runs the reverse exchange, launched as soon as the received
    rows' gradient exists and awaited where `send`'s gradient is needed."""
    pending = _Pending()
    recv = _AllToAllStart.apply(send, out_splits, in_splits, group, pending)
    return recv, (out_splits, in_splits, group, pending)


def wait_all_to_all(started: Started) -> torch.Tensor:
    """The rows an exchange from `start_all_to_all` received, once it has landed."""
    recv, args = started
    return _AllToAllWait.apply(recv, *args)
