"""HybridEP across datacentres: `hybrid` against plain EP in the simulator, and compressed
expert migration measured on live ranks.

    .venv/bin/python benchmarks/hybrid_dc.py              # simulator cases + codec, < 2 min
    .venv/bin/python benchmarks/hybrid_dc.py --train 60   # + the live 2-rank training runs

One JSON line per case (`bench` "hybrid_dc", `case`, then the figures):

- `table-v` (HybridEP, arXiv 2510.19470, Table V): 2 and 4 datacentres of 8 A800 (`a800-eth10`),
  32 experts top-2, 12 layers, 6-192 MB of data a GPU and layer, a drifting trace re-planned
  every 5 steps. Plain EP `static` without overlap (`ep_s`) and with Tutel's 4-chunk pipeline
  (`tutel_s`); `hybrid_s` under the `hybrid` schedule; slot budgets `default` (one spare a GPU)
  and `allgather` (room for a copy of every expert in every domain: p = 0); beside the
  published seconds and speedups.
- `sweep` (HybridEP Fig. 17): 2 to 1,000 datacentres of one 8-H100 node, inter-domain links of
  1, 10 and 100 Gb/s, GPT-Medium widths.
- `codec`: the compressed migration's wire bytes and relative weight error per ratio on the
  `tiny` model's experts (`codec-trained` after `--train`).
- `train` (with `--train STEPS`): the `tiny` GPT-MoE on 2 gloo ranks as 2 datacentres
  (`runtime.hybridep.domains.domain_cluster(2)`, 1 Gb/s between), plain EP, `hybrid`, and
  `hybrid` with compressed migration at each of `--ratios`: losses, Trans bytes, the replicas'
  weight error at the end (AdamW eps 1e-6, so that summation order on near-zero gradients does
  not turn into full steps).

Simulator figures are the cost model's step times (planning not charged).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np

TABLE_V_DATA = (6, 12, 24, 48, 96, 192)
SWEEP_DOMAINS = (2, 10, 100, 1000)
SWEEP_GBPS = (1.0, 10.0, 100.0)
RATIOS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
LR, EPS = 2e-3, 1e-6  # eps above float-order noise on near-zero expert gradients


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": "hybrid_dc", **record}), flush=True)


def _mean_after(x: np.ndarray, warmup: int) -> float:
    return float(x[min(warmup, len(x) - 1) :].mean())


# ------------------------------------------------------------------------------- simulator
def table_v(slots: str) -> None:
    """HybridEP Table V, one line per (datacentres, data size)."""
    from poise.core.presets import get_cluster
    from poise.sim.scenarios.papers import (
        HYBRIDEP_PUBLISHED,
        HYBRIDEP_TABLE_V,
        hybridep_spec,
    )
    from poise.sim.simulator import simulate
    from poise.trace.generate import generate

    for dcs in (2, 4):
        cluster = get_cluster("a800-eth10" if dcs == 2 else f"a800-eth10:{dcs}")
        D, size = cluster.num_devices, cluster.devices_per_domain
        for data_mb in TABLE_V_DATA:
            spec = hybridep_spec(data_mb)
            E = spec.experts
            base = -(-E // D)
            n_slots = base + 1 if slots == "default" else base + -(-(E - E // dcs) // size)
            trace = generate(
                "drift",
                steps=20,
                layers=spec.moe_layers,
                devices=D,
                experts=E,
                top_k=spec.top_k,
                tokens_per_device=spec.tokens_per_device,
                seed=41,
                s=1.0,
                rate=0.05,
            )
            t0 = time.perf_counter()
            kw: dict[str, Any] = {"slots_per_device": n_slots, "count_planning": False}
            ep = simulate(trace, cluster, spec, ["static"], "sync", 5, "ema", **kw)
            tutel = simulate(trace, cluster, spec, ["static"], "pipelined(4)", 5, "ema", **kw)
            hyb = simulate(trace, cluster, spec, ["hybrid"], "hybrid", 5, "ema", **kw)
            ep_s = _mean_after(ep.runs["static"].step_s, 6)
            tutel_s = _mean_after(tutel.runs["static"].step_s, 6)
            hybrid_s = _mean_after(hyb.runs["hybrid"].step_s, 6)
            plan = hyb.runs["hybrid"].last_plan
            pub = HYBRIDEP_TABLE_V[dcs][data_mb]
            emit(
                {
                    "case": "table-v",
                    "setup": f"{dcs} DCs x 8 A800, {data_mb} MB",
                    "slots": slots,
                    "slots_per_device": n_slots,
                    "ep_s": round(ep_s, 4),
                    "tutel_s": round(tutel_s, 4),
                    "hybrid_s": round(hybrid_s, 4),
                    "speedup_vs_ep": round(ep_s / hybrid_s, 3),
                    "speedup_vs_tutel": round(tutel_s / hybrid_s, 3),
                    "p_star": round(float(np.mean(plan.notes["p_star"])), 3) if plan else None,
                    "published_tutel_s": pub[0],
                    "published_hybridep_s": pub[3],
                    "published_speedup_vs_tutel": round(pub[0] / pub[3], 2),
                    "published_avg_speedup": HYBRIDEP_PUBLISHED[dcs][data_mb],
                    "wall_s": round(time.perf_counter() - t0, 2),
                }
            )


def sweep() -> None:
    """Inter-domain bandwidth x number of datacentres, `hybrid` against plain EP."""
    from poise.core.cluster import GBIT
    from poise.core.presets import get_cluster
    from poise.sim.scenarios.papers import cross_dc_spec
    from poise.sim.simulator import simulate
    from poise.trace.generate import generate

    spec = cross_dc_spec()
    base = get_cluster("cross-dc-1000")
    trace = generate(
        "drift",
        steps=6,
        layers=spec.moe_layers,
        devices=64,
        experts=spec.experts,
        top_k=spec.top_k,
        tokens_per_device=spec.tokens_per_device,
        seed=51,
        s=1.0,
        rate=0.05,
    )
    for domains in SWEEP_DOMAINS:
        for gbps in SWEEP_GBPS:
            wan = dataclasses.replace(base.inter_domain, bw_Bps=gbps * GBIT)
            cluster = dataclasses.replace(base, domains=domains, inter_domain=wan)
            t0 = time.perf_counter()
            res = simulate(
                trace, cluster, spec, ["static", "hybrid"], "hybrid", 2, "ema",
                count_planning=False,
            )  # fmt: skip
            ep_s = _mean_after(res.runs["static"].step_s, 3)
            hybrid_s = _mean_after(res.runs["hybrid"].step_s, 3)
            plan = res.runs["hybrid"].last_plan
            emit(
                {
                    "case": "sweep",
                    "domains": domains,
                    "devices": cluster.num_devices,
                    "inter_domain_gbps": gbps,
                    "ep_s": round(ep_s, 4),
                    "hybrid_s": round(hybrid_s, 4),
                    "speedup_vs_ep": round(ep_s / hybrid_s, 3),
                    "p_star": round(float(np.mean(plan.notes["p_star"])), 3) if plan else None,
                    "published_1000_dcs": "1.05-1.45x (S_ED fixed), 1.31-3.76x (p fixed)",
                    "wall_s": round(time.perf_counter() - t0, 2),
                }
            )


# ----------------------------------------------------------------------------------- codec
def codec_figures(experts: list[list[Any]], label: str) -> None:
    """`experts[layer][tensor]`: `[E, ...]` weights of every expert. Bytes and error per ratio
    (error: all layers and tensors together, Frobenius; bytes per expert and layer)."""
    from poise.runtime.hybridep import compress as cz

    rows = sum(t[0].shape[0] for t in experts)  # experts x layers

    for ratio in RATIOS:
        err_num = err_den = 0.0
        wire = dense = 0
        for tensors in experts:
            for w in tensors:
                shared = cz.shared_expert(w)
                approx = cz.roundtrip(w, shared, ratio)
                err_num += float((w.double() - approx.double()).square().sum())
                err_den += float(w.double().square().sum())
                n = int(np.prod(w.shape[1:]))
                wire += cz.row_wire_bytes(n, ratio, w.dtype) * w.shape[0]
                dense += n * w.element_size() * w.shape[0]
        emit(
            {
                "case": label,
                "ratio": ratio,
                "compression_x": round(1 / ratio, 1),
                "wire_bytes_per_expert": wire // rows,
                "dense_bytes_per_expert": dense // rows,
                "bytes_saved": round(1 - wire / dense, 4),
                "relative_error": round((err_num / err_den) ** 0.5, 5),
                "dtype": str(experts[0][0].dtype).replace("torch.", ""),
            }
        )


def init_experts() -> list[list[Any]]:
    """The `tiny` model's experts as initialised, `[layer][tensor] -> [E, ...]`."""
    from poise.models.gpt import GPTMoE, model_config
    from poise.nn import find_moe_layers

    model = GPTMoE(model_config("tiny"), seed=0)  # compute only: every slot holds its expert
    return [[w.detach().clone() for w in m.experts.weights()] for m in find_moe_layers(model)]


# ----------------------------------------------------------------------------------- train
def _train_rank(rank: int, world: int, steps: int, ratios: list[float]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from poise.models.gpt import GPTMoE, model_config
    from poise.nn import apply_expert_parallel, find_moe_layers
    from poise.runtime.balancer import Balancer, BalancerConfig
    from poise.runtime.hybridep.domains import domain_cluster
    from poise.train.data import Sampler, build_corpus, shard_rows

    torch.manual_seed(0)
    cfg = model_config("tiny")
    corpus = build_corpus() if rank == 0 else None
    dist.barrier()
    corpus = corpus or build_corpus()
    sampler = Sampler(corpus.train, cfg.context, seed=0)
    batch = 16
    rows = shard_rows(batch, rank, world)
    tokens = batch * cfg.context
    cluster = domain_cluster(world, 1, 1, wan_bw_Bps=1.25e8)
    slots = cfg.num_experts // world + 2
    out: dict[str, Any] = {}
    runs: list[tuple[str, float | None, bool]] = [("ep", None, False), ("hybrid", None, True)]
    runs += [(f"hybrid@{r:g}", r, True) for r in ratios]
    for name, ratio, balanced in runs:
        model = GPTMoE(cfg, seed=0)
        apply_expert_parallel(model, dist.group.WORLD, num_slots=slots)
        dense = [p for _, p in model.dense_named_parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
        balancer = (
            Balancer(model, opt, "hybrid", 10, BalancerConfig(cluster=cluster, compression=ratio))
            if balanced
            else None
        )
        losses: list[float] = []
        t0 = time.perf_counter()
        for step in range(steps):
            x, y = sampler.batch(step * batch, rows)
            logits = model(x)
            ce = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), y.flatten(), reduction="sum"
            )
            (ce / tokens).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in dense] + [ce.detach().reshape(1)])
            dist.all_reduce(flat)
            at = 0
            for p in dense:
                n = p.numel()
                p.grad.copy_(flat[at : at + n].view_as(p))
                at += n
            if balancer is not None:
                balancer.reduce_replicas()
            opt.step()
            if balancer is not None:
                balancer.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(flat[-1]) / tokens)
        wall = time.perf_counter() - t0
        layers = []
        for m in find_moe_layers(model):
            s = m.routing.slots
            layers.append(
                (s.expert.copy(), s.home.copy(), [w.detach().clone() for w in m.experts.weights()])
            )
        info: dict[str, Any] = {"losses": losses, "layers": layers, "wall_s": wall}
        if balancer is not None:
            balancer.close()
            stats = list(balancer.stats)
            info["trans_bytes"] = int(sum(s.trans_bytes for s in stats))
            info["replicas"] = int(balancer.plan.placement.replicas().sum())
            info["p_star"] = balancer.plan.notes.get("p_star")
        out[name] = info
    return out


def train(steps: int, ratios: list[float]) -> None:
    import torch

    from poise.runtime.launch import run_ranks

    results = run_ranks(_train_rank, 2, steps, ratios, timeout_s=3000.0)
    names = list(results[0])
    # Homes and replicas of every layer, gathered from the two ranks.
    exact = results[0]["hybrid"]["losses"]
    for name in names:
        r0 = results[0][name]
        losses = np.array(r0["losses"])
        err_num = err_den = 0.0
        replicas = 0
        for layer in range(len(r0["layers"])):
            homes: dict[int, list[Any]] = {}
            reps: list[tuple[int, list[Any]]] = []
            for res in results:
                expert, home, weights = res[name]["layers"][layer]
                for slot, e in enumerate(expert.tolist()):
                    if e < 0:
                        continue
                    rows = [w[slot] for w in weights]
                    if home[slot]:
                        homes[e] = rows
                    else:
                        reps.append((e, rows))
            for e, rows in reps:
                replicas += 1
                for a, b in zip(rows, homes[e], strict=True):
                    err_num += float((a.double() - b.double()).square().sum())
                    err_den += float(b.double().square().sum())
        tail = min(10, len(losses))
        record: dict[str, Any] = {
            "case": "train",
            "run": name,
            "steps": len(losses),
            "loss_first": round(float(losses[0]), 4),
            "loss_last10": round(float(losses[-tail:].mean()), 4),
            "max_abs_diff_vs_hybrid": round(float(np.abs(losses - np.array(exact)).max()), 6),
            "last10_diff_vs_hybrid": round(float((losses - np.array(exact))[-tail:].mean()), 5),
            "replica_rows_at_end": replicas,
            "replica_relative_error": round((err_num / err_den) ** 0.5, 5) if err_den else None,
            "wall_s": round(max(r[name]["wall_s"] for r in results), 1),
        }
        if "trans_bytes" in r0:
            record.update(trans_bytes=r0["trans_bytes"], p_star=r0["p_star"])
        emit(record)
    # The codec on the trained experts (the exact hybrid run's homes).
    trained = []
    for layer in range(len(results[0]["hybrid"]["layers"])):
        rows: dict[int, list[Any]] = {}
        for res in results:
            expert, home, weights = res["hybrid"]["layers"][layer]
            for slot, e in enumerate(expert.tolist()):
                if e >= 0 and home[slot]:
                    rows[e] = [w[slot] for w in weights]
        trained.append([torch.stack([rows[e][k] for e in sorted(rows)]) for k in range(3)])
    codec_figures(trained, "codec-trained")


# ------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["table-v", "sweep", "codec"])
    parser.add_argument("--train", type=int, default=0, help="steps of the live runs (0: none)")
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.1, 0.02])
    args = parser.parse_args()
    if "table-v" in args.only:
        table_v("default")
        table_v("allgather")
    if "sweep" in args.only:
        sweep()
    if "codec" in args.only:
        codec_figures(init_experts(), "codec")
    if args.train > 0:
        train(args.train, list(args.ratios))


if __name__ == "__main__":
    main()
