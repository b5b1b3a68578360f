"""Expert-load observability: per step and MoE layer, tokens per expert, CV, drops and replicas
in `metrics.jsonl`, TensorBoard events with per-layer scalars and expert-load histograms, the
worst layer in the console."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from poise.train.expert_load import expert_load
from poise.train.runlog import worst_layer_text


def test_expert_load_worked_example():
    """Two layers, two source ranks, four experts; one replica in layer 1."""
    counts = np.array(
        [
            [[3, 1, 0, 0], [1, 1, 2, 0]],  # layer 0: per expert 4, 2, 2, 0 -> mean 2
            [[2, 2, 2, 2], [2, 2, 2, 2]],  # layer 1: balanced
        ]
    )
    copies = np.zeros((2, 2, 4), np.int64)
    copies[:, 0, :2] = 1
    copies[:, 1, 2:] = 1
    copies[1, 1, 0] = 1  # a replica of expert 0 on rank 1
    load = expert_load(counts, copies, np.array([5, 0]))
    assert load.tokens_per_expert.tolist() == [[4, 2, 2, 0], [4, 4, 4, 4]]
    np.testing.assert_allclose(load.expert_max_over_mean, [2.0, 1.0])
    np.testing.assert_allclose(load.cv, [np.sqrt(2.0) / 2.0, 0.0])  # std sqrt(2), mean 2
    assert load.dropped_tokens.tolist() == [5, 0]
    assert load.replicas.tolist() == [0, 1]
    assert load.worst_layer == 0
    rec = load.as_record()
    json.dumps(rec)  # plain JSON
    assert rec["worst_layer"] == 0 and rec["cv"][1] == 0.0
    idle = expert_load(np.zeros((1, 2, 4), np.int64))
    assert idle.cv.tolist() == [0.0] and idle.expert_max_over_mean.tolist() == [1.0]


def test_worst_layer_text_names_the_largest_cv():
    rec = {"cv": [0.1, 0.7], "worst_layer": 1, "expert_max_over_mean": [1.1, 2.5],
           "max_over_mean": [1.0, 1.4], "dropped_tokens": [0, 3]}  # fmt: skip
    assert worst_layer_text(rec) == (
        "worst layer 1: cv 0.70, experts max/mean 2.50, devices 1.40, dropped 3"
    )
    assert worst_layer_text({}) == ""


@pytest.mark.dist
def test_poise_train_writes_expert_load_and_tensorboard(tmp_path):
    """A 4-step 2-rank `poise train tiny --out DIR` leaves TensorBoard event files under DIR and
    JSONL lines with `tokens_per_expert` and `cv` that agree with the recorded trace; with
    `megatron_trace` the same counts as Megatron-Core router traces. Each step holds two
    micro-batches (`micro_batches=2`): every figure is the step's, both micro-batches' tokens."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from poise.cli import main
    from poise.trace.trace import Trace

    out = tmp_path / "run"
    args = ["train", "tiny", "--nproc", "2", "--steps", "4", "--policy", "auto", "--out", str(out)]
    for kv in ("context=32", "batch=4", "micro_batches=2", "eval_every=0", "checkpoint_every=0",
               "megatron_trace=true", f"cache_dir={tmp_path / 'cache'}"):  # fmt: skip
        args += ["--set", kv]
    assert main(args) == 0
    # each rank computes at the launcher's share of the cores (not the fork server's count)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["threads"] == max(1, (os.cpu_count() or 1) // 2)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    trace = Trace.load(out / "trace.npz")  # counts [steps, layers, ranks, experts]
    L, E = trace.counts.shape[1], trace.counts.shape[3]
    assert np.all(trace.counts.sum(axis=(2, 3)) == 2 * 4 * 32 * 2)  # top-2 of 2 x 4 x 32 tokens
    for r, counts in zip(records, trace.counts, strict=True):
        per_expert = counts.sum(axis=1)
        assert r["tokens_per_expert"] == per_expert.tolist()
        np.testing.assert_allclose(r["cv"], per_expert.std(axis=1) / per_expert.mean(axis=1))
        assert r["dropped_tokens"] == [0] * L  # tiny is dropless
        assert len(r["replicas"]) == L and min(r["replicas"]) >= 0
        assert len(r["device_tokens"]) == L and "plan_changes" in r
        assert r["worst_layer"] == int(np.argmax(r["cv"]))
    from poise.trace.megatron import import_megatron

    megatron = import_megatron(out / "megatron-trace", experts=E)  # what Megatron-Core writes
    np.testing.assert_array_equal(megatron.counts, trace.counts)
    assert megatron.step_ids.tolist() == trace.step_ids.tolist() == [0, 1, 2, 3]
    events = list((out / "tb").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(out / "tb"), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    for layer in range(L):
        assert f"moe/layer{layer:02d}/cv" in tags["scalars"]
        assert f"expert_load/layer{layer:02d}" in tags["histograms"]
    cv0 = [e.value for e in acc.Scalars("moe/layer00/cv")]
    np.testing.assert_allclose(cv0, [r["cv"][0] for r in records], rtol=1e-6)
    hist = acc.Histograms("expert_load/layer00")[-1].histogram_value
    assert list(hist.bucket) == records[-1]["tokens_per_expert"][0]
    assert len(hist.bucket) == E


def test_moe_forward_counts_dropped_assignments():
    """`last_forward.dropped` is the assignments the capacity dropped; 0 when dropless."""
    import torch

    from poise.nn import MoE, MoEConfig

    torch.manual_seed(0)
    x = torch.randn(64, 16)
    dropless = MoE(MoEConfig(d_model=16, d_expert=32, num_experts=4, top_k=2))
    dropless(x)
    assert int(dropless.last_forward.dropped) == 0
    capped = MoE(MoEConfig(d_model=16, d_expert=32, num_experts=4, top_k=2, capacity_factor=0.5))
    routing = capped.router(x)
    capped(x)
    cap = int(np.ceil(0.5 * 64 * 2 / 4))  # 16 per expert: at least half the 128 dropped
    kept = int(torch.clamp(routing.counts, max=cap).sum())
    assert int(capped.last_forward.dropped) == 128 - kept > 0
