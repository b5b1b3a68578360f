"""`poise trace`: generate -> stats -> convert in-process, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from poise.cli import main
from poise.trace.trace import Trace


def test_generate_stats_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "z.npz"
    rc = main(
        [
            "trace",
            "generate",
            "zipf",
            str(out),
            "--steps",
            "12",
            "--layers",
            "2",
            "--devices",
            "4",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--tokens-per-device",
            "16",
            "--seed",
            "7",
            "--param",
            "s=1.5",
        ]
    )
    assert rc == 0
    assert "wrote" in capsys.readouterr().out
    t = Trace.load(out)
    assert t.counts.shape == (12, 2, 4, 8)
    assert t.meta["params"] == {"s": 1.5} and t.meta["seed"] == 7
    assert (t.counts.sum(axis=3) == 32).all()

    assert main(["trace", "stats", str(out)]) == 0
    table = capsys.readouterr().out
    assert "max/mean" in table and "Gini" in table

    assert main(["trace", "stats", str(out), "--json", "--layout-devices", "2"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["shape"] == [12, 2, 4, 8]
    assert stats["device_imbalance"]["devices"] == 2

    copy = tmp_path / "copy.npz"
    assert main(["trace", "convert", str(out), str(copy), "--name", "renamed"]) == 0
    capsys.readouterr()
    back = Trace.load(copy)
    np.testing.assert_array_equal(back.counts, t.counts)
    assert back.name == "renamed"


def test_convert_importers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], smartmoe_dir: Path, olmoe_json: Path
) -> None:
    sm = tmp_path / "sm.npz"
    assert main(["trace", "convert", str(smartmoe_dir), str(sm), "--format", "smartmoe"]) == 0
    assert Trace.load(sm).counts.shape == (3, 24, 16, 32)
    ol = tmp_path / "ol.npz"
    assert (
        main(
            [
                "trace",
                "convert",
                str(olmoe_json),
                str(ol),
                "--model",
                "mistral",
                "--domain",
                "c4",
                "--devices",
                "2",
            ]
        )
        == 0
    )
    t = Trace.load(ol)
    assert t.counts.shape == (1, 3, 2, 8) and t.top_k == 2
    w = tmp_path / "w.json"
    w.write_text(json.dumps({"weight": [[1, 2], [3, 4]]}))
    ep = tmp_path / "ep.npz"
    assert main(["trace", "convert", str(w), str(ep), "--devices", "2", "--top-k", "1"]) == 0
    assert Trace.load(ep).counts.shape == (1, 2, 2, 2)
    assert "wrote" in capsys.readouterr().out


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("poise: error:")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_bad_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    assert main(["trace", "stats", str(bad)]) == 2
    _one_line_error(capsys, "bad.npz")


def test_bad_import_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = tmp_path / "w.json"
    w.write_text("[[1, 2], [3]]")
    assert main(["trace", "convert", str(w), str(tmp_path / "o.npz")]) == 2
    _one_line_error(capsys, "w.json", "ragged")
    assert not (tmp_path / "o.npz").exists()


def test_bad_smartmoe_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "stats", str(tmp_path)]) == 2
    _one_line_error(capsys, str(tmp_path), "table_iter")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trace", "generate", "nope", "OUT"], "unknown trace generator"),
        (["trace", "generate", "zipf", "OUT", "--param", "s=-1"], "s"),
        (["trace", "generate", "zipf", "OUT", "--param", "bogus=1"], "bogus"),
        (["trace", "generate", "zipf", "OUT", "--param", "novalue"], "KEY=VALUE"),
        (["trace", "generate", "zipf", "OUT", "--steps", "0"], "steps"),
        (["trace", "generate", "zipf", "out.txt"], ".npz"),
    ],
)
def test_bad_generate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    argv = [str(tmp_path / "out.npz") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    _one_line_error(capsys, needle)


def test_option_not_for_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = tmp_path / "w.json"
    w.write_text("[[1, 2]]")
    assert main(["trace", "stats", str(w), "--model", "olmoe"]) == 2
    _one_line_error(capsys, "model")
