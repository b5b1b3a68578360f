"""`poise plan` end to end, in-process, and the trace replays of `poise demo`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from poise.cli import main
from poise.plan.eplb_format import placement_from_eplb
from poise.trace.generate import generate


def test_plan_on_smartmoe_sample_with_eplb_export(smartmoe_dir, tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    eplb = tmp_path / "eplb"
    code = main(
        [
            "plan",
            str(smartmoe_dir),
            "--policy",
            "auto",
            "--cluster",
            "v100-ib50",
            "--slots",
            "3",
            "--out",
            str(out),
            "--eplb",
            str(eplb),
        ]
    )
    assert code == 0
    plan = json.loads(out.read_text())
    assert plan["policy"] == "auto" and plan["devices"] == 16 and len(plan["layers"]) == 24
    assert plan["cost"]["step_s"] > 0
    phy2log = np.load(eplb / "phy2log.npy")
    assert phy2log.shape == (24, 16 * 3)
    placement = placement_from_eplb(phy2log, 16)
    for layer in plan["layers"]:
        copies = placement.copies[layer["layer"]]
        for expert, device in layer["replicas"]:
            assert copies[device, expert] >= 1
        for expert, device in enumerate(layer["home"]):
            assert copies[device, expert] >= 1
    printed = capsys.readouterr().out
    assert "predicted step time" in printed


def test_plan_every_policy_on_generated_trace(tmp_path) -> None:
    trace = generate("zipf", steps=2, layers=2, devices=8, experts=16, top_k=2, seed=1, s=1.2)
    path = tmp_path / "t.npz"
    trace.save(path)
    for policy in ("static", "shadow", "permute", "vexpert", "eplb", "prophet", "hybrid", "auto"):
        out = tmp_path / f"{policy}.json"
        assert (
            main(
                [
                    "plan",
                    str(path),
                    "--policy",
                    policy,
                    "--cluster",
                    "dgx-h100:1",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        assert json.loads(out.read_text())["policy"] == policy


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "missing.npz"], "missing.npz"),
        (["plan", "{trace}", "--cluster", "nowhere-9"], "nowhere-9"),
        (["plan", "{trace}", "--policy", "magic"], "policy"),
        (["plan", "{trace}", "--cluster", "rtx3090-ib100:3"], "devices"),  # 12 vs 8 devices
        (["plan", "{trace}", "--model", "tiny"], "experts"),  # tiny has 8 experts, trace 16
        (["plan", "{trace}", "--cluster", "dgx-h100:1", "--slots", "1"], "slots"),  # need 2
        (["plan", "{trace}", "--option", "vexpert"], "--option"),
        (["plan", "{trace}", "--schedule", "eager"], "schedule"),
    ],
)
def test_plan_bad_input_is_one_line(tmp_path, capsys, args: list[str], needle: str) -> None:
    trace = generate("uniform", steps=1, layers=1, devices=8, experts=16, seed=0)
    path = tmp_path / "t.npz"
    trace.save(path)
    argv = [a.replace("{trace}", str(path)) for a in args] + ["--out", str(tmp_path / "p.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poise: error:")
    assert needle in err[0]
    assert "Traceback" not in err[0]


def test_demo_trace_replays(shared_data) -> None:
    """The replay section of `poise demo`'s report: the SmartMoE-AE sample and the synthetic
    drifting trace through every policy (the demo's training runs are tested in test_demo)."""
    from rich.console import Console

    from poise.commands.demo import QUICK, replay_sections

    sections = replay_sections(str(shared_data), QUICK, Console(quiet=True))
    assert [s.key for s in sections] == ["smartmoe-sample", "zipf-drift"]
    for section in sections:
        assert set(section.runs) == {
            "static", "shadow", "permute", "vexpert", "eplb", "prophet", "hybrid", "auto"
        }  # fmt: skip
        assert section.runs["static"].device_load is not None
        assert section.runs["auto"].mean_step_s <= section.runs["static"].mean_step_s
