"""Checkpoints are verified before they are used (`poise.train.checkpoint.verify`): each holds a
`manifest.json` with every file's size and SHA-256, written last. A damaged, truncated or
missing shard, or a missing manifest, is never resumed: from a run folder the newest checkpoint
that verifies is chosen (one line naming the one skipped and why), a checkpoint named itself
must verify, and when none does `poise train --resume` is one line and exit status 2. The
fallback resumes to the same losses as resuming the older checkpoint directly."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from poise.cli import main
from poise.runtime.launch import run_ranks
from poise.train import checkpoint as ck

from .helpers import tiny_train_config


def _saves(tmp_path: Path) -> tuple[Path, Path]:
    """Two checkpoints (steps 1 and 2) of a one-process tiny model."""
    from poise.models.gpt import GPTMoE
    from poise.train.setup import make_optimizer

    cfg = tiny_train_config(str(tmp_path), "solo")
    model = GPTMoE(cfg.model_config(), seed=3)
    opt = make_optimizer(model, cfg)
    model(torch.randint(0, 256, (2, 16))).float().square().mean().backward()
    opt.step()
    out = tmp_path / "solo"
    kw = dict(data_position=0, config=cfg.to_dict(), keep=5)
    first = ck.save(model, opt, None, out, step=1, **kw)
    return first, ck.save(model, opt, None, out, step=2, **kw)


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("*.distcp"))[0]


def _overwrite(folder: Path) -> None:  # a few hundred bytes in the middle of a shard
    shard = _shard(folder)
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 300] = bytes((b ^ 0x5A) for b in data[mid : mid + 300])
    shard.write_bytes(bytes(data))


def _truncate(folder: Path) -> None:
    shard = _shard(folder)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])


def _remove_shard(folder: Path) -> None:
    _shard(folder).unlink()


def _remove_manifest(folder: Path) -> None:
    (folder / ck.MANIFEST).unlink()


def _garble_manifest(folder: Path) -> None:
    (folder / ck.MANIFEST).write_text("{not json")


def _damage_meta(folder: Path) -> None:  # poise.pt: same size, other bytes
    meta = folder / ck.META
    data = bytearray(meta.read_bytes())
    data[-200:-100] = b"\0" * 100
    meta.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "300 bytes overwritten": (_overwrite, "SHA-256"),
    "truncated shard": (_truncate, "truncated"),
    "missing shard": (_remove_shard, "is missing"),
    "missing manifest": (_remove_manifest, "no manifest.json"),
    "garbled manifest": (_garble_manifest, "unreadable"),
    "poise.pt overwritten": (_damage_meta, "poise.pt does not match"),
}


def test_a_fresh_checkpoint_lists_every_file(tmp_path: Path) -> None:
    _, second = _saves(tmp_path)
    doc = json.loads((second / ck.MANIFEST).read_text())
    names = {p.name for p in second.iterdir()} - {ck.MANIFEST}
    assert set(doc["files"]) == names and {ck.META, ".metadata"} <= names
    assert any(n.endswith(".distcp") for n in names)
    ck.verify(second)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_is_refused_and_the_older_one_used(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = _saves(tmp_path)
    damage, needle = DAMAGE[kind]
    damage(second)
    with pytest.raises(ck.CheckpointError, match=needle) as err:
        ck.resolve(second)  # named itself: refused, never another step instead
    assert "\n" not in str(err.value)
    capsys.readouterr()
    for where in (tmp_path / "solo", tmp_path / "solo" / "checkpoints"):
        assert ck.resolve(where) == first
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        assert second.name in lines[0] and needle in lines[0] and first.name in lines[0]
    assert ck.load(tmp_path / "solo")["step"] == 1
    with pytest.raises(ck.CheckpointError, match=needle):
        ck.read_file(second)


def test_when_none_verifies_train_resume_is_one_line(tmp_path: Path) -> None:
    first, second = _saves(tmp_path)
    _overwrite(first)
    _remove_manifest(second)
    with pytest.raises(ck.CheckpointError, match="no checkpoint here verifies"):
        ck.resolve(tmp_path / "solo")
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["train", "tiny", "--out", str(tmp_path / "new"), "--quiet",
                     "--resume", str(tmp_path / "solo")])  # fmt: skip
    text = err.getvalue()
    assert code == 2, text
    assert text.count("\n") == 1 and text.startswith("poise: error: "), text
    assert "Traceback" not in text
    assert first.name in text and second.name in text and "no manifest.json" in text


def _fallback(rank: int, world: int, root: str) -> dict[str, list[float]]:
    from poise.train import train

    def cfg(name: str, steps: int):
        return tiny_train_config(root, name, steps=steps, checkpoint_every=2, keep_checkpoints=5)

    train(cfg("run", 4), quiet=True)
    ckpts = Path(root) / "run" / "checkpoints"
    _overwrite(ckpts / "step-00000004")
    fell_back = train(cfg("fell", 6), resume=str(Path(root) / "run"), quiet=True)
    direct = train(cfg("direct", 6), resume=str(ckpts / "step-00000002"), quiet=True)
    return {"fell": fell_back.losses, "direct": direct.losses, "steps": fell_back.steps}


@pytest.mark.dist
def test_the_fallback_resumes_as_the_older_checkpoint_does(tmp_path: Path) -> None:
    out = run_ranks(_fallback, 1, str(tmp_path), timeout_s=300)[0]
    assert out["steps"] == [3, 4, 5, 6]
    assert np.array_equal(np.array(out["fell"]), np.array(out["direct"]))
