"""Plans as JSON: what `poise plan` writes and what other tools read."""

from __future__ import annotations

from typing import Any

import numpy as np

from poise.core.finite import json_text
from poise.core.placement import Plan
from poise.util.atomic import atomic_write_text


def to_jsonable(value: Any) -> Any:
    """NumPy scalars and arrays become plain Python values, recursively."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def plan_to_dict(plan: Plan, *, cluster: str = "", model: str = "") -> dict[str, Any]:
    """Per layer: each expert's home, replicas as (expert, device) pairs, each device's load."""
    p = plan.placement
    layers = []
    device_load = plan.cost.device_load if plan.cost is not None else None
    for layer in range(p.layers):
        rep_dev, rep_exp = np.nonzero(p.replicas()[layer])
        entry: dict[str, Any] = {
            "layer": layer,
            "home": p.home[layer].tolist(),
            "replicas": sorted(zip(rep_exp.tolist(), rep_dev.tolist(), strict=True)),
        }
        if device_load is not None:
            entry["device_load"] = np.round(device_load[layer], 3).tolist()
        layers.append(entry)
    out: dict[str, Any] = {
        "policy": plan.policy,
        "cluster": cluster,
        "model": model,
        "devices": p.devices,
        "experts": p.experts,
        "slots_per_device": p.slots_per_device,
        "layers": layers,
        "transfers": {
            "trans_bytes_per_step": float(plan.transfers.trans_bytes.sum()),
            "agg_bytes_per_step": float(plan.transfers.agg_bytes.sum()),
            "migrate_bytes": float(plan.transfers.migrate_bytes.sum()),
            "migrations": plan.transfers.migrations.tolist(),
        },
        "notes": to_jsonable(plan.notes),
    }
    if plan.cost is not None:
        out["cost"] = {
            "schedule": plan.cost.schedule,
            "step_s": plan.cost.step_s,
            "max_over_mean": plan.cost.max_over_mean,
            "phases_s": plan.cost.phases.as_dict(),
        }
    return out


def write_plan_json(plan: Plan, path: str, **labels: str) -> None:
    atomic_write_text(path, json_text(plan_to_dict(plan, **labels), str(path)))
