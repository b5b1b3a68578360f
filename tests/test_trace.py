"""`Trace`: validation and the .npz round trip, including corrupt and incomplete files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from poise.core.errors import TraceError
from poise.trace.trace import SCHEMA_VERSION, Trace


def small_trace() -> Trace:
    counts = np.arange(2 * 3 * 2 * 4, dtype=np.int64).reshape(2, 3, 2, 4) % 5
    return Trace(
        counts,
        np.array([10, 20]),
        top_k=2,
        tokens_per_device=10,
        name="t",
        meta={"origin": "test", "n": [1, 2]},
    )


def write_npz(path: Path, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(buf.getvalue())


def good_arrays() -> dict[str, np.ndarray]:
    t = small_trace()
    return {
        "schema_version": np.array(SCHEMA_VERSION),
        "counts": t.counts,
        "step_ids": t.step_ids,
        "top_k": np.array(t.top_k),
        "tokens_per_device": np.array(t.tokens_per_device),
        "name": np.array("t"),
        "meta": np.array(json.dumps({"a": 1})),
    }


def test_properties_and_views() -> None:
    t = small_trace()
    assert (t.steps, t.layers, t.devices, t.experts) == (2, 3, 2, 4)
    assert t.expert_load().shape == (2, 3, 4)
    np.testing.assert_array_equal(t.expert_load(), t.counts.sum(axis=2))
    part = t.slice_steps(1)
    assert part.steps == 1 and part.step_ids.tolist() == [20]


def test_roundtrip(tmp_path: Path) -> None:
    t = small_trace()
    path = tmp_path / "sub" / "t.npz"
    t.save(path)
    back = Trace.load(path)
    np.testing.assert_array_equal(back.counts, t.counts)
    np.testing.assert_array_equal(back.step_ids, t.step_ids)
    assert (back.top_k, back.tokens_per_device, back.name) == (2, 10, "t")
    assert back.meta == {"origin": "test", "n": [1, 2]}
    assert back.counts.dtype == np.int64


def test_int32_counts_become_int64() -> None:
    t = Trace(np.ones((1, 1, 1, 2), dtype=np.int32), np.array([0]), 1, 2)
    assert t.counts.dtype == np.int64


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"counts": np.ones((2, 2, 2))}, "counts"),
        ({"counts": np.ones((1, 1, 1, 2))}, "counts"),  # float
        ({"counts": -np.ones((1, 1, 1, 2), dtype=np.int64)}, "counts"),
        ({"counts": np.ones((0, 1, 1, 2), dtype=np.int64)}, "counts"),
        ({"step_ids": np.array([0, 1])}, "step_ids"),
        ({"step_ids": np.array([0.0])}, "step_ids"),
        ({"top_k": 3}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"tokens_per_device": 0}, "tokens_per_device"),
        ({"counts": np.full((1, 1, 1, 2), 5, dtype=np.int64)}, "counts"),  # 10 > 1 * 4
    ],
)
def test_validation_errors(kwargs: dict, field: str) -> None:
    args = {
        "counts": np.ones((1, 1, 1, 2), dtype=np.int64),
        "step_ids": np.array([0]),
        "top_k": 1,
        "tokens_per_device": 4,
    }
    args.update(kwargs)
    with pytest.raises(TraceError) as exc:
        Trace(**args)
    assert exc.value.field == field


def test_step_ids_must_increase() -> None:
    with pytest.raises(TraceError, match="increasing"):
        Trace(np.ones((2, 1, 1, 2), dtype=np.int64), np.array([5, 5]), 1, 4)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not found") as exc:
        Trace.load(tmp_path / "nope.npz")
    assert "nope.npz" in str(exc.value)


def test_load_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.npz"
    path.write_bytes(b"PK\x03\x04 this is not a zip archive")
    with pytest.raises(TraceError) as exc:
        Trace.load(path)
    assert "bad.npz" in str(exc.value)


def test_load_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    small_trace().save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError) as exc:
        Trace.load(path)
    assert "t.npz" in str(exc.value)


@pytest.mark.parametrize(
    "missing", ["schema_version", "counts", "step_ids", "top_k", "tokens_per_device"]
)
def test_load_missing_field(tmp_path: Path, missing: str) -> None:
    arrays = good_arrays()
    del arrays[missing]
    path = tmp_path / "m.npz"
    write_npz(path, **arrays)
    with pytest.raises(TraceError) as exc:
        Trace.load(path)
    assert exc.value.field == missing
    assert "m.npz" in str(exc.value)


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("schema_version", np.array(99), "schema_version"),
        ("top_k", np.array([1, 2]), "top_k"),
        ("top_k", np.array(1.5), "top_k"),
        ("meta", np.array("{not json"), "meta"),
        ("meta", np.array("[1, 2]"), "meta"),
        ("counts", np.ones((2, 3, 2, 4)), "counts"),
        ("step_ids", np.array([3, 1]), "step_ids"),
    ],
)
def test_load_bad_field(tmp_path: Path, key: str, value: np.ndarray, field: str) -> None:
    arrays = good_arrays()
    arrays[key] = value
    path = tmp_path / "b.npz"
    write_npz(path, **arrays)
    with pytest.raises(TraceError) as exc:
        Trace.load(path)
    assert exc.value.field == field
    assert "b.npz" in str(exc.value)


def test_name_defaults_to_stem(tmp_path: Path) -> None:
    arrays = good_arrays()
    del arrays["name"], arrays["meta"]
    path = tmp_path / "stem.npz"
    write_npz(path, **arrays)
    t = Trace.load(path)
    assert t.name == "stem" and t.meta == {}
