"""The benchmarks' peer systems (DeepSpeed-MoE, torchtitan) skip cleanly where their packages
are absent: one `skipped` JSON line each saying "not installed", Poise's own lines unchanged."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.helpers import BENCHMARKS, load_benchmark

PEER_PACKAGES = ("deepspeed", "torchtitan")


@pytest.fixture
def no_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks importable, and the peer packages absent even where installed."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    find_spec = importlib.util.find_spec

    def absent(name: str, *args: object, **kwargs: object) -> object:
        if name.split(".")[0] in PEER_PACKAGES:
            return None
        return find_spec(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", absent)
    for name in [m for m in sys.modules if m.split(".")[0] in PEER_PACKAGES]:
        monkeypatch.delitem(sys.modules, name)


def test_moe_layer_skips_absent_peers(no_peers: None, capsys: pytest.CaptureFixture) -> None:
    moe_layer = load_benchmark("moe_layer")
    threads = torch.get_num_threads()
    try:
        tiny = "--tokens 64 --d-model 32 --d-expert 32 --experts 4 --reps 1 --warmup 0"
        assert moe_layer.main([*tiny.split(), "--routing", "uniform"]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(s) for s in capsys.readouterr().out.splitlines()]
    skipped = {x["impl"]: x["skipped"] for x in lines if "skipped" in x}
    assert set(skipped) == {"deepspeed-drop", "deepspeed-nodrop", "torchtitan"}
    assert all("not installed" in note for note in skipped.values())
    assert [x["impl"] for x in lines if "skipped" not in x] == ["poise", "dense"]


def test_ep_step_skips_absent_peers(no_peers: None) -> None:
    ep_step = load_benchmark("ep_step")
    notes = ep_step.peer_notes(ep_step.parse_args([]))
    assert set(notes) == set(PEER_PACKAGES)
    assert all("not installed" in note for note in notes.values())
    assert ep_step.peer_systems(notes) == []  # the ranks step Poise's models only
    lines = ep_step.skipped_lines(notes)
    assert [x["impl"] for x in lines] == ["deepspeed-nodrop", "deepspeed-drop", "torchtitan"]
    # --no-* skips say so, and say it even where the package is absent.
    flags = ep_step.parse_args(["--no-deepspeed", "--no-torchtitan"])
    assert all(n.startswith("skipped (--no-") for n in ep_step.peer_notes(flags).values())
