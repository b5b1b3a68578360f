"""Importers: the real SmartMoE-AE and OLMoE data, EPLB matrices, and bad input for each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.errors import ConfigError, TraceError
from poise.trace.generate import generate
from poise.trace.importers import (
    default_top_k,
    detect_format,
    import_eplb,
    import_expert_counts,
    import_smartmoe,
    load_any,
    spread_evenly,
)

# --------------------------------------------------------------------------- SmartMoE-AE (real)


def test_smartmoe_sample(smartmoe_dir: Path) -> None:
    t = import_smartmoe(smartmoe_dir)
    assert t.counts.shape == (3, 24, 16, 32)
    assert t.step_ids.tolist() == [1, 1001, 5001]
    assert t.top_k == 2
    # 4 micro-batches x 2048 tokens x top-2 per rank and layer
    assert (t.counts.sum(axis=3) == 4 * 2048 * 2).all()
    assert t.tokens_per_device == 4 * 2048
    assert t.meta["micro_batches"] == 4
    assert t.meta["tokens_per_micro_batch"] == 2048
    load = t.expert_load()
    skew = load.max(axis=-1) / load.mean(axis=-1)  # [S, L]
    assert skew[1:].max() > 8  # heavy skew after warm-up, no balance loss
    assert np.median(skew[1:]) > 5


def test_smartmoe_first_line_matches_file(smartmoe_dir: Path) -> None:
    t = import_smartmoe(smartmoe_dir)
    line = (smartmoe_dir / "table_iter1001_rank3.log").read_text().splitlines()[5]
    blocks = json.loads(line.split(":", 1)[1])
    np.testing.assert_array_equal(t.counts[1, 5, 3], np.array(blocks).sum(axis=0).astype(int))


def test_smartmoe_options(smartmoe_dir: Path) -> None:
    t = import_smartmoe(smartmoe_dir, top_k=1, tokens_per_device=20000, name="sm")
    assert (t.top_k, t.tokens_per_device, t.name) == (1, 20000, "sm")
    with pytest.raises(TraceError) as exc:
        import_smartmoe(smartmoe_dir, tokens_per_device=100)
    assert "smartmoe-ae-sample" in str(exc.value)


# --------------------------------------------------------------------------- SmartMoE-AE (bad)


def line(layer: int, blocks: list[list]) -> str:
    return f"{layer}:{json.dumps(blocks)}"


def write_smartmoe(folder: Path, iters=(1, 11), ranks=2, layers=3, experts=4, micro=2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for it in iters:
        for r in ranks if isinstance(ranks, (list, tuple)) else range(ranks):
            rows = [
                line(
                    layer,
                    [[float(layer + r + e + m) for e in range(experts)] for m in range(micro)],
                )
                for layer in range(layers)
            ]
            (folder / f"table_iter{it}_rank{r}.log").write_text("\n".join(rows) + "\n")
    return folder


def test_smartmoe_synthetic_folder(tmp_path: Path) -> None:
    folder = write_smartmoe(tmp_path / "mt")
    (folder / "README.txt").write_text("ignored")
    t = import_smartmoe(folder)
    assert t.counts.shape == (2, 3, 2, 4)
    assert t.step_ids.tolist() == [1, 11]
    # layer 2, rank 1, expert 3: micro-batches (2+1+3+0) + (2+1+3+1) = 13
    assert t.counts[0, 2, 1, 3] == 13


def corrupt(folder: Path, name: str, n: int, text: str) -> Path:
    path = folder / name
    lines = path.read_text().splitlines()
    lines[n - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("1:[[1, 2, 3, 4], [1, 2, 3]]", "ragged"),
        ("1:[[1, 2, 3, 4], [1, 2, 3, -4]]", "negative"),
        ('1:[[1, 2, 3, 4], [1, 2, 3, "x"]]', "non-numeric"),
        ("1:[[1, 2, 3, 4], [1, 2, 3, 4.5]]", "whole number"),
        ("1:[[1, 2, 3, 4], [1, 2, 3, NaN]]", "whole number"),
        ("1:[[1, 2, 3, 4], [1, 2, 3, 4]", "not a list"),
        ("7:[[1, 2, 3, 4], [1, 2, 3, 4]]", "layer number"),
        ("[[1, 2, 3, 4], [1, 2, 3, 4]]", "expected"),
        ("1:[[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]", "experts"),
        ("1:[[1, 2, 3, 4]]", "micro-batches"),
        ("1:[1, 2, 3, 4]", "expected a list"),
    ],
)
def test_smartmoe_bad_line(tmp_path: Path, text: str, needle: str) -> None:
    folder = write_smartmoe(tmp_path / "mt")
    bad = corrupt(folder, "table_iter11_rank1.log", 2, text)
    with pytest.raises(TraceError, match=needle) as exc:
        import_smartmoe(folder)
    assert str(bad) in str(exc.value)
    assert exc.value.field == "line 2"


def test_smartmoe_missing_rank(tmp_path: Path) -> None:
    folder = write_smartmoe(tmp_path / "mt", ranks=3)
    (folder / "table_iter11_rank1.log").unlink()
    with pytest.raises(TraceError, match=r"table_iter11_rank1\.log") as exc:
        import_smartmoe(folder)
    assert str(folder) in str(exc.value)
    assert exc.value.field == "iteration 11"


def test_smartmoe_gap_in_ranks(tmp_path: Path) -> None:
    folder = write_smartmoe(tmp_path / "mt", ranks=[0, 2])
    with pytest.raises(TraceError, match="rank1"):
        import_smartmoe(folder)


def test_smartmoe_layer_count_differs(tmp_path: Path) -> None:
    folder = write_smartmoe(tmp_path / "mt", iters=(1,))
    path = folder / "table_iter1_rank1.log"
    path.write_text("\n".join(path.read_text().splitlines()[:2]) + "\n")
    with pytest.raises(TraceError, match="layers") as exc:
        import_smartmoe(folder)
    assert str(path) in str(exc.value)


def test_smartmoe_empty_folder_and_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="no table_iter") as exc:
        import_smartmoe(empty)
    assert str(empty) in str(exc.value)
    folder = write_smartmoe(tmp_path / "mt")
    (folder / "table_iter1_rank0.log").write_text("\n\n")
    with pytest.raises(TraceError, match="empty") as exc:
        import_smartmoe(folder)
    assert "table_iter1_rank0.log" in str(exc.value)
    with pytest.raises(TraceError, match="not a folder"):
        import_smartmoe(tmp_path / "missing")


def test_smartmoe_binary_file(tmp_path: Path) -> None:
    folder = write_smartmoe(tmp_path / "mt")
    (folder / "table_iter1_rank0.log").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError) as exc:
        import_smartmoe(folder)
    assert "table_iter1_rank0.log" in str(exc.value)


# --------------------------------------------------------------------------- OLMoE expert counts


def test_olmoe_all_domains(olmoe_json: Path) -> None:
    t = import_expert_counts(olmoe_json)
    domains = ["arxiv", "book", "c4", "github", "tulu", "wikipedia"]
    assert t.meta["domains"] == domains
    assert t.counts.shape == (6, 3, 1, 64)
    assert t.top_k == 8
    raw = json.loads(olmoe_json.read_text())["data"]["olmoe"]["expert_counts"]
    for s, dom in enumerate(domains):
        np.testing.assert_array_equal(t.counts[s, :, 0], np.array(raw[dom]))
    # about 209k tokens per domain, top-8
    assert t.tokens_per_device == 208896
    skew = t.expert_load().max(axis=-1) / t.expert_load().mean(axis=-1)
    assert skew.min() > 2.0 and skew.max() < 9.0


def test_olmoe_pick_domain_model_kind(olmoe_json: Path) -> None:
    t = import_expert_counts(olmoe_json, model="mistral", domain="c4,github", devices=4)
    assert t.counts.shape == (2, 3, 4, 8)
    assert t.top_k == 2
    assert t.meta["domains"] == ["c4", "github"]
    rows = t.counts.sum(axis=3)
    assert (rows.max(axis=2) - rows.min(axis=2) <= 1).all()  # spread evenly over devices
    top1 = import_expert_counts(olmoe_json, kind="expert_counts_top1", domain=["arxiv"])
    assert top1.top_k == 1 and top1.counts.shape == (1, 3, 1, 64)
    assert top1.counts[0, 0].sum() == 208896


def test_default_top_k() -> None:
    assert default_top_k("olmoe-sft", "expert_counts") == 8
    assert default_top_k("Mixtral-8x7B", "expert_counts") == 2
    assert default_top_k("olmoe", "expert_counts_top1") == 1
    assert default_top_k("other", "expert_counts") is None


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


GOOD_COUNTS = {
    "data": {"m": {"expert_counts": {"a": [[1, 2, 3], [3, 2, 1]], "b": [[0, 0, 6], [2, 2, 2]]}}}
}


@pytest.mark.parametrize(
    ("obj", "opts", "needle"),
    [
        ([1, 2], {}, "top level"),
        ({"data": []}, {}, "keyed by model"),
        (GOOD_COUNTS, {"model": "x"}, "no model 'x'"),
        (GOOD_COUNTS, {"kind": "y"}, "no kind 'y'"),
        (GOOD_COUNTS, {"domain": "z"}, "no domain 'z'"),
        (GOOD_COUNTS, {}, "cannot infer top_k"),
        (GOOD_COUNTS, {"domain": " , "}, "no domain selected"),
        ({"data": {"m": {"expert_counts": {"a": [[1, 2, 3], [3, 2]]}}}}, {"top_k": 1}, "ragged"),
        ({"data": {"m": {"expert_counts": {"a": [[1, -2, 3]]}}}}, {"top_k": 1}, "negative"),
        ({"data": {"m": {"expert_counts": {"a": [[1, "2", 3]]}}}}, {"top_k": 1}, "non-numeric"),
        ({"data": {"m": {"expert_counts": {"a": [[1, None, 3]]}}}}, {"top_k": 1}, "non-numeric"),
        ({"data": {"m": {"expert_counts": {"a": [1, 2, 3]}}}}, {"top_k": 1}, "expected a list"),
        ({"data": {"m": {"expert_counts": {"a": {"x": 1}}}}}, {"top_k": 1}, "must be a list"),
        ({"data": {"m": {"expert_counts": {}}}}, {"top_k": 1}, "no domains"),
        (
            {"data": {"m": {"expert_counts": {"a": [[1, 2]], "b": [[1, 2, 3]]}}}},
            {"top_k": 1},
            "differs",
        ),
        ({"data": {"m": {"expert_counts": {"a": [[]]}}}}, {"top_k": 1}, "empty"),
        (GOOD_COUNTS, {"top_k": 4}, "top_k"),
        (GOOD_COUNTS, {"top_k": 1, "devices": 0}, "devices"),
        (GOOD_COUNTS, {"top_k": 1, "tokens_per_device": 1}, "more than"),
    ],
)
def test_expert_counts_bad(tmp_path: Path, obj, opts: dict, needle: str) -> None:
    path = write_json(tmp_path / "counts.json", obj)
    with pytest.raises(TraceError, match=needle) as exc:
        import_expert_counts(path, model=opts.pop("model", "m"), **opts)
    assert str(path) in str(exc.value)


def test_expert_counts_not_json(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"data": {\n  "m": [1, 2,\n')
    with pytest.raises(TraceError, match="not valid JSON") as exc:
        import_expert_counts(path)
    assert str(path) in str(exc.value) and exc.value.field.startswith("line")
    with pytest.raises(TraceError, match="not found"):
        import_expert_counts(tmp_path / "nope.json")


def test_expert_counts_without_data_wrapper(tmp_path: Path) -> None:
    path = write_json(tmp_path / "c.json", {"_doc": "x", **GOOD_COUNTS["data"]})
    t = import_expert_counts(path, model="m", top_k=1)
    assert t.counts.shape == (2, 2, 1, 3)


# --------------------------------------------------------------------------- EPLB weight

WEIGHT = [[10, 3, 0, 7], [5, 5, 5, 6]]


def test_eplb_npy_and_json_agree(tmp_path: Path) -> None:
    npy = tmp_path / "w.npy"
    np.save(npy, np.array(WEIGHT, dtype=np.int32))
    a = import_eplb(npy, devices=3)
    b = import_eplb(write_json(tmp_path / "w.json", WEIGHT), devices=3)
    c = import_eplb(write_json(tmp_path / "w2.json", {"weight": WEIGHT}), devices=3)
    for t in (a, b, c):
        assert t.counts.shape == (1, 2, 3, 4)
        np.testing.assert_array_equal(t.counts.sum(axis=2)[0], WEIGHT)
        rows = t.counts.sum(axis=3)[0]
        assert (rows.max(axis=1) - rows.min(axis=1) <= 1).all()
        assert t.top_k == 1 and t.tokens_per_device == rows.max()
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_array_equal(a.counts, c.counts)


def test_eplb_float_npy_with_whole_values(tmp_path: Path) -> None:
    npy = tmp_path / "w.npy"
    np.save(npy, np.array(WEIGHT, dtype=np.float32))
    t = import_eplb(npy, top_k=2)
    assert t.counts.shape == (1, 2, 1, 4) and t.top_k == 2
    assert t.tokens_per_device == 11  # ceil(21 / 2)


@settings(max_examples=40, deadline=None)
@given(
    weight=st.lists(
        st.lists(st.integers(0, 10**6), min_size=3, max_size=3), min_size=1, max_size=4
    ),
    devices=st.integers(1, 9),
)
def test_spread_evenly_conserves(weight: list[list[int]], devices: int) -> None:
    w = np.array(weight)
    out = spread_evenly(w, devices)
    assert out.shape == (w.shape[0], devices, 3)
    np.testing.assert_array_equal(out.sum(axis=1), w)
    assert (out.max(axis=1) - out.min(axis=1) <= 1).all()
    rows = out.sum(axis=2)
    assert (rows.max(axis=1) - rows.min(axis=1) <= 1).all()


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ([[1, 2], [3]], "ragged"),
        ([[1, -2], [3, 4]], "negative"),
        ([[1, "a"], [3, 4]], "non-numeric"),
        ([[1, 2.5], [3, 4]], "whole number"),
        ([1, 2, 3], "expected a list"),
        ([[[1]]], "2-d"),
        ([], "2-d"),
        ([[]], "empty"),
        ({"w": [[1]]}, "weight"),
        ({"weight": "x"}, "list of per-layer"),
        ([[True, False]], "non-numeric"),
    ],
)
def test_eplb_bad_json(tmp_path: Path, content, needle: str) -> None:
    path = write_json(tmp_path / "w.json", content)
    with pytest.raises(TraceError, match=needle) as exc:
        import_eplb(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize(
    ("array", "needle"),
    [
        (np.ones(4), "2-d"),
        (np.ones((2, 2, 2)), "2-d"),
        (np.array([[1.0, np.nan]]), "whole number"),
        (np.array([[1, -1]]), "negative"),
        (np.array([["a", "b"]]), "numbers"),
        (np.zeros((0, 3)), "empty"),
    ],
)
def test_eplb_bad_npy(tmp_path: Path, array: np.ndarray, needle: str) -> None:
    path = tmp_path / "w.npy"
    np.save(path, array)
    with pytest.raises(TraceError, match=needle) as exc:
        import_eplb(path)
    assert str(path) in str(exc.value)


def test_eplb_corrupt_npy_and_bad_devices(tmp_path: Path) -> None:
    path = tmp_path / "w.npy"
    path.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(TraceError) as exc:
        import_eplb(path)
    assert str(path) in str(exc.value)
    with pytest.raises(TraceError, match="not found"):
        import_eplb(tmp_path / "none.npy")
    good = write_json(tmp_path / "g.json", WEIGHT)
    with pytest.raises(TraceError) as exc:
        import_eplb(good, devices=0)
    assert exc.value.field == "devices"


# --------------------------------------------------------------------------- dispatch


def test_load_any_dispatch(tmp_path: Path, smartmoe_dir: Path, olmoe_json: Path) -> None:
    trace = generate("zipf", steps=2, layers=1, devices=2, experts=4, tokens_per_device=8)
    npz = tmp_path / "t.npz"
    trace.save(npz)
    np.testing.assert_array_equal(load_any(npz).counts, trace.counts)
    assert load_any(smartmoe_dir).counts.shape == (3, 24, 16, 32)
    assert load_any(olmoe_json, domain="c4").counts.shape == (1, 3, 1, 64)
    w = write_json(tmp_path / "w.json", {"weight": WEIGHT})
    assert load_any(w, devices=2, top_k=None).counts.shape == (1, 2, 2, 4)
    assert detect_format(w) == "eplb"
    assert detect_format(olmoe_json) == "expert-counts"
    assert detect_format(smartmoe_dir) == "smartmoe"
    np.save(tmp_path / "w.npy", np.array(WEIGHT))
    assert load_any(tmp_path / "w.npy", format="eplb").experts == 4


def test_load_any_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not found"):
        load_any(tmp_path / "x.npz")
    odd = tmp_path / "x.csv"
    odd.write_text("1,2")
    with pytest.raises(TraceError, match="unknown trace format") as exc:
        load_any(odd)
    assert str(odd) in str(exc.value)
    scalar = write_json(tmp_path / "s.json", 3)
    with pytest.raises(TraceError, match="top level"):
        load_any(scalar)
    w = write_json(tmp_path / "w.json", WEIGHT)
    with pytest.raises(ConfigError, match="not used"):
        load_any(w, model="olmoe")
    with pytest.raises(ConfigError):
        load_any(w, format="csv")
    npz = tmp_path / "t.npz"
    generate("uniform", steps=1, layers=1, devices=1, experts=2, tokens_per_device=2).save(npz)
    with pytest.raises(ConfigError):
        load_any(npz, top_k=2)
    with pytest.raises(TraceError, match="folder"):
        load_any(tmp_path, format="eplb")
