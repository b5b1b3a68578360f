"""Training on gloo ranks: every policy trains, balancing never changes the losses, checkpoints
resume exactly (same ranks: 2 onto 2, 4 onto 4) and re-shard (4 ranks onto 2), `poise train
--nproc 2` runs.

Two spawns carry the multi-rank checks: 4 ranks train 6 steps with a checkpoint at step 3; then
2 ranks run everything else (static and each policy for 8 steps on a skewed 16-expert variant,
every plan adopted; static and auto for 30; a resume of the auto run from step 20; the 4-rank
checkpoint resumed on 2 ranks). The `tiny` model with context 32 and a global batch of 8
sequences keeps it quick."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poise.runtime.launch import run_ranks

from .helpers import slow_gemm_cluster, tiny_train_config

pytestmark = pytest.mark.dist

TOL = 1e-5
POLICIES = ["shadow", "prophet", "vexpert", "permute", "eplb", "hybrid"]


POLICY_STEPS = 8  # re-plan every 2 steps, each adopted one step later
PLANNED = 5  # steps 6-8 run plans made after the first few steps' loads
# 16 experts top-1 over 16 sequences: the untrained router's skew persists from step to step
# (static's device max/mean about 1.5), so a plan made from past steps fits the next ones
SKEWED = dict(model_args={"num_experts": 16, "top_k": 1, "d_expert": 64}, batch=16)


def _two_nodes():
    """The test cluster of slow GEMMs (`helpers.slow_gemm_cluster`) as 2 nodes of 1 device, the
    link between them 4x slower: HybridEP's domains (a single node gives it none, and it plans
    nothing)."""
    import dataclasses

    from poise.core.cluster import Link

    cpu = slow_gemm_cluster(2, one_link=False)
    slow = Link(cpu.intra_node.bw_Bps / 4, cpu.intra_node.lat_s)
    return dataclasses.replace(
        cpu, name="test-two-nodes", devices_per_node=1, nodes_per_domain=2, inter_node=slow
    )


def _cfg(root: str, name: str, **kw):
    return tiny_train_config(root, name, **kw)


def _four_ranks(rank: int, world: int, root: str) -> dict:
    from poise.train import train

    cfg = _cfg(root, "four", steps=6, policy="auto", checkpoint_every=3)
    r = train(cfg, quiet=True)
    again = train(
        cfg.replace(out=f"{root}/four-on-four"),
        resume=f"{root}/four/checkpoints/step-00000003",
        quiet=True,
    )
    return {
        "losses": r.losses,
        "steps": r.steps,
        "four-on-four": (again.steps, again.losses, again.resumed_plan),
    }


def _two_ranks(rank: int, world: int, root: str) -> dict:
    from poise.train import train

    out: dict = {}
    # every plan that differs is adopted, priced on a test cluster of slow GEMMs next to fast
    # links (`helpers.slow_gemm_cluster`), where moving compute off a busy rank pays: on this
    # machine's calibration (the `cpu-2` preset) vExpert finds no move that does
    for policy in ["static", *POLICIES]:
        cluster = f"{root}/two-nodes.yaml" if policy == "hybrid" else f"{root}/slow-gemms.yaml"
        name = policy if policy != "static" else "static-skewed"
        cfg = _cfg(root, name, steps=POLICY_STEPS, policy=policy, cluster=cluster,
                   balance_guard=False, self_calibrate=False, **SKEWED)  # fmt: skip
        r = train(cfg, quiet=True)
        out[name] = (r.losses, r.plan_changes, r.max_over_mean)
    # free balancing (the timing oracle): EPLB re-planned every step, its work left out of time
    free = train(
        _cfg(root, "eplb-free", steps=POLICY_STEPS, policy="eplb", replan_every=1,
             balance_guard=False, self_calibrate=False, free_balancing=True, **SKEWED),
        quiet=True,
    )  # fmt: skip
    out["eplb-free"] = (free.losses, free.plan_changes, free.max_over_mean)
    # gradient accumulation: 2 micro-batches of 8 sequences a step, static and EPLB (replicas
    # from the first plan on, their gradients summed over both micro-batches before one Agg)
    half = {**SKEWED, "batch": SKEWED["batch"] // 2, "micro_batches": 2}
    for policy in ["static", "eplb"]:
        r = train(
            _cfg(root, f"{policy}-micro", steps=POLICY_STEPS, policy=policy,
                 balance_guard=False, self_calibrate=False, **half),
            quiet=True,
        )  # fmt: skip
        out[f"{policy}-micro"] = (r.losses, r.plan_changes, r.max_over_mean)
    static = train(_cfg(root, "static", steps=30, policy="static"), quiet=True)
    auto_cfg = _cfg(
        root,
        "auto",
        steps=30,
        policy="auto",
        checkpoint_every=10,
        keep_checkpoints=5,
        balance_guard=False,
        self_calibrate=False,
        cluster=f"{root}/slow-gemms.yaml",
    )  # fmt: skip  (every plan that
    # differs is adopted, priced on the test cluster: auto replicates, the losses must not move)
    auto = train(auto_cfg, quiet=True)
    resumed = train(
        auto_cfg.replace(out=f"{root}/auto-resumed"),
        resume=f"{root}/auto/checkpoints/step-00000020",
        quiet=True,
    )
    moved = train(
        _cfg(root, "four-on-two", steps=6, policy="auto", checkpoint_every=3),
        resume=f"{root}/four/checkpoints/step-00000003",
        quiet=True,
    )
    out["static"] = (static.losses, static.plan_changes, static.tokens_per_s, static.max_over_mean)
    out["auto"] = (auto.losses, auto.plan_changes, auto.tokens_per_s, auto.max_over_mean)
    out["resumed"] = (resumed.steps, resumed.losses, resumed.resumed_plan)
    out["four-on-two"] = (moved.steps, moved.losses, moved.resumed_plan)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("train")
    _two_nodes().save(root / "two-nodes.yaml")
    slow_gemm_cluster(2).save(root / "slow-gemms.yaml")  # one link the 2 ranks share
    four = run_ranks(_four_ranks, 4, str(root), timeout_s=300)
    two = run_ranks(_two_ranks, 2, str(root), timeout_s=400)
    for key in two[0]:  # every rank reports the same global losses
        assert two[0][key][0] == two[1][key][0], key
    assert four[0]["losses"] == four[3]["losses"]
    return root, four[0], two[0]


def test_every_policy_trains_with_the_same_losses(runs):
    _, _, two = runs
    reference = np.array(two["static-skewed"][0])
    assert len(reference) == POLICY_STEPS and np.all(np.isfinite(reference))
    for policy in POLICIES:
        losses = two[policy][0]
        assert np.max(np.abs(np.array(losses) - reference)) <= TOL, policy


def test_every_policy_changes_plans_and_lowers_device_imbalance(runs):
    """The same steps route the same tokens (equal losses), so static's device max/mean on
    them is the reference: each policy, its plans adopted, must have changed the plan and run
    its planned steps with less imbalance than static on the same steps."""
    _, _, two = runs
    static = np.array(two["static-skewed"][2])[PLANNED:]
    assert static.mean() > 1.2  # there is imbalance to remove
    for policy in POLICIES:
        _, changes, max_over_mean = two[policy]
        assert changes >= 1, policy
        planned = np.mean(max_over_mean[PLANNED:])
        assert planned < static.mean(), (policy, max_over_mean, static)


def test_micro_batches_give_the_losses_of_one_batch_of_their_sum(runs):
    """Two micro-batches of 8 sequences a step (gradient accumulation) train as one batch of
    16 (the same sequences, no auxiliary loss): the same losses step after step, static or
    with EPLB's replicas, whose gradients both micro-batches add to before one Agg."""
    import json

    root, _, two = runs
    reference = np.array(two["static-skewed"][0])  # batch 16, one micro-batch
    for name in ["static-micro", "eplb-micro"]:
        losses = np.array(two[name][0])
        assert losses.shape == reference.shape, name
        assert np.max(np.abs(losses - reference)) <= TOL, (name, losses, reference)
    assert two["eplb-micro"][1] >= 1  # it re-planned and switched
    metrics = root / "eplb-micro" / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert any(sum(row["replicas"]) > 0 for row in lines)  # Agg had replicas to sum
    # one Agg a step, for both micro-batches: it moves back what the Trans before it moved
    agg = [row["agg_bytes"] for row in lines[1:]]
    assert agg == [row["trans_bytes"] for row in lines[:-1]] and max(agg) > 0
    assert all(row["tokens"] == 16 * 32 for row in lines)  # both micro-batches counted
    # each step's counts `[L, D]` add up both micro-batches' forwards: top-1 of 16 x 32 tokens
    assert all(np.all(np.sum(row["device_tokens"], axis=1) == 16 * 32) for row in lines)


def test_free_balancing_takes_its_boundary_out_of_the_step(runs):
    """Under free balancing (`poise.train.instruments`) a step's recorded time leaves out what
    its Balancer did at the boundary: `step_s` is still the sum of the phases, and the `balance`
    phase no longer holds `step` itself (`moe_s.boundary`: the plan, its migration, the Trans),
    which it does in any other run. The losses stay static EP's."""
    import json

    root, _, two = runs
    reference = np.array(two["static-skewed"][0])
    assert np.max(np.abs(np.array(two["eplb-free"][0]) - reference)) <= TOL
    assert two["eplb-free"][1] >= 1  # it re-planned and switched
    lines = [json.loads(x) for x in (root / "eplb-free" / "metrics.jsonl").read_text().splitlines()]
    for row in lines:
        assert row["step_s"] == pytest.approx(sum(row["phases_s"].values()), abs=1e-9)
        assert row["moe_s"]["untimed"] >= row["moe_s"]["boundary"] > 0
    balance = np.median([row["phases_s"]["balance"] for row in lines])
    boundary = np.median([row["moe_s"]["boundary"] for row in lines])
    assert balance < boundary, (balance, boundary)


def test_static_and_auto_give_the_same_losses(runs):
    root, _, two = runs
    static, auto = np.array(two["static"][0]), np.array(two["auto"][0])
    assert static.shape == auto.shape == (30,)
    assert np.max(np.abs(static - auto)) <= TOL
    assert two["static"][1] == 0
    assert two["auto"][1] >= 1  # auto really replicated or moved experts
    assert static[-1] < static[0] - 1.0  # and the model learns
    from poise.trace.trace import Trace

    trace = Trace.load(root / "auto" / "trace.npz")
    assert trace.counts.shape == (30, 4, 2, 8)
    assert np.all(trace.counts.sum(axis=3) == 2 * 4 * 32)  # top-2 of 4 x 32 tokens per rank
    lines = (root / "auto" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 30
    import json

    # each step's line carries both ranks' own seconds (`rank_s`, `StepStats.rank_seconds`)
    for line in lines:
        rank_s = json.loads(line)["rank_s"]
        assert len(rank_s["period_s"]) == len(rank_s["experts_s"]) == 2
        assert all(x > 0 for x in rank_s["experts_s"])


def _model_tensors(path: Path) -> dict:
    from poise.train.checkpoint import read_file

    ckpt = read_file(path)
    flat = {f"dense.{k}": v for k, v in ckpt["model"]["dense"].items()}
    for layer, ws in ckpt["model"]["experts"].items():
        flat.update({f"{layer}.{k}": v for k, v in ws.items()})
    return flat


def test_resume_equals_an_uninterrupted_run(runs):
    root, _, two = runs
    steps, losses, resumed_plan = two["resumed"]
    assert steps == list(range(21, 31))
    assert resumed_plan
    assert np.max(np.abs(np.array(losses) - np.array(two["auto"][0][20:]))) <= TOL
    final = _model_tensors(root / "auto" / "checkpoints" / "step-00000030")
    again = _model_tensors(root / "auto-resumed" / "checkpoints" / "step-00000030")
    assert final.keys() == again.keys()
    for k in final:
        assert float((final[k] - again[k]).abs().max()) <= TOL, k
    from poise.trace.trace import Trace

    a = Trace.load(root / "auto" / "trace.npz")
    b = Trace.load(root / "auto-resumed" / "trace.npz")
    np.testing.assert_array_equal(a.counts, b.counts)


def test_resume_four_ranks_onto_two(runs):
    _, four, two = runs
    steps, losses, resumed_plan = two["four-on-two"]
    assert steps == [4, 5, 6]
    assert not resumed_plan  # a different world restarts from the static layout
    assert np.max(np.abs(np.array(losses) - np.array(four["losses"][3:]))) <= TOL


def test_summary_records_the_transfer_probe(runs):
    """A self-calibrating balancing run records its start-up probes (`poise.runtime.selfcal.probe`:
    the exchange's and the switch's, 2 homes a rank of the 8 experts on 2 ranks); a run
    without self-calibration or balancing does not probe."""
    import json

    root, _, _ = runs
    summary = json.loads((root / "four-on-two" / "summary.json").read_text())
    for name in ("transfer_probe", "switch_probe"):
        probe = summary[name]
        assert probe["measured_s"] > 0 and probe["modelled_s"] > 0
        assert probe["k"] == pytest.approx(probe["measured_s"] / probe["modelled_s"])
    assert summary["switch_probe"]["homes"] == 2
    for name in ("static", "auto"):  # static; auto with self_calibrate=False
        summary = json.loads((root / name / "summary.json").read_text())
        assert "transfer_probe" not in summary and "switch_probe" not in summary


def test_resume_four_ranks_onto_four(runs):
    _, four, _ = runs
    steps, losses, resumed_plan = four["four-on-four"]
    assert steps == [4, 5, 6]
    assert resumed_plan  # the same world re-applies the saved placement
    assert np.max(np.abs(np.array(losses) - np.array(four["losses"][3:]))) <= TOL


def test_poise_train_launches_ranks(tmp_path, capsys):
    """`poise train --nproc 2` starts two `python -m poise.train` ranks on a free port."""
    from poise.cli import main

    out = tmp_path / "run"
    code = main(
        [
            "train",
            "tiny",
            "--nproc",
            "2",
            "--steps",
            "2",
            "--policy",
            "auto",
            "--out",
            str(out),
            "--set",
            "context=32",
            "--set",
            "batch=4",
            "--set",
            "eval_every=2",
            "--set",
            f"cache_dir={tmp_path / 'cache'}",
            "--set",
            "checkpoint_every=2",
        ]
    )
    assert code == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert (out / "trace.npz").exists() and (out / "summary.json").exists()
    assert (out / "checkpoints" / "step-00000002").exists()


def test_checkpoint_loads_in_one_process_and_refuses_another_model(runs):
    """Experts are stored by id: a 2-rank checkpoint fills a one-process model (all 8 experts);
    a model of other shapes is refused with one clear error."""
    import torch

    from poise.models.gpt import GPTMoE
    from poise.train import checkpoint as ck
    from poise.train.loop import make_optimizer

    root, _, _ = runs
    ckpt = ck.load(root / "auto")
    whole = ck.read_file(ckpt["path"])
    cfg = _cfg(str(root), "unused")
    model = GPTMoE(cfg.model_config(), seed=5)
    opt = make_optimizer(model, cfg)
    ck.restore(model, opt, ckpt)
    saved = whole["model"]["experts"]["blocks.0.ffn"]["w_in"]
    assert torch.equal(model.blocks[0].ffn.experts.w_in.detach(), saved)
    assert len(opt.state) == len(list(model.parameters()))
    other = GPTMoE(cfg.replace(model_args={"d_expert": 128}).model_config())
    with pytest.raises(ck.CheckpointError, match=r"layer blocks\.0\.ffn: .*w_in must be"):
        ck.restore(other, make_optimizer(other, cfg), ckpt)


def test_the_trainer_tells_the_balancer_where_the_run_ends(tmp_path):
    """One rank: the Balancer knows the run's last step (`TrainConfig.steps`), so it plans
    nothing that would serve no step."""
    from poise.train.loop import _Trainer

    cfg = _cfg(str(tmp_path), "ends", steps=7, policy="auto", threads=1)
    trainer = _Trainer(cfg, None, quiet=True)
    try:
        assert trainer.balancer.config.total_steps == 7
        steps_left = trainer.balancer.planning.steps_left
        assert steps_left(6) == 0 < steps_left(5)
    finally:
        trainer.balancer.close()
        trainer.log.close()


def test_a_steps_balancer_fields_as_logged() -> None:
    """`StepStats.as_record`: the metrics line's Balancer fields, `seconds` as `moe_s` and
    `rank_seconds` as `rank_s`; a step before the Balancer's first logs its defaults."""
    from poise.runtime.stats import StepStats

    stats = StepStats(step=3, policy="auto", trans_bytes=10, decision="adopt", switched=True)
    stats.add_seconds("experts", 0.5)
    stats.rank_seconds = {"period": [1.0, 2.0]}
    record = stats.as_record()
    assert record["moe_s"] == {"experts": 0.5} and record["rank_s"] == {"period": [1.0, 2.0]}
    assert record["trans_bytes"] == 10 and record["decision"] == "adopt" and record["switched"]
    assert "step" not in record and "policy" not in record and "seconds" not in record
    empty = StepStats(step=0, policy="static").as_record()
    assert empty["device_tokens"] == [] and empty["fit"] == {} and empty["switched"] is False
