"""Host synchronisations in one MoE layer's forward and backward on CUDA, and where they are.

    python3 benchmarks/cuda_syncs.py                 # needs a CUDA device; a few seconds

`poise.nn.MoE` on one device (no process group: the dispatcher's local path) in bf16, with
`torch.cuda.set_sync_debug_mode("warn")`: every call that makes the host wait for the GPU
(`.item()`, `.cpu()`, a blocking copy, a kernel whose output size depends on the data) warns,
and the script records the innermost `poise` source line of each. Three layers: dropless,
with a capacity factor (drops), and with DeepSeek-V3's bias (`expert_bias`). Warm-up calls
come first (the first call's lazy initialisation is not the forward's cost). One JSON line per
layer: `forward_syncs` and `backward_syncs`, counts per source line.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from poise.nn import MoE, MoEConfig

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
    return p.parse_args(argv)


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
        print(json.dumps({"bench": "cuda_syncs", "skipped": "no CUDA device"}))
        return 0
    device = torch.device("cuda")
    for name in args.layers:
        cfg = MoEConfig(
            d_model=args.d_model,
            d_expert=args.d_expert,
            num_experts=args.experts,
            top_k=args.top_k,
            **LAYERS[name],
        )
        moe = MoE(cfg, device=device, dtype=torch.bfloat16)
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
        print(
            json.dumps(
                {
                    "bench": "cuda_syncs",
                    "device": torch.cuda.get_device_name(device),
                    "torch": torch.__version__,
                    "layer": name,
                    "impl": moe.experts.resolved_impl(x),
                    "forward_syncs": dict(fwd),
                    "backward_syncs": dict(bwd),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
