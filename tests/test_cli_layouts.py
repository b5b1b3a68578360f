"""`poise layouts` end to end, in-process: the ranked table, the JSON, one-line errors."""

from __future__ import annotations

import json

import pytest

from poise.cli import main
from poise.layouts.pool import Layout
from poise.trace.generate import generate


@pytest.fixture
def zipf_trace(tmp_path):
    trace = generate("zipf", steps=3, layers=2, devices=8, experts=16, top_k=2, seed=1, s=1.2)
    path = tmp_path / "zipf.npz"
    trace.save(path)
    return path


def test_layouts_table_and_json(zipf_trace, tmp_path, capsys) -> None:
    out = tmp_path / "out" / "layouts.json"
    code = main(
        ["layouts", str(zipf_trace), "--cluster", "dgx-h100:1", "--pool", "3", "--json", str(out)]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["cluster"] == "dgx-h100:1" and data["devices"] == 8
    ranked = data["ranked"]
    # 8 devices, 16 experts, 2 layers: pp in {1, 2}; ep | 8 / pp and ep | 16.
    expected = {(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4)}
    assert {(r["pp"], r["ep"]) for r in ranked} == expected
    steps = [r["step_s"] for r in ranked]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    assert data["pool"] == [r["name"] for r in ranked[:3]]
    for r in ranked:
        assert r["edp"] * r["ep"] * r["pp"] == 8
        assert r["experts_per_device"] == 16 // r["ep"]
        assert len(r["homes"]) == 2 and len(r["homes"][0]) == 16
    assert not [p for p in out.parent.iterdir() if p.name != "layouts.json"]  # no temp files
    best = Layout.from_dict(ranked[0], source=str(out))  # what a run would start in
    assert best.name == ranked[0]["name"] and best.devices == 8
    printed = capsys.readouterr().out
    assert "poise layouts" in printed and "pool: " + ", ".join(data["pool"]) in printed
    assert ranked[0]["name"] in printed


def test_static_flag_prices_without_permute(zipf_trace, tmp_path) -> None:
    out = tmp_path / "static.json"
    argv = ["layouts", str(zipf_trace), "--cluster", "dgx-h100:1", "--static", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["online"] is False
    assert all(r["step_s"] == r["static_s"] for r in data["ranked"])


def test_layouts_on_smartmoe_sample(smartmoe_dir, tmp_path, capsys) -> None:
    out = tmp_path / "l.json"
    assert main(["layouts", str(smartmoe_dir), "--cluster", "v100-ib50", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["steps_priced"] == 3 and len(data["pool"]) == 4
    assert [r["name"] for r in data["rejected"]] == ["pp1-ep1-edp16"]
    assert "GiB" in data["rejected"][0]["reason"]
    assert "rejected pp1-ep1-edp16" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["layouts", "missing.npz"], "missing.npz"),
        (["layouts", "{trace}", "--cluster", "rtx3090-ib100:3"], "devices"),  # 12 vs 8 devices
        (["layouts", "{trace}", "--model", "nosuch-model"], "nosuch-model"),
        (["layouts", "{trace}", "--model", "tiny"], "experts"),  # tiny has 8 experts, trace 16
        (["layouts", "{trace}", "--cluster", "nowhere-9"], "nowhere-9"),
        (["layouts", "{trace}", "--pool", "0"], "pool"),
        (["layouts", "{trace}", "--micro-batches", "0"], "micro-batches"),
        (["layouts", "{trace}", "--schedule", "eager"], "schedule"),
    ],
)
def test_bad_input_is_one_line(zipf_trace, tmp_path, capsys, args: list[str], needle: str) -> None:
    out = tmp_path / "keep.json"
    out.write_text("previous\n")
    argv = [a.replace("{trace}", str(zipf_trace)) for a in args] + ["--json", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poise: error:")
    assert needle in err[0] and "Traceback" not in err[0]
    assert out.read_text() == "previous\n"  # nothing written on failure
