"""Measuring the host costs of `topology.HostCosts`: torch on 2 spawned gloo ranks that run at
once, as training ranks do, each reporting the slowest rank's medians as `HostPoint`s. The fits
(`poise.calibrate.host_fit`, no torch) are described here with what they fit.

Five measurements, each fitted by least squares on relative residuals (`fit.py`):

1. **Non-MoE compute.** The non-MoE part of one block of the GPT-MoE preset `config.model`
   (default `tiny`) at this config's widths, built from the real modules (the norms and
   attention of `poise.models.gpt.Block`, `poise.nn.Router`), over n tokens in sequences of
   the model's context:

       forward   h = x + attn(norm1(x)),  z = norm2(h),  routing = router(z)
       backward  from random gradients of h, z and the routing weights

   and the head (embedding, final norm, tied output projection, float cross-entropy), whose time
   is shared over the L MoE blocks as its FLOPs are (`host_costs.gpt_non_moe_flops_per_token`:
   F per token and block). Per n: t(n) = t_block(n) + t_head(n) / L over F n FLOPs forward and
   2 F n backward; `fit_gemm_curve` gives R, h of rate(n) = R n / (n + h), the
   `dense_{fwd,bwd}_flops` and `dense_{fwd,bwd}_half_tokens` of the cluster.

2. **Token dispatcher** (`poise.nn.dispatch.Dispatcher`), on the 2 gloo ranks at once: each rank
   routes T tokens top-k with static EP, every expert receiving T k / E of its rows
   (random order), and runs the model's experts on its slots (`poise.nn.Experts`), as a
   training step does: what the experts leave in the caches and the allocator is part of the
   dispatcher's cost. Timed per call: the forward less the experts' own forward (the
   dispatcher's `seconds["experts"]`) and the backward less the experts' backward (between
   hooks on the experts' output and input gradients); the slowest rank's medians. The cost
   model's link time of the two token all-to-alls each way (`lat + m / bw` on the measured
   all-to-all fit, m = the bytes a rank sends to the other) is subtracted; the rest is fitted
   to a + b x with x = s + r = 2 T k (the rows a rank sends, its own included, and the rows it
   receives): `dispatch_{fwd,bwd}_s` and `dispatch_{fwd,bwd}_s_per_row`.

3. **Optimizer and clipping** over a rank's real parameter tensors (`rank_param_shapes`: the
   model's dense tensors and its stacked expert tensors with S slots, for each S of
   `slot_counts`, P parameters in all): AdamW's step (`HomeRowsAdamW`, the optimizer and
   kernel `poise.train` runs, with the two groups it builds: weight decay on matrices, none on
   norms) and the gradient norm with clipping as `poise.train.grad_sync` computes it (squares summed
   per tensor in float64, `poise.nn.grad_norm`, experts over their home slots, then every
   gradient scaled in place); fitted to a + b P: `optimizer_s`,
   `optimizer_s_per_param`, `clip_s`, `clip_s_per_param`. Per-tensor overheads and each
   tensor's size against the caches make these depend on the model's tensors, not only on P.

4. **The model's experts** (`poise.nn.Experts`, one slot, the model's activation and widths)
   over n rows, forward and backward on both ranks at once: with `--model`, the cluster's GEMM
   curve (`gemm_flops`, `gemm_half_rows`) is fitted to these (`fit_gemm_curve` on forward +
   backward, 6 m d_model d_expert n FLOPs with m the expert's matrices) instead of to the
   two-matrix GELU FFN of `measure_gemm`: the experts a training step runs include their
   activation's elementwise work and the blocked loop over slots.

5. **All-reduce after compute**: both ranks run the non-MoE block forward and backward (a few
   milliseconds of local work, as before the step's dense-gradient all-reduce and the
   clipping's) and then all-reduce m bytes, for m around the model's dense gradients; only the
   all-reduce is timed, so its time includes the ranks' arrival skew after compute, which a
   back-to-back benchmark of the collective hides. Fitted to lat + m / bw:
   `allreduce_lat_s`, `allreduce_bw_Bps` (the step's collectives, `poise.cost.step_overheads`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poise.calibrate.config import WORLD_SIZE, CalibrationConfig
from poise.calibrate.host_fit import HostPoint
from poise.core.errors import ConfigError
from poise.cost.host import gpt_non_moe_flops_per_token
from poise.runtime.launch import destroy_process_group
from poise.util.atomic import atomic_write_text

DEFAULT_MODEL = "tiny"  # the shapes measured when no model is named
ALLREDUCE_SCALES = (0.125, 1.0, 4.0)  # all-reduce sizes: these times the dense gradients' bytes


def gpt_config(config: CalibrationConfig) -> Any:
    """The `GPTConfig` of preset `config.model` (None: `DEFAULT_MODEL`) at `config`'s widths;
    `ConfigError` naming `--model` if they do not fit it."""
    from poise.models.gpt import model_config

    widths = {"d_model": config.d_model, "d_expert": config.d_expert}
    return model_config(config.model or DEFAULT_MODEL, widths, source="--model")


def checked_model(config: CalibrationConfig) -> Any:
    """`gpt_config`, checked: the model must fit the host measurements' sizes."""
    from poise.calibrate.outputs import machine_memory_bytes

    cfg = gpt_config(config)
    need = WORLD_SIZE * 6 * 4 * max(rank_params(cfg, s) for s in config.slot_counts)
    if need > machine_memory_bytes() / 2:
        raise ConfigError(
            f"the optimizer timings need {need / 2**30:.1f} GiB, more than half of this "
            "machine's memory; use fewer slots or a smaller model",
            source="calibrate",
            field="slot_counts",
        )
    return cfg


def block_flops(cfg: Any, seq: int) -> float:
    """F of the module docstring for sequences of `seq` tokens."""
    return gpt_non_moe_flops_per_token(
        cfg.d_model, seq, cfg.num_experts, cfg.vocab_size, cfg.moe_layers
    )


def rank_param_shapes(cfg: Any, slots: int) -> list[tuple[int, ...]]:
    """Shapes of a GPT-MoE rank's parameters with `slots` expert slots per MoE layer, in
    `named_parameters` order: the embedding `[V, d]`; per block its norms `[d]`, `qkv [3d, d]`,
    `proj [d, d]` and either the router `[E, d]` and the stacked experts `[S, d, H]` (in, gate
    for SwiGLU) and `[S, H, d]` (out), or a dense FFN; the final norm."""
    d, H, F = cfg.d_model, cfg.d_expert, cfg.d_ff
    swiglu = cfg.activation == "swiglu"
    shapes: list[tuple[int, ...]] = [(cfg.vocab_size, d)]
    for layer in range(cfg.layers):
        shapes += [(d,), (3 * d, d), (d, d), (d,)]
        if cfg.is_moe(layer):
            shapes += [(cfg.num_experts, d), (slots, d, H)]
            shapes += [(slots, d, H)] if swiglu else []
            shapes += [(slots, H, d)]
        else:
            shapes += [(F, d)] + ([(F, d)] if swiglu else []) + [(d, F)]
    return [*shapes, (d,)]


def rank_params(cfg: Any, slots: int) -> int:
    """P: the parameters of `rank_param_shapes`."""
    return sum(math.prod(s) for s in rank_param_shapes(cfg, slots))


# ----------------------------------------------------------------------------------- timing
Call = Callable[[], tuple[float, float]]  # runs forward and backward, returns their seconds
Timer = Callable[[Call], tuple[float, float]]  # median (forward, backward) seconds of a call
Progress = Callable[[str], None]


def _no_progress(_: str) -> None:
    pass


def local_timer(repeats: int, warmup: int, min_time_s: float) -> Timer:
    """Median (forward, backward) seconds of a call in this process: after `warmup` calls,
    over at least `repeats` calls and enough to last about `min_time_s`."""
    from poise.calibrate.measure import _call_count

    def timer(call: Call) -> tuple[float, float]:
        warm = [sum(call()) for _ in range(max(1, warmup))]
        times = [call() for _ in range(_call_count(min(warm), repeats, min_time_s))]
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    return timer


def _dist_timer(repeats: int, warmup: int, min_time_s: float) -> Timer:
    """`local_timer` on every rank at once: the call count agreed from the slowest rank's
    warm-up, ranks starting together after a barrier, the slowest rank's medians."""
    from poise.calibrate.measure import _call_count, _slowest
    from poise.nn import comm

    def timer(call: Call) -> tuple[float, float]:
        comm.barrier()
        warm = [sum(call()) for _ in range(max(1, warmup))]
        calls = _call_count(_slowest(min(warm)), repeats, min_time_s)
        comm.barrier()
        times = [call() for _ in range(calls)]
        fwd = statistics.median(t[0] for t in times)
        bwd = statistics.median(t[1] for t in times)
        return _slowest(fwd), _slowest(bwd)

    return timer


def _timed(forward: Callable[[], Any], backward: Callable[[Any], None]) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = forward()
    t1 = time.perf_counter()
    backward(out)
    return t1 - t0, time.perf_counter() - t1


def _sequences(n: int, context: int) -> tuple[int, int]:
    """`(batch, seq)` for n tokens: sequences of the context (one shorter one below it)."""
    seq = min(n, context)
    if n % seq:
        raise ConfigError(
            f"{n} tokens are not whole sequences of the model's context {context}",
            source="calibrate",
            field="dense_tokens",
        )
    return n // seq, seq


def dense_points(
    config: CalibrationConfig, timer: Timer, progress: Progress = _no_progress
) -> list[HostPoint]:
    """Block and head timings at each of `config.dense_tokens`, and their per-block sums
    (`dense_fwd`, `dense_bwd`; module docstring, item 1)."""
    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch import nn

    from poise.models.gpt import Block, rotary_tables
    from poise.nn.router import Router

    cfg = gpt_config(config)
    torch.manual_seed(0)
    block = Block(cfg, nn.Identity())
    router = Router(cfg.d_model, cfg.num_experts, cfg.top_k)
    embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    points: list[HostPoint] = []
    for n in config.dense_tokens:
        batch, seq = _sequences(n, cfg.context)
        cos, sin = rotary_tables(seq, cfg.head_dim, cfg.rope_base)
        x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
        grads = [torch.randn_like(x), torch.randn_like(x), torch.randn(n, cfg.top_k)]
        idx = torch.randint(0, cfg.vocab_size, (batch, seq))
        tgt = torch.randint(0, cfg.vocab_size, (n,))

        def block_fwd(x: Any = x, cos: Any = cos, sin: Any = sin) -> Any:
            h = x + block.attn(block.norm1(x), cos, sin)
            z = block.norm2(h)
            return [h, z, router(z.reshape(-1, cfg.d_model)).weights]

        def block_bwd(out: Any, grads: Any = grads, x: Any = x) -> None:
            torch.autograd.backward(out, grads)
            x.grad = None

        def head_fwd(idx: Any = idx, tgt: Any = tgt) -> Any:
            logits = F.linear(norm(embed(idx)), embed.weight)
            return F.cross_entropy(logits.float().flatten(0, 1), tgt, reduction="sum")

        def head_bwd(loss: Any) -> None:
            loss.backward()

        bf, bb = timer(lambda f=block_fwd, b=block_bwd: _timed(f, b))
        hf, hb = timer(lambda f=head_fwd, b=head_bwd: _timed(f, b))
        flops = block_flops(cfg, seq) * n
        L = cfg.moe_layers
        points += [
            HostPoint("block_fwd", n, bf),
            HostPoint("block_bwd", n, bb),
            HostPoint("head_fwd", n, hf),
            HostPoint("head_bwd", n, hb),
            HostPoint("dense_fwd", n, bf + hf / L, flops=flops),
            HostPoint("dense_bwd", n, bb + hb / L, flops=2.0 * flops),
        ]
        progress(f"non-MoE block n={n}")
    return points


def step_points(
    config: CalibrationConfig, timer: Timer, progress: Progress = _no_progress
) -> list[HostPoint]:
    """AdamW step and clipping timings over a rank's parameters with each of
    `config.slot_counts` expert slots (item 3)."""
    import torch

    from poise.nn.grad_norm import squared_norm
    from poise.runtime.home_optimizer import HomeRowsAdamW

    cfg = gpt_config(config)
    points: list[HostPoint] = []
    for slots in config.slot_counts:
        params = _parameters(rank_param_shapes(cfg, slots))
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        opt = HomeRowsAdamW(groups, lr=1e-3)  # as `poise.train` steps it (fused on the CPU)
        opt.step()  # the moments exist from here, as in every step after the first
        grads = [p.grad for p in params]
        homes = slots  # every slot a home slot here, as before a plan replicates

        def step(opt: Any = opt) -> tuple[float, float]:
            t0 = time.perf_counter()
            opt.step()
            return time.perf_counter() - t0, 0.0

        def clip(grads: Any = grads, homes: int = homes) -> tuple[float, float]:
            t0 = time.perf_counter()
            sq = torch.zeros((), dtype=torch.float64)
            for g in grads:
                if g.ndim == 3:  # stacked expert slots: the leading (home) slots' squares
                    sq += squared_norm(g[:homes])
                else:
                    sq += squared_norm(g)
            torch._foreach_mul_(grads, 1.0 / (1.0 + float(sq.sqrt())))
            return time.perf_counter() - t0, 0.0

        n = sum(p.numel() for p in params)
        points.append(HostPoint("optimizer", n, timer(step)[0]))
        points.append(HostPoint("clip", n, timer(clip)[0]))
        progress(f"optimizer and clipping, {slots} slots")
    return points


def _parameters(shapes: list[tuple[int, ...]]) -> list[Any]:
    """Parameters of `shapes` with gradients (small random values)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append(p)
    return params


def balanced_experts(tokens: int, top_k: int, experts: int, seed: int) -> Any:
    """`[tokens, top_k]` expert ids in which every expert appears `tokens * top_k / experts`
    times (within one), in random order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.arange(tokens * top_k) % experts
    return ids[torch.randperm(tokens * top_k, generator=gen)].view(tokens, top_k)


def dispatch_points(
    config: CalibrationConfig, timer: Timer, progress: Progress = _no_progress
) -> list[HostPoint]:
    """Dispatcher forward and backward timings, less the experts' own, at each of
    `config.dispatch_tokens` tokens per rank (item 2), on the default process group (every
    rank calls it)."""
    import torch
    import torch.distributed as dist

    from poise.calibrate.measure import _slowest
    from poise.nn.dispatch import Dispatcher, RankRouting, world_and_rank
    from poise.nn.experts import Experts

    cfg = gpt_config(config)
    world, rank = world_and_rank()
    E, k, d = cfg.num_experts, cfg.top_k, cfg.d_model
    slots = max(E // world, 1)
    torch.manual_seed(rank)
    experts_mod = Experts(slots, d, cfg.d_expert, cfg.activation)
    disp = Dispatcher(E, k, dist.group.WORLD if world > 1 else None)
    routing = RankRouting.static(E, world, rank, slots)
    held = torch.as_tensor(routing.held)
    marks: dict[str, float] = {}

    def mark(name: str) -> Callable[[Any], None]:
        def hook(_grad: Any) -> None:
            marks[name] = time.perf_counter()

        return hook

    def expert_fn(rows: Any, tokens_per_slot: Any) -> Any:
        rows.register_hook(mark("experts_done"))
        out = experts_mod(rows, tokens_per_slot)
        out.register_hook(mark("experts_start"))
        return out

    points = []
    for T in config.dispatch_tokens:
        gen = torch.Generator().manual_seed(1000 * rank + T)
        experts = balanced_experts(T, k, E, seed=7 * rank + T)
        x = torch.randn(T, d, generator=gen, requires_grad=True)
        w = torch.rand(T, k, generator=gen).requires_grad_(True)
        gy = torch.randn(T, d, generator=gen)

        def call(x: Any = x, w: Any = w, gy: Any = gy, experts: Any = experts) -> Any:
            t0 = time.perf_counter()
            y = disp(x, experts, w, None, routing, expert_fn)
            t1 = time.perf_counter()
            y.backward(gy)
            t2 = time.perf_counter()
            x.grad = w.grad = None
            experts_mod.zero_grad(set_to_none=True)
            fwd = t1 - t0 - disp.seconds["experts"]
            bwd = t2 - t1 - (marks["experts_done"] - marks["experts_start"])
            return fwd, bwd

        fwd, bwd = timer(call)
        nbytes = _slowest(float(int((~held[experts]).sum()) * d * 4))
        points.append(HostPoint("dispatch_fwd", T * k, fwd, nbytes=nbytes))
        points.append(HostPoint("dispatch_bwd", T * k, bwd, nbytes=nbytes))
        progress(f"dispatcher T={T}")
    return points


def expert_points(
    config: CalibrationConfig, timer: Timer, progress: Progress = _no_progress
) -> list[HostPoint]:
    """The model's experts (one slot) forward and backward at each of `config.rows` rows
    (item 4)."""
    import torch

    from poise.nn.experts import Experts

    cfg = gpt_config(config)
    torch.manual_seed(0)
    experts = Experts(1, cfg.d_model, cfg.d_expert, cfg.activation)
    m = 3 if cfg.activation == "swiglu" else 2
    points: list[HostPoint] = []
    for n in config.rows:
        x = torch.randn(n, cfg.d_model, requires_grad=True)
        gy = torch.randn(n, cfg.d_model)

        def forward(x: Any = x, n: int = n) -> Any:
            return experts(x, [n])

        def backward(y: Any, gy: Any = gy, x: Any = x) -> None:
            y.backward(gy)
            x.grad = None
            experts.zero_grad(set_to_none=True)

        fwd, bwd = timer(lambda f=forward, b=backward: _timed(f, b))
        flops = 2.0 * m * cfg.d_model * cfg.d_expert * n
        points.append(HostPoint("experts_fwd", n, fwd, flops=flops))
        points.append(HostPoint("experts_bwd", n, bwd, flops=2.0 * flops))
        progress(f"model experts n={n}")
    return points


def dense_grad_bytes(cfg: Any) -> int:
    """float32 bytes of a GPT-MoE's dense (non-expert) gradients."""
    shapes = rank_param_shapes(cfg, 0)
    return 4 * sum(math.prod(s) for s in shapes)


def allreduce_points(
    config: CalibrationConfig, timer: Timer, progress: Progress = _no_progress
) -> list[HostPoint]:
    """All-reduce after local compute (item 5), on the default process group."""
    import torch
    from torch import nn

    from poise.models.gpt import Block, rotary_tables
    from poise.nn import comm

    cfg = gpt_config(config)
    torch.manual_seed(0)
    block = Block(cfg, nn.Identity())
    n = sorted(config.dense_tokens)[len(config.dense_tokens) // 2]
    batch, seq = _sequences(n, cfg.context)
    cos, sin = rotary_tables(seq, cfg.head_dim, cfg.rope_base)
    x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
    points: list[HostPoint] = []
    for scale in ALLREDUCE_SCALES:
        nbytes = max(4096, int(dense_grad_bytes(cfg) * scale) // 4 * 4)
        buf = torch.ones(nbytes // 4)

        def call(buf: Any = buf) -> tuple[float, float]:
            y = x + block.attn(block.norm1(x), cos, sin)
            y.sum().backward()
            x.grad = None
            t0 = time.perf_counter()
            comm.all_reduce(buf)
            return time.perf_counter() - t0, 0.0

        points.append(HostPoint("allreduce", nbytes, timer(call)[0]))
        progress(f"all-reduce after compute, {nbytes} B")
    return points


def _host_worker(
    rank: int, port: int, config: CalibrationConfig, threads: int, result_path: str, queue: Any
) -> None:
    """One gloo rank: every host measurement, lock-step with the other rank; rank 0 writes the
    slowest rank's medians as JSON to `result_path` and reports progress on `queue`."""
    from dataclasses import asdict

    from poise.calibrate.measure import init_local_gloo
    from poise.nn import comm

    init_local_gloo(rank, port, threads)
    try:
        timer = _dist_timer(config.gemm_repeats, config.warmup, config.min_time_s)
        progress = queue.put if rank == 0 else _no_progress
        points = dense_points(config, timer, progress) + step_points(config, timer, progress)
        points += expert_points(config, timer, progress)
        comm_timer = _dist_timer(config.comm_repeats, config.warmup, config.min_time_s)
        points += dispatch_points(config, comm_timer, progress)
        points += allreduce_points(config, comm_timer, progress)
        if rank == 0:
            atomic_write_text(result_path, json.dumps([asdict(p) for p in points]))
        comm.barrier()
    finally:
        destroy_process_group()


def measure_host(config: CalibrationConfig, progress: Progress = _no_progress) -> list[HostPoint]:
    """Every host measurement of the module docstring, on `WORLD_SIZE` spawned gloo ranks that
    run at once as training ranks do (the slowest rank's medians), each with `config.threads`
    torch threads (default: this machine's cores shared among the ranks)."""
    import torch.multiprocessing as mp

    from poise.calibrate.measure import _wait
    from poise.runtime.launch import free_port

    checked_model(config)  # a bad --model fails here, before any rank starts
    threads = config.threads or max(1, (os.cpu_count() or 1) // WORLD_SIZE)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="poise-calibrate-") as tmp:
        result_path = os.path.join(tmp, "host.json")
        args = (free_port(), config, threads, result_path, queue)
        procs = mp.start_processes(
            _host_worker, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn"
        )
        _wait(procs, queue, progress)
        rows = json.loads(Path(result_path).read_text(encoding="utf-8"))
    return [HostPoint(**r) for r in rows]


def host_steps(config: CalibrationConfig) -> int:
    """Progress messages `measure_host` reports."""
    sizes = len(config.dense_tokens) + len(config.slot_counts) + len(config.dispatch_tokens)
    return sizes + len(config.rows) + len(ALLREDUCE_SCALES)


__all__ = [
    "allreduce_points",
    "balanced_experts",
    "checked_model",
    "dense_points",
    "dispatch_points",
    "expert_points",
    "gpt_config",
    "host_steps",
    "local_timer",
    "measure_host",
    "rank_param_shapes",
    "rank_params",
    "step_points",
]
