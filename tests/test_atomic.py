"""Atomic writes: whole files or nothing, readable like an ordinary file."""

from __future__ import annotations

import os

import pytest

from poise.util.atomic import atomic_write_bytes, atomic_write_text


def test_write_replace_and_permissions(tmp_path) -> None:
    path = tmp_path / "sub" / "out.txt"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in path.parent.iterdir()] == ["out.txt"]


def test_failure_mid_write_keeps_the_previous_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "out.bin"
    atomic_write_bytes(path, b"saved")

    def crash(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"half")
    assert path.read_bytes() == b"saved"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
