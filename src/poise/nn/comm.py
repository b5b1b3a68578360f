"""The one door to `torch.distributed`'s collectives: every collective Poise runs (nn, runtime,
train, calibrate) is called through here, so every tensor reaches the backend on the device the
backend takes (`tests/test_collectives_one_door.py` fails on a direct call anywhere else).

    from poise.nn import comm
    comm.all_reduce(flags, group=group)     # a CPU tensor under NCCL goes by the GPU and back
    comm.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)

Where a collective's tensors live: `comm_device(group, like)`: under NCCL the CUDA device (the
tensor's own, else the current one); under gloo, or with no process group, the CPU. The wrappers
take one of two policies, named in each docstring:

- staged (cold paths: configuration checks, flags, the step's loads, gradients, barriers): a
  tensor on another device than the group's is copied there, the collective runs, and the
  result is copied back into the caller's tensor. A copy costs one host wait on a GPU, so these
  are the calls made once a step or once a run, where a CUDA-only `torch.distributed` would make
  every caller repeat the same `.to(device)` dance (and one forgotten, as in `train.setup`'s
  all-gather of a CPU tensor, stops `torchrun` on NCCL: "No backend type associated with device
  type cpu").
- on the device (hot paths: `all_to_all_single`, the token and weight exchanges of every layer's
  forward and backward): the tensors must already be on the group's device; a CPU tensor under
  NCCL raises `CommDeviceError` instead of being copied, since a silent copy there would put a
  blocking host copy in every layer's forward, which is what the dispatcher is built to avoid.

Under gloo with CPU tensors (every test and CPU run) each wrapper calls `torch.distributed` with
the same arguments as before: the behaviour on gloo is unchanged. Point-to-point calls
(send/recv) are not wrapped: no Poise module uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from poise.core.errors import PoiseError

ReduceOp = dist.ReduceOp


class CommDeviceError(PoiseError):
    """A hot-path collective got a tensor on a device its group's backend cannot take."""


# ----------------------------------------------------------------------------- where
def serves(backend: str, device_type: str) -> bool:
    """Whether a group of `backend` takes tensors of `device_type` in its collectives. A plain
    backend: NCCL takes CUDA tensors only, any other (gloo, MPI) is used with CPU tensors (gloo
    takes CUDA tensors in a few collectives, through the host: Poise hands it CPU ones). A mixed
    backend as `dist.get_backend` gives it (`"cpu:gloo,cuda:nccl"`): the device types it
    names."""
    if ":" not in backend:
        return device_type == ("cuda" if backend == "nccl" else "cpu")
    return device_type in {p.split(":", 1)[0] for p in backend.split(",") if ":" in p}


def comm_device_for(
    backend: str | None, like_device: torch.device | str, current_cuda: int | None
) -> torch.device:
    """The device for the tensors of a collective on a group of `backend` (None: no process
    group), for a tensor on `like_device`, with `current_cuda` the current CUDA device index
    (None: no CUDA). The pure decision behind `comm_device`:

    - a backend that takes `like_device`'s type (`serves`: a CUDA tensor under NCCL, a CPU
      tensor under gloo, either under a mixed `cpu:gloo,cuda:nccl` group): `like_device`;
    - a backend that takes CUDA tensors only (NCCL) and a tensor elsewhere: the current CUDA
      device; `CommDeviceError` without one;
    - any other backend, or no process group: the CPU."""
    like = torch.device(like_device)
    if backend is None:
        return torch.device("cpu")
    if serves(backend, like.type):
        return like
    if serves(backend, "cuda") and not serves(backend, "cpu"):
        if current_cuda is None:
            raise CommDeviceError(
                f"a {backend} group takes CUDA tensors, and this process has no CUDA device"
            )
        return torch.device("cuda", current_cuda)
    return torch.device("cpu")


def group_backend(group: Any = None) -> str | None:
    """`dist.get_backend(group)` (None: the default group); None without an initialised
    process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend(group))


def comm_device(group: Any, like_device: torch.device | str) -> torch.device:
    """The device for tensors of a collective over `group` (None: the default group): under
    NCCL `like_device` when it is a CUDA device, else the current CUDA device; under any other
    backend (gloo), or without an initialised process group, the CPU (`comm_device_for`)."""
    backend = group_backend(group)
    current = None
    if backend is not None and serves(backend, "cuda") and torch.cuda.is_available():
        current = torch.cuda.current_device()
    return comm_device_for(backend, like_device, current)


def _stage(t: torch.Tensor, group: Any) -> torch.Tensor:
    """`t` itself when it is on `group`'s device, else a copy there."""
    dev = comm_device(group, t.device)
    return t if _same_device(t.device, dev) else t.to(dev)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def _copy_back(dst: torch.Tensor, buf: torch.Tensor) -> None:
    if buf is not dst:
        dst.copy_(buf)


class _StagedWork:
    """The work handle of an asynchronous staged collective: `wait()` waits for the collective
    and then copies its result back into the caller's tensor."""

    def __init__(self, work: Any, dst: torch.Tensor, buf: torch.Tensor) -> None:
        self._work, self._dst, self._buf = work, dst, buf

    def wait(self, timeout: Any = None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if self._buf is not None:
            _copy_back(self._dst, self._buf)
            self._buf = None
        return bool(done) if done is not None else True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


def refuses(backend: str, device_type: str) -> bool:
    """Whether a hot-path collective on a group of `backend` refuses a `device_type` tensor:
    only a CUDA-only backend (NCCL) refuses, a tensor off CUDA; gloo takes what it took before."""
    return not serves(backend, device_type) and not serves(backend, "cpu")


def _check_on_device(tensors: Sequence[torch.Tensor], group: Any, what: str) -> None:
    """`CommDeviceError` when `group`'s backend `refuses` a tensor's device (a CPU tensor under
    NCCL); no copy is made (hot path)."""
    backend = group_backend(group)
    if backend is None:
        return
    for t in tensors:
        if refuses(backend, t.device.type):
            raise CommDeviceError(
                f"{what}: a {t.device.type} tensor on a {backend} group; put it on "
                f"comm_device(group, ...) first (the hot path copies nothing itself)"
            )


# ----------------------------------------------------------------------------- staged
def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """`tensor` (any shape) reduced in place over `group` with `op` (staged: a tensor off the
    group's device goes there and back; with `async_op` the copy back happens in `wait()`).
    Returns the work handle with `async_op`, else None."""
    buf = _stage(tensor, group)
    work = dist.all_reduce(buf, op=op, group=group, async_op=async_op)
    if async_op:
        return _StagedWork(work, tensor, buf) if buf is not tensor else work
    _copy_back(tensor, buf)
    return None


def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """`tensor` (any shape) overwritten with global rank `src`'s (staged)."""
    buf = _stage(tensor, group)
    dist.broadcast(buf, src=src, group=group)
    _copy_back(tensor, buf)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    """`tensor_list[i]` (each shaped as `tensor`) filled with rank i's `tensor` (staged: the
    input and the outputs go by the group's device)."""
    buf = _stage(tensor, group)
    outs = [_stage(t, group) for t in tensor_list]
    dist.all_gather(outs, buf, group=group)
    for dst, got in zip(tensor_list, outs, strict=True):
        _copy_back(dst, got)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
    """`output [world * n]` = every rank's `input [n]` in rank order (`dist.all_gather_single`,
    the former `all_gather_into_tensor`; staged)."""
    out, inp = _stage(output, group), _stage(input, group)
    dist.all_gather_single(out, inp, group=group)
    _copy_back(output, out)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None
) -> None:
    """`output [n]`: this rank's block of `input [world * n]` reduced over `group` with `op`
    (`dist.reduce_scatter_single`; staged)."""
    out, inp = _stage(output, group), _stage(input, group)
    dist.reduce_scatter_single(out, inp, op=op, group=group)
    _copy_back(output, out)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
) -> None:
    """`output` = `input_list[rank]` reduced over `group` with `op` (staged)."""
    out = _stage(output, group)
    dist.reduce_scatter(out, [_stage(t, group) for t in input_list], op=op, group=group)
    _copy_back(output, out)


def barrier(group: Any = None) -> None:
    """Wait for every rank of `group`. Under NCCL on the current CUDA device (named, so that
    NCCL does not guess a device per rank)."""
    backend = group_backend(group)
    cuda_only = backend is not None and serves(backend, "cuda") and not serves(backend, "cpu")
    if cuda_only and torch.cuda.is_available():
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        return
    dist.barrier(group=group)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """`object_list[i]` = rank i's picklable `obj` (torch pickles through the group's device:
    the current CUDA device under NCCL)."""
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None) -> None:
    """`object_list` overwritten with global rank `src`'s picklable objects, pickled through
    `comm_device(group, "cpu")`."""
    dist.broadcast_object_list(object_list, src=src, group=group, device=comm_device(group, "cpu"))


# ----------------------------------------------------------------------------- on the device
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """`input [N, ...]` cut into `input_split_sizes` rows per rank (None: equal parts), sent;
    `output [sum(output_split_sizes), ...]` receives `output_split_sizes[i]` rows from rank i.
    On the device: both tensors must be on the group's device (`CommDeviceError` for a CPU
    tensor under NCCL; nothing is copied). The split sizes are host ints: reading them is the
    caller's one host wait. Returns the work handle with `async_op`, else None."""
    _check_on_device((output, input), group, "all_to_all_single")
    return dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def all_to_all_single_traced(
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: Any = None,
) -> torch.Tensor:
    """`input [N, ...]` cut into `input_split_sizes` rows per rank and exchanged -> the received
    rows `[sum(output_split_sizes), ...]`, as a functional collective that `torch.compile`
    traces (`torch.distributed._functional_collectives.all_to_all_single_autograd`:
    differentiable, its backward the reverse exchange; the wait is placed by the compiler, or
    by the first use in eager). On the device, as `all_to_all_single`; the device check runs
    outside a trace only (it asks the group's backend, which a traced graph cannot)."""
    if not torch.compiler.is_compiling():
        _check_on_device((input,), group, "all_to_all_single_traced")
    pg = group if group is not None else dist.group.WORLD
    return funcol.all_to_all_single_autograd(
        input.contiguous(), output_split_sizes, input_split_sizes, pg
    )


__all__ = [
    "CommDeviceError",
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "all_to_all_single_traced",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "comm_device",
    "comm_device_for",
    "group_backend",
    "reduce_scatter",
    "reduce_scatter_single",
    "refuses",
    "serves",
]
