"""Checkpoints of a GPT-MoE run, independent of the placement and of the number of ranks.

    path = save(model, optimizer, balancer, out_dir, step=s, data_position=p, config=cfg.to_dict())
    ckpt = load(resolve("poise-out/train"))              # a file, or a run / checkpoints folder
    restore(model, optimizer, ckpt)                      # on the fresh (static-layout) model
    restore_plan(balancer, ckpt)                         # same world size: the saved placement

What a checkpoint holds (`torch.save` of plain tensors, lists and numbers; read back with
`weights_only=True`):

- `step` (optimizer steps done) and `data_position` (samples consumed, see `poise.train.data`);
- `model.dense`: every non-expert tensor of the state dict (replicated on all ranks: rank 0's);
- `model.experts[layer][name]`: `[E, ...]` weights of each expert by global expert id, gathered
  from the home slots (the owners' master copies) of all ranks;
- `optimizer`: AdamW's state the same way: dense tensors by parameter name, expert moments
  `[E, ...]` by expert id (from the homes), each tensor's step count;
- `plan`: the placement and assignment in force (home `[L, E]`, copies `[L, D, E]`, weights;
  with `auto`, its rivals' trails, `Plan.trails`, the same way), `balancer`: its step counter
  and load window `[S, L, D, E]`, so a resumed run re-plans exactly as an uninterrupted one
  would;
- `rng`: every rank's torch, CUDA, NumPy and Python random states;
- `world_size`, `ep_size` (ranks of an expert-parallel group: the world, or a layout's ep),
  `config`, `format`, `version`.

Because experts are stored by id, a checkpoint loads on any number of ranks that fits the
experts: each rank copies the rows of the experts its slots hold. With the same number of ranks
`restore_plan` re-applies the saved placement (a migration from the static layout); with another
number the run restarts from the static layout (the mathematics does not depend on placement).

In a SmartMoE layout (`poise.train.layout`: EP groups of ep ranks, each holding every expert)
the experts are gathered over one EP group, the one holding global rank 0 (`expert_group`; the
other groups hold the same experts), the random states of all D ranks over the world, and rank 0
writes. Such a checkpoint resumes in the same layout (with its placement) and, experts being
stored by id, on plain expert parallelism at any world size that fits (static placement).

Writes are atomic: rank 0 serialises into a temporary file in the same folder, flushes, fsyncs,
renames it over the target and fsyncs the folder; a crash at any point leaves the previous
checkpoint (and the `latest` pointer to it) intact. Files are `step-<step, 8 digits>.pt` in
`<out>/checkpoints/`, `latest` names the newest, older ones beyond `keep` are removed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import PoiseError
from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.nn.comm import comm_device
from poise.nn.moe import MoE, find_moe_layers
from poise.util.atomic import atomic_write_stream, atomic_write_text

FORMAT = "poise-train-checkpoint"
VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointError(PoiseError):
    """A checkpoint that cannot be found, read or used."""


# ------------------------------------------------------------------------------ file level
def _serialize(obj: Any, fh: BinaryIO) -> None:
    torch.save(obj, fh)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """`poise.util.atomic.atomic_write_stream`: a crash mid-write leaves the previous file."""
    atomic_write_stream(path, write)


def write_file(payload: dict[str, Any], path: str | Path) -> None:
    """Serialise a checkpoint payload to `path` atomically."""
    write_atomic(path, lambda fh: _serialize(payload, fh))


def read_file(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file (tensors on the CPU); `CheckpointError` when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError("no such checkpoint file", source=str(path))
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds on a damaged file
        raise CheckpointError(
            f"cannot read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            source=str(path),
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError("not a Poise training checkpoint", source=str(path))
    if ckpt.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint version {ckpt.get('version')}, this Poise reads {VERSION}",
            source=str(path),
            field="version",
        )
    return ckpt


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def resolve(path: str | Path) -> Path:
    """A checkpoint file from `path`: the file itself, or in a folder (a run's output folder or
    its `checkpoints/`) the one `latest` names, else the highest step."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise CheckpointError("no such checkpoint file or folder", source=str(p), field="resume")
    if (p / "checkpoints").is_dir() and not (p / "latest").exists():
        p = p / "checkpoints"
    latest = p / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        if (p / name).is_file():
            return p / name
    found = sorted(p.glob("step-*.pt"))
    if not found:
        raise CheckpointError("no checkpoint in this folder", source=str(p), field="resume")
    return found[-1]


def publish(path: Path, keep: int) -> None:
    """Point `latest` at `path` (atomically) and remove older checkpoints beyond `keep`."""
    folder = path.parent
    atomic_write_text(folder / "latest", path.name + "\n")
    for old in sorted(folder.glob("step-*.pt"))[:-keep]:
        if old != path:
            old.unlink(missing_ok=True)


# --------------------------------------------------------------------------- model level
def _world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def expert_layer_names(model: nn.Module) -> dict[int, str]:
    """`{id(moe): module name}` of the model's MoE layers."""
    return {id(m): name for name, m in model.named_modules() if isinstance(m, MoE)}


def _expert_param_names(model: nn.Module) -> set[str]:
    names = set()
    layers = expert_layer_names(model)
    for m in find_moe_layers(model):
        for w_name in ("w_in", "w_gate", "w_out"):
            if getattr(m.experts, w_name) is not None:
                names.add(f"{layers[id(m)]}.experts.{w_name}")
    return names


def _holds_rank0(group: Any) -> bool:
    """Whether global rank 0 belongs to `group` (None or the world: yes)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return True
    if group is dist.group.WORLD:
        return True
    return 0 in dist.get_process_group_ranks(group)


def _gather_rows(t: torch.Tensor, moe: MoE, group: Any, world: int) -> torch.Tensor:
    """`[E, ...]` from `t [S, ...]`: each expert's row from its home slot, summed to global
    rank 0 over `group` (which must hold it)."""
    full = torch.zeros((moe.num_experts, *t.shape[1:]), dtype=t.dtype, device=t.device)
    slots = moe.routing.slots
    for slot, e in enumerate(slots.expert.tolist()):
        if e >= 0 and slots.home[slot]:
            full[e] = t[slot].detach()
    if world > 1:
        buf = full.to(comm_device(group, t.device))
        dist.reduce(buf, dst=0, group=group)
        full = buf
    return full.cpu()


def _param_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """`{id(param): index}` as `optimizer.state_dict()` numbers them."""
    index, i = {}, 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            index.setdefault(id(p), i)
            i += 1
    return index


def capture_rng() -> dict[str, Any]:
    """This process's random states (torch, CUDA, NumPy, Python) as checkpoint-safe values."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gauss": float(np_state[4]),
        },
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gauss"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def plan_to_payload(plan: Plan) -> dict[str, Any]:
    a = plan.assignment
    return {
        "policy": plan.policy,
        "home": torch.from_numpy(np.asarray(plan.placement.home, dtype=np.int64)),
        "copies": torch.from_numpy(np.asarray(plan.placement.copies, dtype=np.int64)),
        "slots_per_device": int(plan.placement.slots_per_device),
        "weights": torch.from_numpy(np.asarray(a.weights, dtype=np.float64)),
        "group_weights": None
        if a.group_weights is None
        else torch.from_numpy(np.asarray(a.group_weights, dtype=np.float64)),
        "group_size": int(a.group_size),
        "by_counts": bool(a.by_counts),
        # `auto`'s trails (its rivals' own plans), so a resumed run re-plans as the first would.
        "trails": {name: plan_to_payload(trail) for name, trail in plan.trails.items()},
    }


def plan_from_payload(p: dict[str, Any], previous: Placement | None, spec: Any) -> Plan:
    placement = Placement(
        home=p["home"].numpy().astype(np.int64),
        copies=p["copies"].numpy().astype(np.int32),
        slots_per_device=int(p["slots_per_device"]),
    )
    gw = p["group_weights"]
    assignment = Assignment(
        p["weights"].numpy(),
        None if gw is None else gw.numpy(),
        int(p["group_size"]),
        bool(p.get("by_counts", False)),  # older checkpoints: fixed shares
    )
    plan = Plan(
        str(p["policy"]), placement, assignment, transfers_between(previous, placement, spec)
    )
    plan.validate()
    # Checkpoints written before trails existed have none: `auto` then starts them afresh.
    for name, trail in p.get("trails", {}).items():
        plan.trails[str(name)] = plan_from_payload(trail, None, spec)
    return plan


def snapshot(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    balancer: Any,
    *,
    step: int,
    data_position: int,
    config: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    group: Any = None,
    expert_group: Any = None,
) -> dict[str, Any] | None:
    """The checkpoint payload (collective: call on every rank of `group`, the world by default);
    global rank 0 gets it, others None. `expert_group`: this rank's expert-parallel group
    (default `group`); experts are gathered only over the one that holds rank 0."""
    world, rank = _world(group)
    ep_group = group if expert_group is None else expert_group
    ep_world = _world(ep_group)[0]
    gather = _holds_rank0(ep_group)
    layers = expert_layer_names(model)
    expert_names = _expert_param_names(model)
    dense = {
        k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in expert_names
    }
    index = _param_index(optimizer)
    opt_state = optimizer.state_dict()["state"]
    dense_opt = {}
    for name, p in model.named_parameters():
        if name in expert_names:
            continue
        st = opt_state.get(index.get(id(p), -1))
        if st:
            dense_opt[name] = {
                k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()
            }
    experts: dict[str, dict[str, torch.Tensor]] = {}
    experts_opt: dict[str, dict[str, Any]] = {}
    for moe in find_moe_layers(model) if gather else []:
        lname = layers[id(moe)]
        experts[lname] = {}
        for w_name in ("w_in", "w_gate", "w_out"):
            w = getattr(moe.experts, w_name)
            if w is None:
                continue
            experts[lname][w_name] = _gather_rows(w, moe, ep_group, ep_world)
            st = optimizer.state.get(w, {})
            entry: dict[str, Any] = {}
            for k, v in st.items():
                if k in MOMENTS:
                    entry[k] = _gather_rows(v, moe, ep_group, ep_world)
                else:
                    entry[k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
            experts_opt[f"{lname}.{w_name}"] = entry
    rng = [None] * world
    mine = capture_rng()
    if world > 1:
        dist.all_gather_object(rng, mine, group=group)
    else:
        rng = [mine]
    if rank != 0:
        return None
    payload: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "data_position": int(data_position),
        "world_size": world,
        "ep_size": ep_world,
        "config": dict(config or {}),
        "model": {"dense": dense, "experts": experts},
        "optimizer": {"dense": dense_opt, "experts": experts_opt},
        "plan": None,
        "balancer": None,
        "rng": rng,
        "extra": dict(extra or {}),
    }
    if balancer is not None:
        payload["plan"] = plan_to_payload(balancer.plan)
        window = np.stack(list(balancer.window)) if balancer.window else None
        payload["balancer"] = {
            "step": int(balancer.steps_done),
            "window": None if window is None else torch.from_numpy(window.astype(np.int64)),
        }
    return payload


def save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    balancer: Any,
    out: str | Path,
    *,
    step: int,
    data_position: int,
    config: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    group: Any = None,
    expert_group: Any = None,
) -> Path:
    """Gather, write `<out>/checkpoints/step-NNNNNNNN.pt` (the step, 8 digits) atomically on
    rank 0, point `latest` at it, prune old ones, and wait for rank 0 (collective over `group`;
    `expert_group` as in `snapshot`). Returns the path."""
    payload = snapshot(
        model,
        optimizer,
        balancer,
        step=step,
        data_position=data_position,
        config=config,
        extra=extra,
        group=group,
        expert_group=expert_group,
    )
    path = checkpoint_dir(out) / f"step-{step:08d}.pt"
    error = None
    if payload is not None:
        try:
            write_file(payload, path)
            publish(path, keep)
        except OSError as exc:
            error = exc
    if _world(group)[0] > 1:
        dist.barrier(group=group)
    if error is not None:
        raise CheckpointError(f"cannot write checkpoint: {error}", source=str(path))
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read the checkpoint that `path` resolves to (see `resolve`); adds `path` to it."""
    file = resolve(path)
    ckpt = read_file(file)
    ckpt["path"] = str(file)
    return ckpt


@torch.no_grad()
def restore(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
    """Load weights and optimizer state into a freshly built model (its MoE layers in their
    static layout, no replicas) and its optimizer. Works at any number of ranks that fits."""
    source = ckpt.get("path", "checkpoint")
    expert_names = _expert_param_names(model)
    dense = ckpt["model"]["dense"]
    expected = {k for k in model.state_dict() if k not in expert_names}
    missing, unexpected = expected - set(dense), set(dense) - expected
    if missing or unexpected:
        what = (
            f"missing {sorted(missing)[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        )
        raise CheckpointError(
            f"the model does not match the checkpoint ({what}): same model settings?",
            source=source,
            field="model",
        )
    try:
        model.load_state_dict(dense, strict=False)
    except RuntimeError as exc:
        raise CheckpointError(
            f"the model's shapes do not match the checkpoint: {str(exc).splitlines()[-1]}",
            source=source,
            field="model",
        ) from None
    layers = expert_layer_names(model)
    saved = ckpt["model"]["experts"]
    for moe in find_moe_layers(model):
        lname = layers[id(moe)]
        if lname not in saved:
            raise CheckpointError(f"no experts for layer {lname}", source=source, field="model")
        try:
            moe.load_expert_weights(saved[lname])
        except (PoiseError, KeyError) as exc:
            raise CheckpointError(f"layer {lname}: {exc}", source=source, field="model") from None
    _restore_optimizer(model, optimizer, ckpt, expert_names, source)


def _restore_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ckpt: dict[str, Any],
    expert_names: set[str],
    source: str,
) -> None:
    index = _param_index(optimizer)
    state: dict[int, dict[str, Any]] = {}
    dense_opt = ckpt["optimizer"]["dense"]
    for name, p in model.named_parameters():
        if name in expert_names or name not in dense_opt:
            continue
        state[index[id(p)]] = dict(dense_opt[name])
    layers = expert_layer_names(model)
    experts_opt = ckpt["optimizer"]["experts"]
    for moe in find_moe_layers(model):
        lname = layers[id(moe)]
        slots = moe.routing.slots
        for w_name in ("w_in", "w_gate", "w_out"):
            w = getattr(moe.experts, w_name)
            if w is None:
                continue
            saved = experts_opt.get(f"{lname}.{w_name}")
            if not saved:
                continue
            entry: dict[str, Any] = {}
            for k, v in saved.items():
                if k in MOMENTS:
                    rows = torch.zeros(w.shape, dtype=v.dtype)
                    for slot, e in enumerate(slots.expert.tolist()):
                        if e >= 0 and slots.home[slot]:
                            rows[slot] = v[e]
                    entry[k] = rows
                else:
                    entry[k] = v
            state[index[id(w)]] = entry
    sd = optimizer.state_dict()
    try:
        optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(
            f"optimizer state does not fit: {exc}", source=source, field="optimizer"
        ) from None


def restore_plan(balancer: Any, ckpt: dict[str, Any], world: int | None = None) -> bool:
    """Re-apply the saved placement and load window when the world size (`world`, default the
    balancer's), the expert-parallel group size and the slots match (collective over the
    balancer's group); returns whether it did. Always restores the balancer's step counter."""
    saved = ckpt.get("balancer")
    if saved is not None:
        balancer.steps_done = int(saved["step"])
    plan = ckpt.get("plan")
    if plan is None or saved is None:
        return False
    world = balancer.world_size if world is None else int(world)
    ep_size = int(ckpt.get("ep_size", ckpt["world_size"]))  # older checkpoints: plain EP
    if (
        int(ckpt["world_size"]) != world
        or ep_size != balancer.world_size
        or int(plan["slots_per_device"]) != balancer.slots
    ):
        return False
    balancer.window.clear()
    if saved["window"] is not None:
        for row in saved["window"].numpy():
            balancer.window.append(row)
    restored = plan_from_payload(plan, balancer.plan.placement, balancer.spec())
    # this run's splitting setting, whatever the saved run's was
    restored.assignment = restored.assignment.with_split(balancer.split_tokens)
    balancer.apply(restored)
    return True


def restore_rng(ckpt: dict[str, Any], rank: int) -> None:
    """This rank's saved random states (rank r of a different world takes r mod the old one)."""
    states = ckpt["rng"]
    set_rng(states[rank % len(states)])


__all__ = [
    "CheckpointError",
    "capture_rng",
    "checkpoint_dir",
    "load",
    "publish",
    "read_file",
    "resolve",
    "restore",
    "restore_plan",
    "restore_rng",
    "save",
    "set_rng",
    "snapshot",
    "write_atomic",
    "write_file",
]
