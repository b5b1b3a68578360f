"""The training loop: GPT-MoE with expert parallelism over torch.distributed, balanced live.

    from poise.train import TrainConfig, train
    result = train(TrainConfig(steps=200, policy="auto"))     # on every rank
    result.losses, result.tokens_per_s, result.trace_path

`train` runs on every rank of the default process group (gloo on the CPU, NCCL with CUDA). It
creates the group itself from torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`) when none exists, or trains in one process without one.

Parallelism: every rank holds the replicated ("dense") parameters (embedding, attention, norms,
dense FFNs, routers) and its expert slots (expert parallelism over all ranks: `E / D` experts
each, plus `spare_slots` for replicas when the policy balances). Each rank reads its shard of the
global batch. After `backward`, the dense gradients are summed over the ranks in one
all-reduce; the loss on each rank is its tokens' cross-entropy sum divided by the global token
count (and the routers' auxiliary loss divided by D), so the summed gradients are those of the
global mean loss whatever the number of ranks. With `micro_batches` M > 1 the global count is
the step's (M micro-batches of `batch` sequences) and the auxiliary loss is divided by M too, so
a step of M micro-batches of `batch` sequences takes the gradients of one of a single batch of
M * `batch` sequences (the router's auxiliary loss excepted: it is the mean of the
micro-batches'). Replica gradients add up over the micro-batches and Agg sums them into their
homes once, after the last backward (`Balancer.no_sync`, as DDP's); Trans once a step, after
the optimizer; each micro-batch's tokens are split among a replicated expert's holders by its
own counts. Expert gradients need no all-reduce: the
dispatcher's backward brings every rank's contribution to the slot that computed it, and the
`poise.runtime.Balancer` sums replica gradients into their homes (Agg).

With `fsdp: true` the dense parameters are sharded by FSDP2 instead (`poise.nn.fsdp.shard_dense`:
`fully_shard` over a ("dp", "ep") `DeviceMesh`, the experts left out), which sums their
gradients into each rank's shard in backward (divide factor 1); the scalars then take the
all-reduce alone, and the clipping norm sums the shards' squares over the mesh. Same losses.

In a SmartMoE layout (`layout: "ep=2"`; `poise.train.layout`) the MoE layers are expert
parallel over EP groups of ep ranks (E / ep experts each, plus `spare_slots` when balancing),
each group has its own Balancer over its ep ranks (a cluster of ep devices, planning on the
counts summed over the expert-data-parallel group, so all groups plan alike), the expert
gradients are summed over the EDP group after Agg, and the clipping norm sums the experts'
squares over one EP group (each expert once). Data, loss scaling and dense gradients are as
above, so the losses are those of plain expert parallelism.

One step, every call named here:

    for each of `micro_batches` micro-batches:   # gradient accumulation (default 1)
        forward; loss.backward()                # all but the last inside `balancer.no_sync()`
    dense all-reduce (with the loss)            # grad_sync.sync_dense
    balancer.reduce_replicas()                  # Agg; gather counts, non-finite flags, timings
    [layout: EDP sum of expert gradients, EDP gather of the counts]
    global gradient norm and clipping           # grad_sync.clip_global_norm
    optimizer.step()
    balancer.step()                             # decide a due plan / request one / Trans
    log

NaN or infinity in an MoE layer's input raises `NonFiniteInputError` at `reduce_replicas` on
every rank (forward only sets a device flag). The learning rate
warms up linearly for `warmup` steps, then follows a cosine down to `lr * min_lr_ratio` at
`steps`.

Set-up (process group, device, corpus, optimizer, modelled cluster, learning rate, the check
that all ranks share the config) is `poise.train.setup`; rank 0's console and metrics file are
`poise.train.runlog.RunLog`; the trace and summary files are `poise.train.run_files`.

Outputs in `out` (rank 0; every file written atomically or as flushed JSON lines):
`config.yaml`, `metrics.jsonl` (one line per step: loss, tokens/s, per-layer device max/mean
load, the expert load of `poise.train.expert_load` (`tokens_per_expert`, `cv`, drops, replicas),
plan changes, seconds by phase, validation loss when measured), `trace.npz` (the routing counts
`[steps, layers, ranks, experts]` as a `poise.trace.trace.Trace`, at checkpoints and at the end),
`checkpoints/`, `summary.json`, TensorBoard events in `tb/` (`poise.train.tboard`; unless
`tensorboard: false`), and with `megatron_trace: true` every rank's routing as Megatron-Core
router traces in `megatron-trace/router_trace_rank<R>.jsonl` (`poise.train.router_trace`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from poise.core.errors import ConfigError
from poise.models.gpt import GPTMoE
from poise.nn import comm
from poise.nn.comm import comm_device
from poise.nn.expert_parallel import apply_expert_parallel
from poise.nn.moe import (
    default_slots,
    find_moe_layers,
    install_bias_update,
    raise_if_nonfinite,
)
from poise.runtime.launch import destroy_process_group
from poise.runtime.stats import StepStats
from poise.train import checkpoint as ckpt_io
from poise.train.config import TrainConfig, resolve_layout, save_config
from poise.train.data import Sampler, shard_rows
from poise.train.expert_load import ExpertLoad, expert_load
from poise.train.faults import Fault, FaultInjector
from poise.train.grad_sync import clip_global_norm, sync_dense
from poise.train.instruments import make_instruments
from poise.train.layout import edp_counts, install_edp_bias_sum
from poise.train.router_trace import StepRouterTrace
from poise.train.run_files import closing_lines, previous_trace, routing_trace, write_summary
from poise.train.runlog import RunLog
from poise.train.setup import (
    check_config_agrees,
    init_distributed,
    load_corpus,
    lr_at,
    make_balancer,
    make_cluster,
    make_optimizer,
    pick_device,
    seed_everything,
    shared_cores_note,
)

PHASES = ("data", "forward", "backward", "grad_sync", "balance", "clip", "optimizer")


@dataclass
class TrainResult:
    """What one `train` call did (identical on every rank). `steps[i]` is the 1-based step of
    `losses[i]` (global mean cross-entropy, nats per byte); `val` holds `(step, loss)`;
    `tokens_per_s` the median over the measured steps (the first `min(3, n // 4)` excluded as
    warm-up); `phase_s` total seconds by phase on rank 0. In a layout: `layout` its name and
    `replicas_agree` whether the expert-data-parallel replicas held identical expert weights at
    the end (checked exactly; None without replicas)."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    tokens_per_step: int = 0
    plan_changes: int = 0
    max_over_mean: list[float] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)
    world_size: int = 1
    start_step: int = 0
    out: str = ""
    trace_path: str | None = None
    checkpoint: str | None = None
    resumed_plan: bool = False
    layout: str | None = None
    replicas_agree: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Stepped:
    """What `_Trainer._compute` leaves of one step: its learning rate, the scalars summed over
    the ranks (`[2 + L]`: cross-entropy sum, auxiliary loss, dropped assignments per layer),
    the gradient norm, the world's counts `[L, D, E]` in a layout with EDP replicas (else
    None), seconds by phase and in all."""

    lr: float
    summed: torch.Tensor
    norm: float
    world_counts: np.ndarray | None
    phases: dict[str, float]
    step_s: float


# ----------------------------------------------------------------------------- the loop
class _Trainer:
    """State of one run on one rank; `run()` does the steps."""

    def __init__(self, cfg: TrainConfig, resume: str | None, quiet: bool) -> None:
        self.cfg = cfg
        self.world, self.rank = (
            (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        )
        check_config_agrees(cfg, self.world, self.rank)
        self.faults = FaultInjector(Fault.from_env(), self.rank)
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = pick_device(cfg)
        self.mcfg = cfg.model_config()
        self.layout = resolve_layout(cfg, self.world)  # None: plain EP over the world
        self.groups = None
        if self.layout is not None and self.world > 1:
            from poise.runtime.smartmoe import create_groups

            # collective, once; the transfers' own groups only where experts will move
            moves = cfg.separate_transfers and cfg.policy != "static"
            self.groups = create_groups(self.layout, transfers=moves)
        self.ep = self.layout.ep if self.layout is not None else self.world
        self.edp_group = self.groups.edp if self.groups is not None else None
        self.rows = shard_rows(cfg.batch, self.rank, self.world)
        # per step, over all ranks: `micro_batches` micro-batches of `batch` sequences
        self.tokens = cfg.batch * self.mcfg.context * cfg.micro_batches
        self.out = Path(cfg.out)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)

        corpus = load_corpus(cfg, self.local_rank, self.world)
        self.corpus = corpus
        self.sampler = Sampler(corpus.train, self.mcfg.context, seed=cfg.seed)
        self.val_sampler = Sampler(corpus.val, self.mcfg.context, shuffle=False)

        self.slots = default_slots(self.mcfg.num_experts, self.ep)
        if cfg.balancing and self.ep > 1:
            self.slots += cfg.spare_slots
        group = dist.group.WORLD if self.world > 1 else None
        if self.groups is not None:
            group = self.groups.ep  # the EP group (the world when ep = D)
        self.ep_group = group
        self.model = GPTMoE(
            self.mcfg,
            balance_coef=cfg.aux_loss,
            z_loss_coef=cfg.z_loss,
            expert_bias=cfg.bias_rate > 0,
            experts_impl=cfg.experts_impl,
            overlap_degree=cfg.overlap_degree,
            seed=cfg.seed,
            device=self.device,
        )
        # FSDP2 (`fsdp: true`): a ("dp", "ep") mesh; EP on its "ep" dimension (a layout's own
        # EP groups are the same ranks), the dense parameters sharded over all of it
        self.mesh = None
        if cfg.fsdp and self.world > 1:
            from poise.nn.fsdp import ep_mesh

            self.mesh = ep_mesh(self.ep, device_type=self.device.type)
            if self.groups is None:
                group = self.ep_group = self.mesh["ep"].get_group()
        if group is not None:  # collective: checks that every rank built the same layers
            apply_expert_parallel(self.model, group, num_slots=self.slots)
        if self.mesh is not None:
            from poise.nn.fsdp import shard_dense

            shard_dense(self.model, self.mesh)  # the experts left out: expert parallel
        self.dense = [p for _, p in self.model.dense_named_parameters()]
        self.experts = self.model.expert_parameters()
        self.optimizer = make_optimizer(self.model, cfg)

        self.ckpt = ckpt_io.load(resume) if resume else None
        self.start = 0
        self.position = 0
        if self.ckpt is not None:
            ckpt_io.restore(self.model, self.optimizer, self.ckpt)
            self.start = int(self.ckpt["step"])
            self.position = int(self.ckpt["data_position"])
            if self.start >= cfg.steps:
                raise ConfigError(
                    f"the checkpoint is at step {self.start}, nothing left of {cfg.steps} steps",
                    source=self.ckpt["path"],
                    field="steps",
                )
        self.balancer = make_balancer(
            cfg, self.model, self.optimizer, self.world, self.ep, group, self.groups
        )
        self.resumed_plan = False
        if self.ckpt is not None:
            self.resumed_plan = ckpt_io.restore_plan(self.balancer, self.ckpt, self.world)
            ckpt_io.restore_rng(self.ckpt, self.rank)
        if cfg.bias_rate > 0:
            install_edp_bias_sum(self.optimizer, self.model, self.edp_group)  # runs first
            install_bias_update(self.optimizer, self.model, cfg.bias_rate)
        self.log = RunLog(cfg, self.out, self.rank == 0, self.start, quiet)
        self.megatron = (
            StepRouterTrace(self.out / "megatron-trace", self.rank, self.start)
            if cfg.megatron_trace
            else None
        )
        self.trace_counts, self.trace_steps = self._previous_trace()
        # benchmark instruments (free balancing, steps in turns): none in a normal run
        self.instruments = make_instruments(cfg, self.balancer, self.rank)
        self.plan_changes = int(self.ckpt["extra"].get("plan_changes", 0)) if self.ckpt else 0
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if cfg.precision == "bf16"
            else nullcontext()
        )

    # ----------------------------------------------------------------------------- pieces
    def _previous_trace(self) -> tuple[list[np.ndarray], list[int]]:
        """On resume, the recorded trace up to the checkpoint (same ranks and layers only)."""
        if self.ckpt is None or not self.cfg.record_trace:
            return [], []
        shape = (len(find_moe_layers(self.model)), self.world, self.mcfg.num_experts)
        return previous_trace(self.ckpt["path"], self.start, shape)

    def _step_scalars(self, ce: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """`[2 + L]` float64: the step's cross-entropy sum, auxiliary loss and each MoE layer's
        dropped assignments, summed over the ranks with the dense gradients (no extra
        collective)."""
        dropped = [m.last_forward.dropped.to(ce.device) for m in find_moe_layers(self.model)]
        return torch.stack([ce.detach(), aux.detach(), *dropped]).double()

    def _expert_load(
        self, world_counts: np.ndarray | None, dropped: torch.Tensor
    ) -> ExpertLoad | None:
        """The step's expert load (`poise.train.expert_load`) from the world's counts
        `[L, D, E]` (the Balancer's newest window row without a layout), the plan in force and
        `dropped [L]` (summed over the ranks); replicas are those the next step runs (after this
        step's boundary: the plan in force, its replicas retargeted, `Balancer.routed`). None
        when no counts were gathered."""
        counts = world_counts
        if counts is None and self.balancer.window:
            counts = self.balancer.window[-1]
        if counts is None:
            return None
        drops = np.rint(dropped.cpu().numpy()).astype(np.int64)
        return expert_load(counts, self.balancer.routed.placement.copies, drops)

    def _sync_experts(self, step: int) -> np.ndarray | None:
        """In a layout with EDP replicas (after Agg): sum the expert gradients over the EDP
        group, and gather the step's counts over it; the Balancer's newest window row becomes
        the counts summed over the EDP group (its planning input, alike in every EP group).
        Returns the world's counts `[L, D, E]` for the trace (None without replicas)."""
        if self.edp_group is None or self.groups is None:
            return None
        from poise.runtime.smartmoe import all_reduce_expert_grads

        # slot maps only change when a balancing policy re-plans: check them then (and once)
        all_reduce_expert_grads(
            self.model, self.edp_group, check=self.cfg.balancing or step == self.start
        )
        if not (self.cfg.record_trace or self.cfg.balancing) or not self.balancer.window:
            return None
        summed, counts = edp_counts(self.balancer.window[-1], self.groups)
        if self.cfg.balancing:
            self.balancer.window[-1] = summed
        return counts

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy over `eval_batches` fixed validation batches (all ranks)."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for j in range(self.cfg.eval_batches):
            x, y = self.val_sampler.batch(j * self.cfg.batch, self.rows, self.device)
            with self.autocast:
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            total += torch.tensor([float(loss), y.numel()], dtype=torch.float64)
        if self.world > 1:
            t = total.to(comm_device(None, self.device))
            comm.all_reduce(t)
            total = t.cpu()
        raise_if_nonfinite(self.model, dist.group.WORLD if self.world > 1 else None)
        self.model.train()
        return float(total[0] / total[1])

    def save_trace(self) -> str | None:
        """Rank 0: write `trace.npz` (`run_files.routing_trace`); its path, None if none."""
        if not self.cfg.record_trace or not self.trace_counts or self.rank != 0:
            return None
        meta = {
            "policy": self.cfg.policy,
            "model": self.cfg.model,
            # the cluster the run planned on: its `cluster` config, else the modelled one
            "cluster": self.cfg.cluster or make_cluster(self.cfg, self.world).name,
            "world_size": self.world,
            "device_type": self.device.type,
            "batch": self.cfg.batch,
            "micro_batches": self.cfg.micro_batches,
            "context": self.mcfg.context,
            "seed": self.cfg.seed,
            "layout": self.layout.name if self.layout is not None else None,
        }
        tokens_per_device = len(self.rows) * self.mcfg.context * self.cfg.micro_batches
        trace = routing_trace(
            self.trace_counts, self.trace_steps, meta, self.mcfg.top_k, tokens_per_device
        )
        path = self.out / "trace.npz"
        trace.save(path)
        return str(path)

    def checkpoint(self, step: int) -> str:
        path = ckpt_io.save(
            self.model,
            self.optimizer,
            self.balancer,
            self.out,
            step=step,
            data_position=self.position,
            config=self.cfg.to_dict(),
            extra={"plan_changes": self.plan_changes},
            keep=self.cfg.keep_checkpoints,
            expert_group=self.ep_group if self.groups is not None else None,
        )
        self.save_trace()
        return str(path)

    def _compute(self, step: int) -> _Stepped:
        """One step's computation, every call named in the module docstring, timed by phase."""
        cfg, dev, tokens = self.cfg, self.device, self.tokens
        ph: dict[str, float] = {}
        t_start = t = time.perf_counter()
        lr = lr_at(step, cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        micro = cfg.micro_batches
        scalars: list[torch.Tensor] = []
        for m in range(micro):  # gradient accumulation: the micro-batches' gradients add up
            x, y = self.sampler.batch(self.position + m * cfg.batch, self.rows, dev)
            t = _lap(ph, "data", t)
            with self.autocast:
                logits = self.model(x)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            aux = self.model.aux_loss()
            loss = ce * (1.0 / tokens) + aux / (self.world * micro)
            if self.megatron is not None:  # a copy of the choices, in forward's time
                self.megatron.keep(self.model)
            t = _lap(ph, "forward", t)
            self.faults.at(step + 1, "forward")
            # Agg once a step, for the sum: after the last micro-batch's backward (`no_sync`)
            if self.mesh is not None:  # FSDP reduces once, after the last micro-batch
                self.model.set_requires_gradient_sync(m == micro - 1)
            with nullcontext() if m == micro - 1 else self.balancer.no_sync():
                loss.backward()
            t = _lap(ph, "backward", t)
            self.faults.at(step + 1, "backward")
            scalars.append(self._step_scalars(ce, aux / micro))
        summed = sync_dense(self.dense, torch.stack(scalars).sum(dim=0), self.world, dev)
        t = _lap(ph, "grad_sync", t)
        self.balancer.reduce_replicas()
        t = _lap(ph, "balance", t)
        world_counts = self._sync_experts(step)
        t = _lap(ph, "grad_sync", t)
        norm = clip_global_norm(self.model, self.dense, self.ep, self.ep_group, dev, cfg.clip)
        t = _lap(ph, "clip", t)
        self.optimizer.step()
        t = _lap(ph, "optimizer", t)
        self.balancer.step()  # decide a due plan, request the next, or launch Trans
        self.optimizer.zero_grad(set_to_none=True)
        t = _lap(ph, "balance", t)
        untimed = sum(i.untimed_s for i in self.instruments)  # an instrument's, in `balance`
        ph["balance"] -= untimed
        return _Stepped(lr, summed, norm, world_counts, ph, t - t_start - untimed)

    def _record(self, step: int, stepped: _Stepped) -> dict[str, Any]:
        """The step's `metrics.jsonl` line (plan changes counted, the routing trace extended)."""
        cfg, done, tokens = self.cfg, step + 1, self.tokens
        key = self.balancer.plan.digest()
        changed = key != self._digest
        self._digest = key
        self.plan_changes += int(changed)
        if cfg.record_trace and stepped.world_counts is not None:
            self.trace_counts.append(stepped.world_counts)
            self.trace_steps.append(step)
        elif cfg.record_trace and self.balancer.window:
            self.trace_counts.append(self.balancer.window[-1].copy())
            self.trace_steps.append(step)
        summed, stats = stepped.summed, self.balancer.last_stats
        record: dict[str, Any] = {
            "step": done,
            "loss": float(summed[0]) * (1.0 / tokens),
            "aux_loss": float(summed[1]) / self.world,
            "lr": stepped.lr,
            "grad_norm": stepped.norm,
            "tokens": tokens,
            "step_s": stepped.step_s,
            "tokens_per_s": tokens / stepped.step_s,
            "plan_changed": changed,
            "plan_changes": self.plan_changes,
            "phases_s": stepped.phases,
            # the Balancer's side of the step (none before its first step)
            **(stats or StepStats(step=done, policy=cfg.policy)).as_record(),
        }
        load = self._expert_load(stepped.world_counts, summed[2:])
        if load is not None:
            record.update(load.as_record())
        return record

    # ------------------------------------------------------------------------------ run
    def header(self) -> None:
        n = self.model.num_parameters()
        c = self.mcfg
        self.log.print(
            f"poise train: {self.cfg.model} ({n['dense'] / 1e6:.2f} M dense + "
            f"{n['experts'] / 1e6:.2f} M expert parameters; {c.layers} layers, "
            f"{c.moe_layers} MoE with {c.num_experts} experts top-{c.top_k}) on {self.world} "
            f"rank(s) ({self.device.type}), policy {self.cfg.policy} every "
            f"{self.cfg.replan_every}, {self.slots} slots/rank; corpus {self.corpus.source}: "
            f"{len(self.corpus.tokens):,} bytes in {self.corpus.files} files"
        )
        if self.layout is not None:
            self.log.print(f"layout {self.layout.describe()}")
        if self.mesh is not None:
            self.log.print(
                f"fsdp: dense parameters sharded over {self.world} ranks by fully_shard "
                f"(mesh {dict(zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True))}), "
                "gradients summed; experts expert parallel"
            )
        note = shared_cores_note(self.balancer)
        if note:
            self.log.print(note)
        if self.cfg.precision == "bf16" and self.device.type == "cpu":
            self.log.print("note: bf16 autocast on the CPU is slow; it is meant for GPUs")
        if self.ckpt is not None:
            how = "saved placement" if self.resumed_plan else "static placement"
            self.log.print(
                f"resumed from {self.ckpt['path']} at step {self.start} "
                f"({self.ckpt['world_size']} ranks then, {self.world} now; {how})"
            )

    def run(self) -> TrainResult:
        cfg = self.cfg
        res = TrainResult(
            world_size=self.world,
            start_step=self.start,
            out=str(self.out),
            resumed_plan=self.resumed_plan,
            layout=self.layout.name if self.layout is not None else None,
        )
        tokens = res.tokens_per_step = self.tokens
        if self.rank == 0:
            # The written config says what this run does: `tensorboard: true` only if events
            # are written (TensorBoard is optional and skipped when absent).
            written = cfg
            if cfg.tensorboard and self.log.tb is None:
                written = dataclasses.replace(cfg, tensorboard=False)
            save_config(written, self.out / "config.yaml")
        self.header()
        totals = dict.fromkeys(PHASES, 0.0)
        self._digest = self.balancer.plan.digest()
        self.model.train()
        self.faults.install()
        try:
            for instrument in self.instruments:
                instrument.start()
            for step in range(self.start, cfg.steps):
                extra: dict[str, Any] = {}
                for instrument in self.instruments:
                    extra.update(instrument.before_step(step) or {})
                self.faults.at(step + 1, "step")
                done = step + 1
                stepped = self._compute(step)
                if self.megatron is not None:
                    self.megatron.write(step)
                self.position += cfg.batch * cfg.micro_batches
                record = {**self._record(step, stepped), **extra}
                stats, ph, loss_value = self.balancer.last_stats, stepped.phases, record["loss"]
                for k, v in ph.items():
                    totals[k] += v
                res.steps.append(done)
                res.losses.append(loss_value)
                res.step_seconds.append(stepped.step_s)
                res.max_over_mean.append(
                    float(np.mean(stats.max_over_mean)) if stats and stats.max_over_mean else 1.0
                )
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at step {done}")
                if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
                    record["val_loss"] = self.evaluate()
                    res.val.append((done, record["val_loss"]))
                self.log.step(record)
                if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
                    res.checkpoint = self.checkpoint(done)
                for instrument in self.instruments:
                    instrument.after_step(step)
            for instrument in self.instruments:
                instrument.finish(cfg.steps)
            if self.edp_group is not None:
                from poise.runtime.smartmoe import replicas_agree

                res.replicas_agree = replicas_agree(self.model, self.edp_group)
        except BaseException:
            for instrument in self.instruments:
                instrument.abandon()
            raise
        finally:
            self.faults.uninstall()
            for instrument in self.instruments:
                instrument.close()
            self.log.close()
            self.balancer.close()
            if self.megatron is not None:
                self.megatron.close()
        res.trace_path = self.save_trace()
        if res.trace_path is None and cfg.record_trace:
            res.trace_path = str(self.out / "trace.npz")
        res.plan_changes = self.plan_changes
        res.phase_s = totals
        warm = min(3, len(res.step_seconds) // 4)
        measured = res.step_seconds[warm:] or res.step_seconds
        res.tokens_per_s = tokens / float(np.median(measured)) if measured else 0.0
        if self.rank == 0:
            summary = res.as_dict()
            summary.update(policy=cfg.policy, model=cfg.model, device=self.device.type)
            summary["threads"] = torch.get_num_threads()  # rank 0's intra-op threads
            if self.balancer.probe is not None:  # start-up bulk transfers, `runtime.probe`
                k = ("k", "measured_s", "modelled_s")
                summary["transfer_probe"] = dict(zip(k, self.balancer.probe, strict=True))
            if self.balancer.switch_probe is not None:  # the first switch's price
                k = ("k", "measured_s", "modelled_s", "homes")
                summary["switch_probe"] = dict(zip(k, self.balancer.switch_probe, strict=True))
            write_summary(self.out / "summary.json", summary)
            for line in closing_lines(res, totals, self.out):
                self.log.print(line)
        return res


def _lap(phases: dict[str, float], name: str, t: float) -> float:
    now = time.perf_counter()
    phases[name] = phases.get(name, 0.0) + now - t
    return now


def train(cfg: TrainConfig, *, resume: str | None = None, quiet: bool = False) -> TrainResult:
    """Train on every rank of the default process group (created from torchrun's environment
    when needed, destroyed again if this call created it). `resume`: a checkpoint file or
    folder. `quiet`: no console output (files are still written)."""
    created = init_distributed(cfg)
    try:
        return _Trainer(cfg, resume, quiet).run()
    finally:
        if created:
            destroy_process_group()


__all__ = ["PHASES", "RunLog", "TrainResult", "init_distributed", "lr_at", "train"]
