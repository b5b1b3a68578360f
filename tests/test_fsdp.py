"""FSDP2 beside expert parallelism on 2 gloo ranks (`poise.nn.fsdp`, `fsdp: true`).

One spawn of 2 ranks: `poise train`'s all-reduce path and its FSDP2 path for 20 steps, balanced
(`auto` on a test cluster where replicas pay, so plans change) with clipping on at every step;
the FSDP2 run resumed from its DCP checkpoint of step 10 on both paths, and on the FSDP2 path in
a layout with expert-data-parallel replicas and micro-batches; `fully_shard` applied
naively over expert-parallel weights; a generic DCP save of the state dict of a model whose
experts moved between ranks, loaded into a static one, and of its optimizer state (AdamW moments
keyed per expert, `register_expert_optimizer_keys`); and the gradient norm, clipping and
`HomeRowsAdamW` on DTensor gradients against the all-reduce path's, tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poise.runtime.launch import run_ranks

from .helpers import slow_gemm_cluster, tiny_train_config

pytestmark = pytest.mark.dist

STEPS = 20
TOL = 1e-5
# every plan that differs is adopted (the test cluster's slow GEMMs make replicas pay); a clip
# below the tiny model's gradient norm, so every step clips
BALANCED = dict(policy="auto", balance_guard=False, self_calibrate=False, clip=0.05)
SMALL = {"context": 16, "layers": 2}  # the layer-level checks: 2 MoE layers of 8 experts


def _cfg(root: str, name: str, **kw):
    return tiny_train_config(root, name, steps=STEPS, cluster=f"{root}/slow-gemms.yaml",
                             **BALANCED, **kw)  # fmt: skip


def _naive_fully_shard(rank: int) -> dict:
    """`fully_shard` over a whole expert-parallel model, and over one layer's experts: each
    refused at the first forward with the one error (its field and message)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from poise.core.errors import ConfigError
    from poise.models.gpt import GPTMoE, model_config
    from poise.nn import apply_expert_parallel, shard_dense

    mcfg = model_config("tiny", SMALL)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    out: dict = {}
    for case in ("whole model", "experts alone", "not expert parallel"):
        model = GPTMoE(mcfg, seed=0)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        try:
            if case == "not expert parallel":
                shard_dense(model, mesh)
            else:
                apply_expert_parallel(model, mesh)
                fully_shard(model.blocks[1].ffn.experts if case == "experts alone" else model)
            model(x)
            out[case] = None
        except ConfigError as exc:
            out[case] = (exc.field, exc.message)
    return out


def _moved_placement(layers: int, experts: int, slots: int):
    """Homes moved across the 2 ranks (rank 0: 1, 2, 4, 7; rank 1: 0, 3, 5, 6) and a replica
    of expert 1 on rank 1: a plan the Balancer could adopt."""
    import numpy as np

    from poise.core.placement import Assignment, Placement

    home = np.tile(np.array([1, 0, 0, 1, 0, 1, 1, 0]), (layers, 1))
    assert home.shape[1] == experts
    placement = Placement.from_homes(home, 2, slots)
    placement.copies[:, 1, 1] = 1
    placement.validate()
    return placement, Assignment.to_home(placement)


def _generic_dcp(rank: int, root: str) -> dict:
    """`dcp.save` of an FSDP2 + EP model's state dict (`get_model_state_dict`, as torchtitan's
    checkpointer takes it) whose experts moved (and one replicated), loaded with `dcp.load` and
    `load_state_dict` into a fresh static one: every expert's weights and every dense tensor
    back as saved."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from poise.models.gpt import GPTMoE, model_config
    from poise.nn import apply_expert_parallel, ep_mesh, find_moe_layers, shard_dense, slot_maps

    mcfg = model_config("tiny", SMALL)
    full = GPTMoE(mcfg, seed=3)  # one device: every expert
    mesh = ep_mesh()
    slots = mcfg.num_experts // 2 + 1
    model = GPTMoE(mcfg, seed=3)
    apply_expert_parallel(model, mesh["ep"], num_slots=slots)
    placement, assignment = _moved_placement(mcfg.moe_layers, mcfg.num_experts, slots)
    for layer, (moe, src) in enumerate(zip(find_moe_layers(model), find_moe_layers(full),
                                           strict=True)):  # fmt: skip
        moe.set_routing(placement, assignment, slot_maps(placement, layer, slots)[rank], layer)
        moe.load_expert_weights({n: w for n, w in src.experts.named_parameters()})
    shard_dense(model, mesh)
    state = get_model_state_dict(model)  # what torchtitan's checkpointer saves
    mine = sorted(k for k in state if ".experts." in k)
    dcp.save(state, checkpoint_id=f"{root}/generic")
    saved = dcp.FileSystemReader(f"{root}/generic").read_metadata().state_dict_metadata

    fresh = GPTMoE(mcfg, seed=4)  # other weights, the static placement
    apply_expert_parallel(fresh, mesh["ep"], num_slots=slots)
    shard_dense(fresh, mesh)
    back = fresh.state_dict()
    dcp.load(back, checkpoint_id=f"{root}/generic")
    fresh.load_state_dict(back)
    experts_equal = all(
        torch.equal(w[slot], getattr(src.experts, name)[e])
        for moe, src in zip(find_moe_layers(fresh), find_moe_layers(full), strict=True)
        for name, w in moe.experts.named_parameters()
        for slot, e in enumerate(moe.routing.slots.expert.tolist())
        if e >= 0
    )
    reference = dict(full.named_parameters())
    dense_equal = all(
        torch.equal(p.full_tensor(), reference[n]) for n, p in fresh.dense_named_parameters()
    )
    return {
        "mine": mine,
        "saved_expert_keys": sorted(k for k in saved if ".experts." in k),
        "experts_equal": experts_equal,
        "dense_equal": dense_equal,
    }


def _generic_optimizer_dcp(rank: int, root: str, register: bool = True) -> dict:
    """`dcp.save` of the AdamW state of an FSDP2 + EP model whose experts moved, taken as
    torchtitan's checkpointer takes it (`get_optimizer_state_dict`, flattened), after
    `register_expert_optimizer_keys` (`register`); loaded with `dcp.load` and
    `set_optimizer_state_dict` into a fresh static model's optimizer. Returns the saved keys of
    the expert moments and, per held slot, whether its moments are its expert's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from poise.models.gpt import GPTMoE, model_config
    from poise.nn import apply_expert_parallel, ep_mesh, find_moe_layers, shard_dense, slot_maps
    from poise.runtime.optimizer_keys import register_expert_optimizer_keys

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    mcfg = model_config("tiny", SMALL)
    mesh = ep_mesh()
    slots = mcfg.num_experts // 2 + 1
    placement, assignment = _moved_placement(mcfg.moe_layers, mcfg.num_experts, slots)

    def model_and_optimizer(moved: bool):
        model = GPTMoE(mcfg, seed=3)
        apply_expert_parallel(model, mesh["ep"], num_slots=slots)
        if moved:
            for layer, moe in enumerate(find_moe_layers(model)):
                maps = slot_maps(placement, layer, slots)[rank]
                moe.set_routing(placement, assignment, maps, layer)
        shard_dense(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if register:
            register_expert_optimizer_keys(model, optimizer)
        return model, optimizer

    model, optimizer = model_and_optimizer(moved=True)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    saved_moments = {  # (layer, weight, expert) -> exp_avg row at its home
        (layer, name, e): optimizer.state[w]["exp_avg"][slot].clone()
        for layer, moe in enumerate(find_moe_layers(model))
        for name, w in moe.experts.named_parameters()
        for slot, e in enumerate(moe.routing.slots.expert.tolist())
        if e >= 0 and moe.routing.slots.home[slot]
    }
    dcp.save(get_optimizer_state_dict(model, optimizer, options=flat),
             checkpoint_id=f"{root}/generic-optim-{register}")  # fmt: skip
    meta = dcp.FileSystemReader(f"{root}/generic-optim-{register}").read_metadata()
    saved = sorted(k for k in meta.state_dict_metadata if ".experts." in k and "exp_avg." in k)

    fresh, fresh_optimizer = model_and_optimizer(moved=False)
    state = get_optimizer_state_dict(fresh, fresh_optimizer, options=flat)
    dcp.load(state, checkpoint_id=f"{root}/generic-optim-{register}")
    set_optimizer_state_dict(fresh, fresh_optimizer, state, options=flat)
    gathered: list = [None, None]
    torch.distributed.all_gather_object(gathered, {k: v.tolist() for k, v in
                                                   saved_moments.items()})  # fmt: skip
    every = {k: torch.tensor(v) for part in gathered for k, v in part.items()}
    equal = [
        torch.equal(fresh_optimizer.state[w]["exp_avg"][slot], every[layer, name, e])
        for layer, moe in enumerate(find_moe_layers(fresh))
        for name, w in moe.experts.named_parameters()
        for slot, e in enumerate(moe.routing.slots.expert.tolist())
        if e >= 0
    ]
    return {"saved": saved, "equal": equal}


def _clip_and_step(rank: int) -> dict:
    """One step of the same model on the all-reduce path and on the FSDP2 path: the global
    norm, the clipped gradients and the parameters after a `HomeRowsAdamW` step, compared
    (the FSDP2 path's DTensors gathered whole)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    from poise.models.gpt import GPTMoE, model_config
    from poise.nn import apply_expert_parallel, ep_mesh, shard_dense
    from poise.runtime.home_optimizer import HomeRowsAdamW, home_rows
    from poise.train.grad_sync import clip_global_norm, sync_dense

    mcfg = model_config("tiny", SMALL)
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randint(0, 256, (2, 16), generator=gen)
    y = torch.randint(0, 256, (2, 16), generator=gen)
    cpu = torch.device("cpu")
    mesh = ep_mesh()
    out: dict = {}
    runs = {}
    for path in ("allreduce", "fsdp"):
        model = GPTMoE(mcfg, seed=1)
        apply_expert_parallel(model, mesh["ep"] if path == "fsdp" else dist.group.WORLD)
        if path == "fsdp":
            shard_dense(model, mesh)
        opt = HomeRowsAdamW(model.parameters(), home_rows(model), lr=1e-2, weight_decay=0.1)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (2 * y.numel())
        loss.backward()
        dense = [p for _, p in model.dense_named_parameters()]
        sync_dense(dense, torch.zeros(1), 2, cpu)
        norm = clip_global_norm(model, dense, 2, mesh["ep"].get_group(), cpu, clip=0.01)
        grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
        opt.step()
        runs[path] = (norm, grads, {n: _whole(p) for n, p in model.named_parameters()})
        out[f"{path}_kinds"] = sorted({type(p).__name__ for p in model.parameters()})
    (norm_a, grads_a, params_a), (norm_b, grads_b, params_b) = runs["allreduce"], runs["fsdp"]
    out["norms"] = (norm_a, norm_b)
    out["grad_diff"] = max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a)
    out["param_diff"] = max(float((params_a[n] - params_b[n]).abs().max()) for n in params_a)
    out["grad_scale"] = max(float(g.abs().max()) for g in grads_a.values())
    return out


def _whole(t):
    """A DTensor gathered whole (collective), a plain tensor as it is; detached."""
    from poise.nn.fsdp import is_dtensor

    return (t.full_tensor() if is_dtensor(t) else t).detach().clone()


def _two_ranks(rank: int, world: int, root: str) -> dict:
    from poise.train import train

    allreduce = train(_cfg(root, "allreduce"), quiet=True)
    fsdp_cfg = _cfg(root, "fsdp", fsdp=True, checkpoint_every=10, keep_checkpoints=3)
    fsdp = train(fsdp_cfg, quiet=True)
    step10 = f"{root}/fsdp/checkpoints/step-00000010"
    resumed = train(fsdp_cfg.replace(out=f"{root}/fsdp-resumed"), resume=step10, quiet=True)
    # the all-reduce path resumes an FSDP2 checkpoint: the files are the same
    crossed = train(_cfg(root, "crossed"), resume=step10, quiet=True)
    # on into a layout's expert-data-parallel replicas (every rank all experts, "ep=1"), with
    # 2 micro-batches of half the batch: FSDP reduces once a step, the losses unchanged
    edp_cfg = _cfg(root, "fsdp-edp", fsdp=True, layout="ep=1", batch=4, micro_batches=2)
    edp = train(edp_cfg, resume=step10, quiet=True)
    runs = {"allreduce": allreduce, "fsdp": fsdp, "resumed": resumed, "crossed": crossed,
            "edp": edp}  # fmt: skip
    out = {k: (r.steps, r.losses, r.plan_changes, r.resumed_plan) for k, r in runs.items()}
    out["refused"] = _naive_fully_shard(rank)
    out["dcp"] = _generic_dcp(rank, root)
    out["optim_dcp"] = _generic_optimizer_dcp(rank, root)
    out["optim_dcp_plain"] = _generic_optimizer_dcp(rank, root, register=False)
    out["clip"] = _clip_and_step(rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("fsdp")
    slow_gemm_cluster(2).save(root / "slow-gemms.yaml")
    return root, run_ranks(_two_ranks, 2, str(root), timeout_s=400)


def _grad_norms(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["grad_norm"] for line in lines if '"grad_norm"' in line]


def test_the_fsdp_path_trains_with_the_losses_of_the_all_reduce_path(runs) -> None:
    root, ranks = runs
    out = ranks[0]
    _, ar_losses, ar_changes, _ = out["allreduce"]
    steps, losses, changes, _ = out["fsdp"]
    assert steps == list(range(1, STEPS + 1))
    assert ar_changes > 0 and changes > 0  # balanced: the experts moved or replicated
    assert max(abs(a - b) for a, b in zip(ar_losses, losses, strict=True)) <= TOL
    assert ranks[1]["fsdp"][1] == losses  # every rank reports the same global losses
    # clipping on at every step (the norm above the clip), the norms alike on both paths
    ar_norms, norms = _grad_norms(root / "allreduce"), _grad_norms(root / "fsdp")
    assert len(norms) == STEPS and min(norms) > BALANCED["clip"]
    assert max(abs(a - b) / a for a, b in zip(ar_norms, norms, strict=True)) <= TOL


def test_the_fsdp_path_takes_a_layout_and_micro_batches(runs) -> None:
    _, ranks = runs
    _, ar_losses, _, _ = ranks[0]["allreduce"]
    steps, losses, _, _ = ranks[0]["edp"]
    assert steps == list(range(11, STEPS + 1))
    assert max(abs(a - b) for a, b in zip(ar_losses[10:], losses, strict=True)) <= TOL


def test_an_fsdp_checkpoint_resumes_on_either_path(runs) -> None:
    _, ranks = runs
    out = ranks[0]
    _, losses, _, _ = out["fsdp"]
    for name in ("resumed", "crossed"):
        steps, again, _, resumed_plan = out[name]
        assert steps == list(range(11, STEPS + 1)), name
        assert resumed_plan, name  # the saved placement re-applied
        assert max(abs(a - b) for a, b in zip(again, losses[10:], strict=True)) <= TOL, name


def test_fully_shard_over_expert_parallel_weights_is_refused(runs) -> None:
    _, ranks = runs
    for out in ranks:
        refused = out["refused"]
        field, message = refused["whole model"]
        assert field == "fsdp" and message.startswith("fully_shard manages this MoE layer's")
        assert refused["experts alone"] == refused["whole model"]
        field, message = refused["not expert parallel"]
        assert field == "fsdp" and message.startswith("shard_dense leaves the experts")


def test_a_generic_dcp_checkpoint_keeps_every_ranks_experts(runs) -> None:
    _, ranks = runs
    # each rank names its homes by global expert id; the checkpoint holds all 8 of each weight
    homes = {0: (1, 2, 4, 7), 1: (0, 3, 5, 6)}
    weights = [f"blocks.{b}.ffn.experts.{w}" for b in (0, 1) for w in ("w_gate", "w_in", "w_out")]
    for rank, out in enumerate(ranks):
        dcp = out["dcp"]
        assert dcp["mine"] == sorted(f"{w}.expert_{e}" for w in weights for e in homes[rank])
        assert dcp["saved_expert_keys"] == sorted(
            f"{w}.expert_{e}" for w in weights for e in range(8)
        )
        assert dcp["experts_equal"] and dcp["dense_equal"]


def test_a_generic_optimizer_checkpoint_keeps_every_ranks_expert_moments(runs) -> None:
    """With `register_expert_optimizer_keys`, torchtitan's way of checkpointing the optimizer
    saves every expert's moments once (from its home) and restores each into the slot of a
    fresh placement; without it, one key per weight and another expert's moments."""
    _, ranks = runs
    weights = [f"blocks.{b}.ffn.experts.{w}" for b in (0, 1) for w in ("w_gate", "w_in", "w_out")]
    for out in ranks:
        keys = out["optim_dcp"]["saved"]
        assert keys == sorted(f"state.{w}.exp_avg.expert_{e}" for w in weights for e in range(8))
        assert out["optim_dcp"]["equal"] and all(out["optim_dcp"]["equal"])
        assert not all(out["optim_dcp_plain"]["equal"])  # what the hooks prevent


def test_clipping_and_home_rows_adamw_take_dtensors(runs) -> None:
    _, ranks = runs
    for out in ranks:
        clip = out["clip"]
        assert clip["allreduce_kinds"] == ["Parameter"]
        assert clip["fsdp_kinds"] == ["DTensor", "Parameter"]  # dense sharded, experts not
        norm_a, norm_b = clip["norms"]
        assert norm_a > 0.01 and abs(norm_a - norm_b) <= TOL * norm_a
        assert clip["grad_diff"] <= 1e-7 * max(1.0, clip["grad_scale"])
        assert clip["param_diff"] <= 1e-6
