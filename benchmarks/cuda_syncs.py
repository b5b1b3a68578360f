"""Host synchronisations in one MoE layer's forward and backward on CUDA, and where they are.

    python3 benchmarks/cuda_syncs.py                 # needs a CUDA device; a few seconds
    python3 benchmarks/cuda_syncs.py --ep            # the expert-parallel path, on one GPU
    torchrun --nproc-per-node 8 benchmarks/cuda_syncs.py --ep   # EP over 8 GPUs (NCCL)

`poise.nn.MoE` in bf16, with `torch.cuda.set_sync_debug_mode("warn")`: every call that makes
the host wait for the GPU (`.item()`, `.cpu()`, a blocking copy, a kernel whose output size
depends on the data) warns, and the script records the innermost `poise` source line of each.
Three layers: dropless, with a capacity factor (drops), and with DeepSeek-V3's bias
(`expert_bias`). Warm-up calls come first (the first call's lazy initialisation is not the
forward's cost). One JSON line per layer: `forward_syncs` and `backward_syncs`, counts per
source line.

Without `--ep` the layer runs on one device (no process group: the dispatcher's local path).
With `--ep` it runs expert parallel over an NCCL group: under `torchrun` (WORLD_SIZE set) over
every rank, one GPU each (`LOCAL_RANK`), rank 0 printing; alone, over a one-rank NCCL group on
this GPU, with the dispatcher held on its expert-parallel path (NCCL takes one rank per GPU, and
a one-rank group would otherwise take the local path): the same code, counts exchange and
all-to-alls on NCCL, with one peer. The target is one wait per layer forward (the read of the
all-to-all's sizes, `poise.nn.host.read_sizes`) and none in backward; `tests/test_nn_host_waits.py`
counts the same on 2 gloo CPU ranks. Without CUDA it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from poise.nn import MoE, MoEConfig, apply_expert_parallel
from poise.nn.dispatch import Dispatcher

LAYERS: dict[str, dict[str, Any]] = {
    "dropless": {},
    "capacity": {"capacity_factor": 1.25},
    "bias": {"expert_bias": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-expert", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--ep", action="store_true", help="expert parallel over an NCCL group")
    p.add_argument("--overlap", type=int, default=1, help="the layer's overlap_degree (EP)")
    return p.parse_args(argv)


class EPOnOneRank(Dispatcher):
    """The dispatcher held on its expert-parallel path with a one-rank group (a one-GPU
    machine): counts exchange, host read, device indices and NCCL all-to-alls, one peer."""

    def __call__(  # type: ignore[no-untyped-def]
        self, x, experts, weights, keep, routing, expert_fn, nonfinite=False, slot_of=None
    ):
        self.seconds = {}  # slot_of: the one-process path's; unused here
        return self._distributed(x, experts, weights, keep, routing, expert_fn, nonfinite)


def init_ep() -> tuple[torch.device, int, int]:
    """Join the NCCL group (torchrun's, or a one-rank one on this GPU); (device, rank, world)."""
    import torch.distributed as dist

    from poise.runtime.launch import free_port

    if "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        torch.cuda.set_device(0)
        url = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(
            "nccl", init_method=url, rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
    return torch.device("cuda", torch.cuda.current_device()), dist.get_rank(), dist.get_world_size()


def make_layer(args: argparse.Namespace, name: str, device: torch.device) -> MoE:
    """The layer `name` of `LAYERS`, on `device`, expert parallel over the world with `--ep`."""
    cfg = MoEConfig(
        d_model=args.d_model,
        d_expert=args.d_expert,
        num_experts=args.experts,
        top_k=args.top_k,
        overlap_degree=args.overlap,
        **LAYERS[name],
    )
    torch.manual_seed(0)
    moe = MoE(cfg, device=device, dtype=torch.bfloat16)
    if args.ep:
        import torch.distributed as dist

        apply_expert_parallel(moe, dist.group.WORLD)
        if moe.world == 1:
            moe.dispatcher = EPOnOneRank(cfg.num_experts, cfg.top_k, dist.group.WORLD,
                                         cfg.overlap_degree)  # fmt: skip
    return moe


def sync_sites(fn: Any) -> Counter[str]:
    """Run `fn()` with CUDA's sync debug mode on warn; count the warnings by the innermost
    `poise` frame (file:line, function) on the stack when each was raised."""
    sites: Counter[str] = Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, *a: Any, **k: Any) -> None:
        frames = [f for f in traceback.extract_stack() if "/poise/" in f.filename]
        where = frames[-1] if frames else None
        name = f"{Path(where.filename).name}:{where.lineno} {where.name}" if where else filename
        sites[name] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sites


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "cuda_syncs", "skipped": "no CUDA device on this machine"}))
        return 0
    device, rank, world = init_ep() if args.ep else (torch.device("cuda"), 0, 1)
    try:
        for name in args.layers:
            row = measure(args, name, device)
            if rank == 0:
                row.update({"mode": "ep" if args.ep else "one device", "world": world})
                print(json.dumps(row), flush=True)
    finally:
        if args.ep:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def measure(args: argparse.Namespace, name: str, device: torch.device) -> dict[str, Any]:
    """One layer's forward and backward host waits, by source line."""
    moe = make_layer(args, name, device)
    x = torch.randn(args.tokens, args.d_model, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    for _ in range(2):  # warm-up: lazy initialisation, autotuning
        moe(x).float().sum().backward()
    torch.cuda.synchronize()
    out: dict[str, Any] = {}

    def forward(out: dict[str, Any] = out, moe: MoE = moe, x: torch.Tensor = x) -> None:
        out["y"] = moe(x)
        out["loss"] = out["y"].float().sum() + moe.last_forward.aux_loss

    fwd = sync_sites(forward)
    bwd = sync_sites(lambda out=out: out["loss"].backward())
    torch.cuda.synchronize()
    return {
        "bench": "cuda_syncs",
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "layer": name,
        "impl": moe.experts.resolved_impl(x),
        "forward_waits": sum(fwd.values()),
        "backward_waits": sum(bwd.values()),
        "forward_syncs": dict(fwd),
        "backward_syncs": dict(bwd),
    }


if __name__ == "__main__":
    raise SystemExit(main())
