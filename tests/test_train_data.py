"""Byte-level corpus: sources, cache, clear errors on bad input, deterministic sharded batches."""

from __future__ import annotations

import numpy as np
import pytest

from poise.train.data import DataError, Sampler, build_corpus, list_sources, shard_rows


def _text_folder(root, files: int = 3, size: int = 3000):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        words = " ".join(f"word{(i * 7 + j) % 50}" for j in range(size // 7))
        (root / f"doc{i}.txt").write_text(words + "\n", encoding="utf-8")
    return root


def test_empty_folder_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as err:
        build_corpus(empty, cache_dir=tmp_path / "cache")
    msg = err.value.one_line()
    assert str(empty) in msg and "no files" in msg and "data" in msg


def test_binary_file_is_a_clear_error(tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"PK\x03\x04\x00\x00\xff\xfe" * 100)
    with pytest.raises(DataError, match="NUL bytes") as err:
        build_corpus(blob, cache_dir=tmp_path / "cache")
    assert str(blob) in err.value.one_line()
    latin = tmp_path / "notes.txt"
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        build_corpus(latin, cache_dir=tmp_path / "cache")
    folder = _text_folder(tmp_path / "mixed")
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(DataError) as err:
        build_corpus(folder, cache_dir=tmp_path / "cache")
    assert "image.png" in err.value.one_line()
    assert not list((tmp_path / "cache").glob("*.bin"))  # nothing half-built is left


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        build_corpus(tmp_path / "nope", cache_dir=tmp_path / "cache")


def test_corpus_is_cached_and_split(tmp_path):
    folder = _text_folder(tmp_path / "docs")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "x.txt").write_bytes(b"\0\0")  # skipped folder
    cache = tmp_path / "cache"
    c1 = build_corpus(folder, cache_dir=cache, val_fraction=0.1, min_val=10)
    stamp = c1.path.stat().st_mtime_ns
    c2 = build_corpus(folder, cache_dir=cache, val_fraction=0.1, min_val=10)
    assert c2.path == c1.path and c2.path.stat().st_mtime_ns == stamp  # read, not rebuilt
    assert c1.files == 3
    raw = b"".join((folder / f"doc{i}.txt").read_bytes() + b"\0" for i in range(3))
    assert bytes(c1.tokens) == raw
    assert len(c1.val) == int(len(raw) * 0.1) and len(c1.train) + len(c1.val) == len(raw)
    (folder / "doc3.txt").write_text("more text\n")  # a new source gives a new cache file
    assert build_corpus(folder, cache_dir=cache, val_fraction=0.1, min_val=10).path != c1.path


def test_default_corpus_is_the_standard_library():
    root, files = list_sources(None)
    assert files and all(f.suffix == ".py" for f in files)
    assert all("site-packages" not in f.parts for f in files)
    assert [f.relative_to(root).as_posix() for f in files] == sorted(
        f.relative_to(root).as_posix() for f in files
    )


def test_sampler_shards_and_positions_are_exact():
    tokens = np.arange(1000, dtype=np.int64).astype(np.uint8)
    s = Sampler(tokens, context=16, seed=3)
    B = 8
    full_x, full_y = s.batch(40, range(B))
    assert full_x.shape == (B, 16) and np.array_equal(full_x[:, 1:], full_y[:, :-1])
    for world in (2, 4):  # the ranks' shards make up the global batch, whatever the world
        parts = [s.batch(40, shard_rows(B, r, world))[0] for r in range(world)]
        assert np.array_equal(np.concatenate(parts), full_x)
    again = Sampler(tokens, context=16, seed=3)  # restoring the position restores the data
    assert np.array_equal(again.batch(40, range(B))[0], full_x)
    # an epoch is every window once, then a new order
    ids = s.window_ids(range(2 * s.windows))
    assert sorted(ids[: s.windows]) == list(range(s.windows))
    assert not np.array_equal(ids[: s.windows], ids[s.windows :])
    with pytest.raises(DataError, match="do not fill one window"):
        Sampler(tokens[:10], context=16)
    with pytest.raises(Exception, match="not divisible"):
        shard_rows(6, 0, 4)
