"""The MoE forward's two crossings of the host boundary, each through one function.

- `read_sizes(t)`: device -> host, a wait for the device. Under expert parallelism the layer's
  forward calls it once (the routes and received counts that size the token all-to-all: its
  split sizes are host ints in `torch.distributed`'s API); every index is then built on the
  device from the same numbers, so nothing else reads back (`tests/test_nn_host_waits.py`
  counts it on 2 gloo ranks; `benchmarks/cuda_syncs.py --ep` on a GPU).
- `upload(array, device)`: host -> device without a wait: on CUDA from pinned memory with
  `non_blocking=True` (a pageable copy would make the host wait for the stream); on the CPU the
  array's own memory.
"""

from __future__ import annotations

import numpy as np
import torch


def read_sizes(t: torch.Tensor) -> np.ndarray:
    """`t` (int64, any shape, small) on the host as a NumPy array: the forward's one host wait.
    The result may share `t`'s memory on the CPU: do not write to either."""
    return t.detach().cpu().numpy()


def upload(array: np.ndarray | list[int], device: torch.device | str) -> torch.Tensor:
    """`array` (its dtype; int64 for a list) as a tensor on `device`, copied without making the
    host wait (pinned memory and a non-blocking copy on CUDA)."""
    values = np.asarray(array, dtype=np.int64) if isinstance(array, list) else array
    host = torch.from_numpy(np.ascontiguousarray(values))
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


__all__ = ["read_sizes", "upload"]
