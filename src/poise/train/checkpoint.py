"""Checkpoints of a GPT-MoE run in `torch.distributed.checkpoint` (DCP) format, independent of
the placement and of the number of ranks.

    path = save(model, optimizer, balancer, out_dir, step=s, data_position=p, config=cfg.to_dict())
    ckpt = load(resolve("poise-out/train"))              # a folder: the checkpoint, or a run's
    restore(model, optimizer, ckpt)                      # collective, on the fresh static model
    restore_plan(balancer, ckpt)                         # same world size: the saved placement

A checkpoint is a folder `<out>/checkpoints/step-<step, 8 digits>/` holding

- DCP's files (`.metadata`, one `__<rank>_0.distcp` per rank that saved tensors), written by
  every rank in parallel with `torch.distributed.checkpoint.save`: the dense tensors and their
  AdamW state once (global rank 0), each expert's weights and moments by global expert id from
  its home rank (keys in `poise.train.ckpt_state`);
- `poise.pt` (rank 0, `torch.save` of plain values, read with `weights_only=True`): `format`,
  `version`, `step` (optimizer steps done), `data_position` (samples consumed, see
  `poise.train.data`), `plan` (the placement and assignment in force: home `[L, E]`, copies
  `[L, D, E]`, weights; with `auto`, its rivals' trails), `balancer` (its step counter, load
  window `[S, L, D, E]`, its `learned` state, `Planning.learned_state`: the controller's, the
  switches' price and the fit, and its `last_candidate`, the plan its next job backtests; so a
  resumed run re-plans from what the interrupted one knew), `rng`
  (every rank's torch, CUDA, NumPy and Python random states), `world_size`, `ep_size` (ranks of
  an expert-parallel group: the world, or a layout's ep), `config`, `extra`.

Resharding: DCP reads by key, and experts are keyed by id, so a rank of any world that fits the
experts asks for exactly the experts its slots hold. With the same number of ranks
`restore_plan` re-applies the saved placement (a migration from the static layout); with another
number the run restarts from the static layout (the mathematics does not depend on placement).
In a SmartMoE layout (EP groups of ep ranks, each holding every expert) the EP group holding
global rank 0 saves the experts; such a checkpoint resumes in the same layout (with its
placement) and on plain expert parallelism at any world size that fits (static placement).

Writes are atomic: every rank writes into `<out>/checkpoints/.step-NNNNNNNN.tmp/` (DCP fsyncs
each file), rank 0 adds `poise.pt` (itself written atomically), fsyncs the folder and renames it
to `step-NNNNNNNN`, then points `latest` at it and removes older ones beyond `keep`. A crash at
any point leaves the previous checkpoint and `latest` intact; a half-written `.tmp` folder is
ignored and removed by the next save.

Checksums (`poise.train.checkpoint_manifest`): the last file written into the folder, before the
rename, is `manifest.json` (atomically, by rank 0): the size and SHA-256 of every other file of the
checkpoint. Each rank hashes the DCP shards it wrote itself (`__<rank>_*.distcp`, in parallel, once
`dcp.save` has returned on every rank) and sends the digests to rank 0 with one gather; rank 0
hashes what no rank reported (`.metadata`, `poise.pt`, any shard named otherwise) and writes the
manifest, so it covers every rank's files whoever wrote them. `resolve` (and so `load`, and every
`--resume`) verifies a checkpoint against its manifest before anything of it is used: a checkpoint
without a valid manifest, with a file missing, of another size or of another digest is not used.
From a run folder or a `checkpoints/` folder the newest checkpoint that verifies is chosen, each
one skipped named on one line with why; a checkpoint folder named itself must verify. Checkpoints
written before manifests existed cannot be verified and are refused as such (nothing is trained on
unverified data).

Checkpoints of Poise before DCP (one `step-NNNNNNNN.pt` file, format `poise-train-checkpoint`
version 1) are refused with one error naming that format.
"""

from __future__ import annotations

import random
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import PoiseError
from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.nn import comm
from poise.nn.fsdp import is_dtensor
from poise.train.checkpoint_manifest import (
    MANIFEST,
    META,
    CheckpointError,
    own_shards,
    verify,
    write_manifest,
)
from poise.train.ckpt_state import (
    dense_state,
    expert_param_names,
    expert_weights,
    held_slots,
    home_slots,
    optimizer_state_names,
    state_to_save,
)
from poise.util.atomic import atomic_publish_dir, atomic_write_stream, atomic_write_text

FORMAT = "poise-dcp-checkpoint"
VERSION = 2
OLD_FORMAT = "poise-train-checkpoint v1 (one torch.save .pt file)"


def _dcp() -> ModuleType:
    """`torch.distributed.checkpoint`, imported at its first use: it imports DTensor and SymPy,
    about 1.8 s of every rank's start-up on a 2-core host (`python -X importtime`), which a run
    that neither saves nor resumes does not need."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _old_format_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"this is a {OLD_FORMAT}; this Poise reads {FORMAT} v{VERSION} folders "
        "(torch.distributed.checkpoint): resume it with the Poise that wrote it",
        source=str(path),
        field="format",
    )


# ------------------------------------------------------------------------------ file level
@contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's notice that it saves or loads in a single process (on purpose here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _serialize(obj: Any, fh: BinaryIO) -> None:
    torch.save(obj, fh)


def write_file(payload: dict[str, Any], path: str | Path) -> None:
    """Serialise the checkpoint's `poise.pt` payload to `path` atomically."""
    atomic_write_stream(path, lambda fh: _serialize(payload, fh))


def read_meta(folder: str | Path) -> dict[str, Any]:
    """`poise.pt` of a checkpoint folder (everything but the tensors); `CheckpointError` when
    it is not one."""
    folder = Path(folder)
    if folder.is_file() and folder.suffix == ".pt":
        raise _old_format_error(folder)
    meta_path = folder / META
    if not meta_path.is_file() or not (folder / ".metadata").is_file():
        raise CheckpointError("not a complete Poise checkpoint folder", source=str(folder))
    try:
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds on a damaged file
        raise CheckpointError(
            f"cannot read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            source=str(meta_path),
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError("not a Poise training checkpoint", source=str(meta_path))
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint version {meta.get('version')}, this Poise reads {VERSION}",
            source=str(meta_path),
            field="version",
        )
    return meta


def _saved_tensors(folder: Path) -> dict[str, Any]:
    """`{key: TensorStorageMetadata}` of a checkpoint's DCP files."""
    try:
        md = _dcp().FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"cannot read DCP metadata ({type(exc).__name__}: {str(exc)[:200]})",
            source=str(folder / ".metadata"),
        ) from None
    return dict(md.state_dict_metadata)


def _empty_like_saved(info: Any) -> torch.Tensor:
    return torch.empty(tuple(info.size), dtype=info.properties.dtype)


def _dcp_load(state: dict[str, torch.Tensor], folder: Path, group: Any = None) -> None:
    """Fill `state` in place from the checkpoint (collective over the world unless alone)."""
    alone = not (dist.is_available() and dist.is_initialized())
    try:
        with _quiet():
            dcp = _dcp()
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(str(folder)),
                process_group=group,
                no_dist=alone,
            )
    except Exception as exc:
        raise CheckpointError(
            f"cannot read tensors ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            source=str(folder),
        ) from None


def read_file(path: str | Path) -> dict[str, Any]:
    """A whole checkpoint in this process's memory (tools and tests; no process group): the
    `poise.pt` values plus `model.dense[name]`, `model.experts[layer][w] [E, ...]`,
    `optimizer.dense[name][k]`, `optimizer.experts["<layer>.<w>"][k]` (moments `[E, ...]`)."""
    folder = Path(path)
    if folder.is_dir():
        verify(folder)
    meta = read_meta(folder)
    saved = _saved_tensors(folder)
    state = {k: _empty_like_saved(v) for k, v in saved.items()}
    try:
        with _quiet():
            dcp = _dcp()
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read tensors ({exc})", source=str(folder)) from None
    out = dict(meta)
    model: dict[str, Any] = {"dense": {}, "experts": {}}
    opt: dict[str, Any] = {"dense": {}, "experts": {}}
    rows: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for key, v in state.items():
        kind, rest = key.split(".", 1)
        part, rest = rest.split(".", 1)
        if kind == "model" and part == "dense":
            model["dense"][rest] = v
        elif kind == "model":
            base, e = rest.rsplit(".", 1)
            layer, w = base.rsplit(".", 1)
            rows.setdefault(("model", layer, w), {})[int(e)] = v
        elif part == "dense":
            name, k = rest.rsplit(".", 1)
            opt["dense"].setdefault(name, {})[k] = v
        else:
            base, k = rest.rsplit(".", 1)
            head, last = base.rsplit(".", 1)
            if last.isdigit():  # <layer>.<w>.<e>.<k>
                rows.setdefault(("optim", head, k), {})[int(last)] = v
            else:
                opt["experts"].setdefault(base, {})[k] = v
    for (kind, a, b), by_id in rows.items():
        stacked = torch.stack([by_id[e] for e in sorted(by_id)])
        if kind == "model":
            model["experts"].setdefault(a, {})[b] = stacked
        else:
            opt["experts"].setdefault(a, {})[b] = stacked
    out.update(model=model, optimizer=opt, path=str(folder))
    return out


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def _reason(exc: CheckpointError) -> str:
    """An error's words without the folder it names (the caller names it)."""
    return f"{exc.field}: {exc.message}" if exc.field else exc.message


def resolve(path: str | Path, *, say: bool = True) -> Path:
    """A verified checkpoint folder from `path` (see `verify`): the folder itself, which must
    verify, or in a run's output folder or its `checkpoints/` the newest that verifies, trying
    the one `latest` names first, then the steps from the highest down. Each one skipped is one
    line on stderr (unless `say` is false) naming it and why; when none verifies, one
    `CheckpointError` naming each. Old-format `.pt` files (named, or the only checkpoints in the
    folder) are one clear error."""
    p = Path(path)
    if p.is_file():
        if p.suffix == ".pt":
            raise _old_format_error(p)
        raise CheckpointError("not a checkpoint folder", source=str(p), field="resume")
    if not p.is_dir():
        raise CheckpointError("no such checkpoint folder", source=str(p), field="resume")
    if (p / META).is_file() or (p / MANIFEST).is_file():
        verify(p)
        return p
    if (p / "checkpoints").is_dir() and not (p / "latest").exists():
        p = p / "checkpoints"
    latest = p / "latest"
    candidates: list[Path] = []
    if latest.is_file():
        name = latest.read_text().strip()
        if name.endswith(".pt") and (p / name).is_file():
            raise _old_format_error(p / name)
        if name and "/" not in name and (p / name).is_dir():
            candidates.append(p / name)
    steps = sorted((x for x in p.glob("step-*") if x.is_dir()), reverse=True)
    candidates += [x for x in steps if x not in candidates]
    if not candidates:
        old = sorted(p.glob("step-*.pt"))
        if old:
            raise _old_format_error(old[-1])
        raise CheckpointError("no checkpoint in this folder", source=str(p), field="resume")
    skipped: list[tuple[Path, str]] = []
    for folder in candidates:
        try:
            if not (folder / META).is_file() or not (folder / ".metadata").is_file():
                raise CheckpointError(f"{META} or .metadata is missing", source=str(folder))
            verify(folder)
        except CheckpointError as exc:
            skipped.append((folder, _reason(exc)))
            continue
        if say:
            for bad, why in skipped:
                print(
                    f"poise: warning: skipped checkpoint {bad} ({why}); resuming from "
                    f"{folder.name}",
                    file=sys.stderr,
                    flush=True,
                )
        return folder
    listed = "; ".join(f"{bad.name}: {why}" for bad, why in skipped[:3])
    more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    raise CheckpointError(
        f"no checkpoint here verifies ({listed}{more})", source=str(p), field="resume"
    )


def publish(path: Path, keep: int) -> None:
    """Point `latest` at `path` (atomically) and remove older checkpoints beyond `keep`."""
    folder = path.parent
    atomic_write_text(folder / "latest", path.name + "\n")
    for old in sorted(x for x in folder.glob("step-*") if x.is_dir())[:-keep]:
        if old != path:
            shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- model level
def _world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def _holds_rank0(group: Any) -> bool:
    """Whether global rank 0 belongs to `group` (None or the world: yes)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return True
    if group is dist.group.WORLD:
        return True
    return 0 in dist.get_process_group_ranks(group)


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


def _candidate_payload(candidate: tuple[int, Plan] | None) -> dict[str, Any] | None:
    """The balancer's last forecast `(requested at, plan)`, which its next job backtests on the
    window's steps since, as checkpoint values."""
    if candidate is None:
        return None
    return {"requested_at": int(candidate[0]), "plan": plan_to_payload(candidate[1])}


def snapshot(
    balancer: Any,
    *,
    step: int,
    data_position: int,
    config: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    group: Any = None,
    ep_size: int | None = None,
) -> dict[str, Any] | None:
    """The `poise.pt` payload (collective over `group`, the world by default: gathers every
    rank's random states); global rank 0 gets it, others None."""
    world, rank = _world(group)
    rng = [None] * world
    mine = capture_rng()
    if world > 1:
        comm.all_gather_object(rng, mine, group=group)
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
        "ep_size": int(ep_size or world),
        "config": dict(config or {}),
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
            "learned": balancer.planning.learned_state(),
            "last_candidate": _candidate_payload(balancer.planning.last_forecast),
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
    """Write `<out>/checkpoints/step-NNNNNNNN/` (the step, 8 digits) with DCP, every rank its
    share in parallel, publish it atomically, point `latest` at it and prune old ones
    (collective over `group`, the world; `expert_group`: this rank's expert-parallel group,
    default the world: only the one holding global rank 0 saves experts). Returns the folder."""
    world, rank = _world(group)
    ep_group = group if expert_group is None else expert_group
    final = checkpoint_dir(out) / f"step-{step:08d}"
    tmp = final.parent / f".{final.name}.tmp"
    error: BaseException | None = None
    if rank == 0:
        try:
            for stale in final.parent.glob(".step-*.tmp"):  # crashed saves' leftovers
                shutil.rmtree(stale)
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    if world > 1:
        comm.barrier(group=group)
    payload = snapshot(
        balancer,
        step=step,
        data_position=data_position,
        config=config,
        extra=extra,
        group=group,
        ep_size=_world(ep_group)[0],
    )
    state = state_to_save(model, optimizer, dense=rank == 0, experts=_holds_rank0(ep_group))
    if error is None and tmp.is_dir():
        with _quiet():
            dcp = _dcp()
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                process_group=group,
                no_dist=world == 1,
            )
    # every rank hashes the shards it wrote; rank 0 lists them all in the manifest, last
    mine = own_shards(tmp, rank) if error is None else {}
    digests: list[dict[str, dict[str, Any]] | None] = [mine]
    if world > 1:
        digests = [None] * world
        comm.all_gather_object(digests, mine, group=group)
    if payload is not None and error is None:
        try:
            write_file(payload, tmp / META)
            write_manifest(tmp, {k: v for d in digests if d for k, v in d.items()})
            atomic_publish_dir(tmp, final)
            publish(final, keep)
        except OSError as exc:
            error = exc
    if world > 1:
        comm.barrier(group=group)
    if error is not None:
        raise CheckpointError(f"cannot write checkpoint: {error}", source=str(final))
    return final


def load(path: str | Path) -> dict[str, Any]:
    """The `poise.pt` values of the checkpoint `path` resolves to (see `resolve`), with `path`
    (the folder); the tensors are read by `restore`."""
    folder = resolve(path)
    ckpt = read_meta(folder)
    ckpt["path"] = str(folder)
    return ckpt


@torch.no_grad()
def restore(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
    """Load weights and optimizer state into a freshly built model (its MoE layers in their
    static layout, no replicas) and its optimizer: each rank reads the dense tensors and the
    experts its slots hold (collective over the world when there is one). Works at any number
    of ranks that fits."""
    folder = Path(ckpt["path"])
    source = str(folder)
    saved = _saved_tensors(folder)
    own = dense_state(model)
    have = {k[len("model.dense.") :] for k in saved if k.startswith("model.dense.")}
    missing, unexpected = set(own) - have, have - set(own)
    if missing or unexpected:
        what = (
            f"missing {sorted(missing)[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        )
        raise CheckpointError(
            f"the model does not match the checkpoint ({what}): same model settings?",
            source=source,
            field="model",
        )
    for k, v in own.items():
        size = tuple(saved[f"model.dense.{k}"].size)
        if size != tuple(v.shape):
            raise CheckpointError(
                f"the model's shapes do not match the checkpoint: {k} is {list(v.shape)} here, "
                f"{list(size)} in the checkpoint",
                source=source,
                field="model",
            )
    dense_opt, row_opt, other_opt = optimizer_state_names(saved, model)
    want = {k: _empty_like_saved(saved[k]) for k in saved if not k.startswith("model.experts.")}
    want = {k: v for k, v in want.items() if not _is_expert_row_state(k)}
    _shard_like_model(want, model, own, saved)  # FSDP: each rank reads its DTensor shards
    for lname, moe, w_name, w in expert_weights(model):
        base = f"{lname}.{w_name}"
        n_saved = sum(1 for k in saved if k.startswith(f"model.experts.{base}.")
                      and k[len(f"model.experts.{base}.") :].isdigit())  # fmt: skip
        if n_saved != moe.num_experts:
            raise CheckpointError(
                f"layer {lname}: {w_name} of {n_saved} experts in the checkpoint, the model "
                f"has {moe.num_experts}",
                source=source,
                field="model",
            )
        for _, e in held_slots(moe):
            key = f"model.experts.{base}.{e}"
            size = tuple(saved[key].size)
            if size != tuple(w.shape[1:]):
                raise CheckpointError(
                    f"layer {lname}: {w_name} must be [{moe.num_experts}, "
                    f"{', '.join(map(str, w.shape[1:]))}], the checkpoint holds "
                    f"[{n_saved}, {', '.join(map(str, size))}]",
                    source=source,
                    field="model",
                )
            want[key] = _empty_like_saved(saved[key])
        for _, e in home_slots(moe):
            for k in row_opt[base]:
                key = f"optim.experts.{base}.{e}.{k}"
                if key in saved:
                    want[key] = _empty_like_saved(saved[key])
    _dcp_load(want, folder)
    model.load_state_dict({k: want[f"model.dense.{k}"] for k in own}, strict=False)
    for lname, moe, w_name, w in expert_weights(model):
        base = f"{lname}.{w_name}"
        for slot, e in enumerate(moe.routing.slots.expert.tolist()):
            if e >= 0:
                w[slot].copy_(want[f"model.experts.{base}.{e}"])
            else:
                w[slot].zero_()
    _restore_optimizer(model, optimizer, want, dense_opt, row_opt, other_opt, source)


def _shard_like_model(
    want: dict[str, torch.Tensor],
    model: nn.Module,
    own: dict[str, torch.Tensor],
    saved: dict[str, Any],
) -> None:
    """Where the model's dense tensors are DTensors (FSDP), ask DCP for DTensors shaped and
    sharded like them (their moments too): each rank reads its shards, from a checkpoint of
    either path."""
    for k, v in own.items():
        key = f"model.dense.{k}"
        if is_dtensor(v) and key in want:
            want[key] = torch.empty_like(v, dtype=saved[key].properties.dtype)
    expert_names = expert_param_names(model)
    for name, p in model.named_parameters():
        if name in expert_names or not is_dtensor(p):
            continue
        prefix = f"optim.dense.{name}."
        for key in [k for k in want if k.startswith(prefix)]:
            if tuple(saved[key].size) == tuple(p.shape):
                want[key] = torch.empty_like(p, dtype=saved[key].properties.dtype)


def _is_expert_row_state(key: str) -> bool:
    """`optim.experts.<layer>.<w>.<e>.<k>` (a per-expert moment)."""
    if not key.startswith("optim.experts."):
        return False
    return key.rsplit(".", 2)[-2].isdigit()


def _restore_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loaded: dict[str, torch.Tensor],
    dense_opt: dict[str, list[str]],
    row_opt: dict[str, list[str]],
    other_opt: dict[str, list[str]],
    source: str,
) -> None:
    index = _param_index(optimizer)
    state: dict[int, dict[str, Any]] = {}
    expert_names = expert_param_names(model)
    for name, p in model.named_parameters():
        if name in expert_names or not dense_opt.get(name):
            continue
        state[index[id(p)]] = {k: loaded[f"optim.dense.{name}.{k}"] for k in dense_opt[name]}
    for lname, moe, w_name, w in expert_weights(model):
        base = f"{lname}.{w_name}"
        if not row_opt[base] and not other_opt[base]:
            continue
        entry: dict[str, Any] = {k: loaded[f"optim.experts.{base}.{k}"] for k in other_opt[base]}
        for k in row_opt[base]:
            rows = torch.zeros(w.shape, dtype=torch.float32)
            for slot, e in home_slots(moe):
                row = loaded[f"optim.experts.{base}.{e}.{k}"]
                rows = rows.to(row.dtype)
                rows[slot] = row
            entry[k] = rows
        state[index[id(w)]] = entry
    sd = optimizer.state_dict()
    try:
        optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(
            f"optimizer state does not fit: {exc}", source=source, field="optimizer"
        ) from None


def _param_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """`{id(param): index}` as `optimizer.state_dict()` numbers them."""
    index, i = {}, 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            index.setdefault(id(p), i)
            i += 1
    return index


def restore_plan(balancer: Any, ckpt: dict[str, Any], world: int | None = None) -> bool:
    """Re-apply the saved placement, load window and what the balancer learned
    (`Planning.learned_state`) when the world size (`world`, default the balancer's), the
    expert-parallel group size and the slots match (collective
    over the balancer's group); returns whether it did. Always restores the balancer's step
    counter. A malformed learned state is one `CheckpointError` naming `poise.pt` and the
    entry, before anything is applied."""
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
    learned = saved.get("learned")  # absent, or of an older format: the run re-learns it
    if learned is not None and learned.get("version") == 2:  # checked before anything changes
        source = str(Path(ckpt.get("path", "checkpoint")) / META)
        try:
            balancer.planning.restore_learned(learned, source=source)
        except PoiseError as exc:
            raise CheckpointError(exc.message, source=source, field=exc.field) from None
    balancer.window.clear()
    if saved["window"] is not None:
        for row in saved["window"].numpy():
            balancer.window.append(row)
    candidate = saved.get("last_candidate")  # the plan the next job backtests
    if candidate is not None:
        last = plan_from_payload(candidate["plan"], None, balancer.spec())
        balancer.planning.last_forecast = (int(candidate["requested_at"]), last)
    restored = plan_from_payload(plan, balancer.plan.placement, balancer.spec())
    # this run's splitting setting, whatever the saved run's was
    restored.assignment = restored.assignment.with_split(balancer.config.split_tokens)
    balancer.apply(restored)
    return True


def restore_rng(ckpt: dict[str, Any], rank: int) -> None:
    """This rank's saved random states (rank r of a different world takes r mod the old one)."""
    states = ckpt["rng"]
    set_rng(states[rank % len(states)])


__all__ = [
    "FORMAT",
    "CheckpointError",
    "capture_rng",
    "checkpoint_dir",
    "load",
    "publish",
    "read_file",
    "read_meta",
    "resolve",
    "restore",
    "restore_plan",
    "restore_rng",
    "save",
    "set_rng",
    "snapshot",
    "verify",
    "write_file",
    "write_manifest",
]
