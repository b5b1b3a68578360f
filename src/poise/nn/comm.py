"""Where the buffers of a collective live, for every module that runs one (nn, runtime, train).

buf = flat.to(comm_device(group, flat.device))
dist.all_reduce(buf, group=group)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def comm_device(group: Any, like_device: torch.device | str) -> torch.device:
    """The device for tensors of a collective over `group` (None: the default group): under
    NCCL `like_device` when it is a CUDA device, else the current CUDA device; under any other
    backend (gloo), or without an initialised process group, the CPU."""
    like = torch.device(like_device)
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["comm_device"]
