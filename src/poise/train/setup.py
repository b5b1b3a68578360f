"""Setting up one training rank: the process group, the device, seeds, the corpus, the
optimizer, the modelled cluster the Balancer plans on, the Balancer itself, the learning-rate
schedule, and the check that every rank runs the same config."""

from __future__ import annotations

import json
import math
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from poise.core.errors import ConfigError
from poise.models.gpt import GPTMoE
from poise.nn import comm
from poise.train.config import TrainConfig
from poise.train.data import Corpus, build_corpus
from poise.util.digest import digest


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based step `step`: linear warm-up, then cosine to `lr*min_lr_ratio`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def ranks_use_cuda(device: str, local_ranks: int, gpus: int) -> bool:
    """Whether `local_ranks` ranks on this host run on CUDA (NCCL), one GPU each, given the
    config's `device` ("auto", "cpu", "cuda") and the host's `gpus`.

    NCCL cannot put two ranks of one group on one GPU, so "auto" takes CUDA only where every
    local rank gets its own GPU (else the CPU and gloo), and "cuda" without enough GPUs is a
    `ConfigError` naming `device` (rather than NCCL's "duplicate GPU" or an invalid ordinal
    from deep inside `init_process_group`)."""
    if device == "cpu":
        return False
    if device == "cuda":
        if gpus == 0:
            raise ConfigError("CUDA was requested but is not available", field="device")
        if local_ranks > gpus:
            raise ConfigError(
                f"{local_ranks} ranks on this host need one GPU each (NCCL cannot share one "
                f"between ranks), and it has {gpus}: run at most {gpus} ranks here, or set "
                "device: cpu",
                field="device",
            )
        return True
    return 0 < local_ranks <= gpus


def host_gpus() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_ranks() -> int:
    """The ranks on this host (`plan_inputs.ranks_on_host`: the launcher's `LOCAL_WORLD_SIZE`,
    checked, else every rank of `WORLD_SIZE`)."""
    from poise.runtime.plan_inputs import ranks_on_host

    return ranks_on_host(int(os.environ.get("WORLD_SIZE", "1")))


def init_distributed(cfg: TrainConfig) -> bool:
    """Create the default process group from torchrun's environment if there is none and
    `WORLD_SIZE` > 1; returns whether it did. NCCL where every local rank has a GPU
    (`ranks_use_cuda`), else gloo."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    use_cuda = ranks_use_cuda(cfg.device, local_ranks(), host_gpus())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", timeout=timedelta(seconds=cfg.collective_timeout_s)
    )
    return True


def pick_device(cfg: TrainConfig) -> torch.device:
    """This rank's device: the GPU of its `LOCAL_RANK` under an NCCL group, the CPU under a
    gloo group (tests, CPU launches), and alone the GPU where `ranks_use_cuda` says so
    ("cuda" without any GPU is its error in every case)."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    alone_on_gpu = ranks_use_cuda(cfg.device, 1, host_gpus())
    if alone_on_gpu and not dist.is_initialized():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def config_digest(cfg: TrainConfig) -> int:
    """A 62-bit digest of every config field (what all ranks must agree on)."""
    return digest(json.dumps(cfg.to_dict(), sort_keys=True, default=str))


def check_config_agrees(cfg: TrainConfig, world: int, rank: int) -> None:
    """Compare the config digest across the ranks (one all-gather, under the process group's
    timeout); a rank that disagrees is one `ConfigError` on every rank, not a hang later in a
    collective whose shapes differ (DeepSpeed-MoE #6809, Tutel #173). The digest is a CPU
    tensor: `comm.all_gather` stages it on the GPU under NCCL, which refuses CPU tensors."""
    if world <= 1:
        return
    mine = torch.tensor([config_digest(cfg)], dtype=torch.long)
    got = [torch.empty_like(mine) for _ in range(world)]
    comm.all_gather(got, mine)
    digests = [int(t) for t in got]
    others = [r for r, d in enumerate(digests) if d != digests[rank]]
    if others:
        raise ConfigError(
            f"the training config on rank {rank} differs from rank(s) {others}: start every "
            "rank with the same config and options",
            source="config",
            field="ranks",
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_corpus(cfg: TrainConfig, local_rank: int, world: int) -> Corpus:
    """Build the corpus cache on each node's local rank 0 first, then read it everywhere."""
    kw = {"glob": cfg.data_glob, "cache_dir": cfg.cache_dir, "val_fraction": cfg.val_fraction}
    if world == 1:
        return build_corpus(cfg.data, **kw)
    corpus = None
    if local_rank == 0:
        corpus = build_corpus(cfg.data, **kw)
    comm.barrier()
    return corpus if corpus is not None else build_corpus(cfg.data, **kw)


def make_optimizer(model: GPTMoE, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (and expert tensors), none on norm weights. Stacked
    expert tensors are stepped on their home rows only (`HomeRowsAdamW`: a balancing run's
    spare slots cost no optimizer work; the mathematics is AdamW's)."""
    from poise.runtime.home_optimizer import HomeRowsAdamW, home_rows

    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return HomeRowsAdamW(
        groups, home_rows(model), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )


def make_cluster(cfg: TrainConfig, world: int, ep: int | None = None):
    """The modelled cluster a Balancer plans on: `ep` devices (default `world`), the EP group.
    `cfg.cluster` may name a cluster of `ep` devices, or of `world` devices, of which an EP group
    (contiguous ranks) is a part (`poise.layouts.pool.sub_cluster`)."""
    from poise.core.presets import get_cluster
    from poise.layouts.pool import sub_cluster
    from poise.runtime.plan_inputs import default_cluster, ranks_on_host

    ep = world if ep is None else ep
    if cfg.cluster is None:  # CPU ranks: all `world` of them share this host's cores
        on_cpu = cfg.device == "cpu" or not torch.cuda.is_available()
        return default_cluster(ep, ranks_on_host=ranks_on_host(world) if on_cpu else None)
    cluster = get_cluster(cfg.cluster)
    if ep != world and cluster.num_devices == world:
        part = sub_cluster(cluster, ep)
        if part is None:
            raise ConfigError(
                f"an EP group of {ep} ranks does not nest in its nodes and domains",
                source=cfg.cluster,
                field="cluster",
            )
        return part
    if cluster.num_devices == ep != world:
        return cluster
    if cluster.num_devices != world:
        groups = f" (EP groups of {ep})" if ep != world else ""
        raise ConfigError(
            f"has {cluster.num_devices} devices but {world} ranks run{groups}",
            source=cfg.cluster,
            field="cluster",
        )
    return cluster


def shared_cores_note(balancer) -> str | None:
    """The start-up line saying that a guarded, balancing `balancer`'s ranks share their cores
    and that it plans homes only there (the controller's `ratio["replicas"]` starts at 0), so
    that a run that never places a replica says why; None elsewhere."""
    if not (balancer.balancing and balancer.config.guard and balancer.cores_shared()):
        return None
    cores = balancer.cluster.host.shared_cores
    return (
        f"note: the {balancer.world_size} ranks share {cores:g} cores' worth of this host, so "
        "the guard plans homes only: a replica's Trans and Agg would be copies on the cores "
        "the experts compute on (balance_guard: false lifts it)"
    )


def balancer_config(cfg: TrainConfig, world: int, ep: int):
    """The `BalancerConfig` of a run of `cfg` (`poise.runtime.config`), over `ep` of `world`
    ranks; free balancing's settings where that instrument is on (`poise.train.instruments`)."""
    from poise.runtime.config import BalancerConfig
    from poise.train.instruments import FreeBalancing

    config = BalancerConfig(
        plan_lag=cfg.plan_lag,
        predictor=cfg.predictor,
        total_steps=cfg.steps,
        cluster=make_cluster(cfg, world, ep),
        guard=cfg.balance_guard,
        probe_every=cfg.probe_every,
        split_tokens=cfg.split_tokens,
        retarget=cfg.retarget,
        host_link=cfg.host_link,
        separate_transfers=cfg.separate_transfers,
        compression=cfg.compression,
        calibrate=cfg.self_calibrate,
    )
    return FreeBalancing.settings(config) if cfg.free_balancing else config


def make_balancer(
    cfg: TrainConfig,
    model: GPTMoE,
    optimizer: torch.optim.Optimizer,
    world: int,
    ep: int,
    group,
    groups=None,
):
    """The run's `poise.runtime.balancer.Balancer` from `cfg`: over `model`'s MoE layers on the
    EP `group` (None: one rank); with a hybrid layout's `groups` (`poise.runtime.smartmoe.
    create_groups`), the world votes on plans and the transfers take the EP transfer group
    where `cfg.separate_transfers`."""
    from poise.runtime.balancer import Balancer

    moves = groups.ep_transfer if groups is not None and cfg.separate_transfers else None
    return Balancer(
        model,
        optimizer,
        cfg.policy,
        cfg.replan_every,
        balancer_config(cfg, world, ep),
        group=group,
        vote_group=dist.group.WORLD if groups is not None else None,
        transfer_group=moves,
    )
