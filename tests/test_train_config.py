"""TrainConfig YAML load/save and validation, the learning-rate schedule, the model's shapes,
and `poise train` refusing bad input with one line and exit status 2."""

from __future__ import annotations

import math

import pytest
import torch

from poise.core.errors import ConfigError
from poise.models.gpt import GPTMoE, model_config
from poise.nn import apply_expert_parallel
from poise.train.config import TrainConfig, load_config, save_config
from poise.train.loop import lr_at


def test_yaml_round_trip(tmp_path):
    cfg = TrainConfig(model="tiny", model_args={"layers": 2}, steps=7, policy="eplb", lr=1e-3)
    path = tmp_path / "run.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    (tmp_path / "partial.yaml").write_text("steps: 12\npolicy: static\nclip: 0\n")
    got = load_config(tmp_path / "partial.yaml")
    assert (got.steps, got.policy, got.clip, got.lr) == (12, "static", 0.0, TrainConfig().lr)


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("polcy: auto\n", "polcy", "unknown field"),
        ("steps: ten\n", "steps", "must be an integer"),
        ("steps: 0\n", "steps", ">= 1"),
        ("lr: -0.1\n", "lr", "> 0"),
        ("micro_batches: 0\n", "micro_batches", ">= 1"),
        ("micro_batches: 2.5\n", "micro_batches", "integer"),
        ("policy: fastest\n", "policy", "must be one of"),
        ("spare_slots: 1.5\n", "spare_slots", "integer"),
        ("model: huge\n", "model", "must be one of tiny"),
        ("model_args: {d_modle: 64}\n", "model_args.d_modle", "unknown model setting"),
        ("model_args: {heads: 3}\n", "model.heads", "must divide"),
        ("predictor: magic\n", "predictor", "last, window or ema"),
        ("probe_every: 1\n", "probe_every", "0 (off) or >= 2"),
        ("probe_every: -3\n", "probe_every", ">= 0"),
        ("plan_lag: -1\n", "plan_lag", ">= 0"),
        ("replan_every: 4\nplan_lag: 5\n", "plan_lag", "at most replan_every (4)"),
        ("host_link: sometimes\n", "host_link", "boolean"),
        ("free_balancing: true\n", "free_balancing", "needs balance_guard off"),
        ("compression: 0\n", "compression", "> 0"),
        ("compression: 1.5\n", "compression", "<= 1"),
        ("- a list\n", None, "top level must be a mapping"),
    ],
)
def test_bad_fields_name_file_and_field(tmp_path, text, field, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = err.value.one_line()
    assert str(path) in msg and words in msg
    if field:
        assert err.value.field == field


def test_bad_yaml_through_the_cli_is_one_line_exit_2(tmp_path, capsys):
    from poise.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny\nreplan_every: 0\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("poise: error:") and str(path) in err and "replan_every" in err
    assert main(["train", "tiny", "--nproc", "3"]) == 2  # 3 ranks do not fit 8 experts
    assert "world_size" in capsys.readouterr().err
    assert main(["train", "tiny", "--policy", "nope"]) == 2
    assert "--policy" in capsys.readouterr().err
    assert main(["train", "tiny", "--set", "batch=oops"]) == 2
    assert "--set batch" in capsys.readouterr().err
    assert main(["train", "nowhere.yaml"]) == 2
    assert "file not found" in capsys.readouterr().err


def test_learning_rate_schedule():
    cfg = TrainConfig(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 110))


def test_model_shapes_causality_and_init():
    cfg = model_config(
        "tiny",
        {
            "layers": 2,
            "moe_every": 2,
            "context": 16,
            "d_model": 32,
            "heads": 2,
            "d_ff": 48,
            "d_expert": 32,
        },
    )
    model = GPTMoE(cfg, seed=1)
    assert [type(b.ffn).__name__ for b in model.blocks] == ["DenseFFN", "MoE"]
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)  # causal
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])
    # tied embeddings: no separate output matrix
    assert not any("head" in n for n, _ in model.named_parameters())
    # initialisation does not depend on the slots (spare slots for a balancing policy)
    other = GPTMoE(cfg, seed=1)
    apply_expert_parallel(other, None, num_slots=cfg.num_experts + 2)
    for (n, p), (_, q) in zip(
        model.dense_named_parameters(), other.dense_named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    assert torch.equal(model(idx), other(idx))
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        model(torch.zeros(1, 17, dtype=torch.long))
    n = model.num_parameters()
    assert n["experts"] == cfg.num_experts * 3 * 32 * 32 and not math.isnan(n["dense"])


def test_ranks_take_cuda_only_with_a_gpu_each() -> None:
    """NCCL cannot put two ranks on one GPU: `auto` falls back to the CPU where the local ranks
    outnumber the GPUs, and `cuda` is one error naming `device`, not NCCL's from deep inside."""
    from poise.train.setup import ranks_use_cuda

    assert ranks_use_cuda("auto", 1, 1) and ranks_use_cuda("auto", 8, 8)
    assert not ranks_use_cuda("auto", 2, 1) and not ranks_use_cuda("auto", 1, 0)
    assert not ranks_use_cuda("cpu", 1, 8)
    assert ranks_use_cuda("cuda", 2, 2)
    with pytest.raises(ConfigError, match="2 ranks on this host need one GPU each") as err:
        ranks_use_cuda("cuda", 2, 1)
    assert err.value.field == "device"
    with pytest.raises(ConfigError, match="not available"):
        ranks_use_cuda("cuda", 1, 0)
