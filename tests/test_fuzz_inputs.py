"""Fuzzing every input Poise reads: only `PoiseError` may escape, and its message names the file.

Each test starts from a valid input (a saved trace, a cluster preset, the tiny training config,
the shipped expert-counts format) and mutates it at random (replace, delete or add a field, with
values of any JSON type, odd floats, huge integers, deep nesting), or feeds raw random bytes. A
loader must then either return a valid object or raise a `PoiseError` whose one-line message
names the file; any other exception (a `KeyError`, `TypeError`, `ValueError` from deep inside) is
a bug. `poise plan` is fuzzed end to end: exit status 0 or 2, and on 2 exactly one line on
stderr naming the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.cli import main
from poise.core.cluster import Cluster
from poise.core.errors import PoiseError
from poise.core.presets import get_cluster
from poise.trace.generate import generate
from poise.trace.importers import load_any
from poise.train.config import config_from_mapping, load_config

CASES = 400  # examples per fuzz test: thousands in all, a few seconds each
FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
ROOT = Path(__file__).resolve().parents[1]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2, 3, 0.5, 1e300, -1e-300, "", "1", "x", "nan", "inf"]),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def scratch() -> Path:
    with tempfile.TemporaryDirectory(prefix="poise-fuzz-") as d:
        yield Path(d)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (tuple of keys / indices) into a nested dict/list value, itself included."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: Any, keys: list[str] | None = None) -> Any:
    """`base` (a JSON-like value) with one to three random edits: replace a node with a random
    value, delete a dict entry or list item, or add an entry (a known key name or a random one)."""
    value = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(value)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not path:
            if action == "replace":
                value = draw(json_values)
            continue
        parent = value
        for k in path[:-1]:
            parent = parent[k]
        last = path[-1]
        if action == "replace":
            parent[last] = draw(json_values)
        elif action == "delete":
            del parent[last]
        else:
            node = parent[last]
            if isinstance(node, dict):
                key = draw(st.sampled_from(keys) if keys else st.text(max_size=8))
                node[key] = draw(json_values)
            elif isinstance(node, list):
                node.append(draw(json_values))
            else:
                parent[last] = [node, draw(json_values)]
    return value


def _expect_clean(fn: Any, path: Path) -> Any:
    """Run a loader: return its result, or check the `PoiseError` is one line naming `path`."""
    try:
        return fn()
    except PoiseError as exc:
        line = exc.one_line()
        assert "\n" not in line and len(line) < len(str(path)) + 600, line
        assert str(path) in line or path.name in line, line
        return None


def _write_yaml(path: Path, value: Any) -> None:
    path.write_text(yaml.safe_dump(value, sort_keys=False))


# --------------------------------------------------------------------------- cluster YAML
CLUSTER_BASE = get_cluster("a800-eth10").to_dict()
CLUSTER_KEYS = [
    "name",
    "devices_per_node",
    "nodes_per_domain",
    "domains",
    "device",
    "links",
    "gemm_flops",
    "peak_flops",
    "fp32",
    "tf32",
    "bf16",
    "fp16",
    "gemm_efficiency",
    "memory_bytes",
    "gemm_half_rows",
    "intra_node",
    "inter_node",
    "inter_domain",
    "bw_Bps",
    "lat_s",
    "shared_by",
]


@FUZZ
@given(value=mutated(CLUSTER_BASE, CLUSTER_KEYS))
def test_cluster_yaml_fuzz(scratch: Path, value: Any) -> None:
    path = scratch / "cluster.yaml"
    _write_yaml(path, value)
    cluster = _expect_clean(lambda: Cluster.load(path), path)
    if cluster is not None:
        assert cluster.num_devices >= 1
        assert all(math.isfinite(k.bw_Bps) and k.bw_Bps > 0 for k in cluster.links())


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_cluster_yaml_raw_bytes(scratch: Path, raw: bytes) -> None:
    path = scratch / "raw-cluster.yaml"
    path.write_bytes(raw)
    _expect_clean(lambda: Cluster.load(path), path)


# --------------------------------------------------------------------------- training config
TRAIN_BASE = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())


@FUZZ
@given(value=mutated(TRAIN_BASE, sorted(TRAIN_BASE)))
def test_train_config_fuzz(scratch: Path, value: Any) -> None:
    path = scratch / "train.yaml"
    _write_yaml(path, value)
    cfg = _expect_clean(lambda: load_config(path), path)
    if cfg is not None:
        assert cfg.steps >= 1 and cfg.batch >= 1


@FUZZ
@given(value=mutated(TRAIN_BASE, sorted(TRAIN_BASE)))
def test_train_config_mapping_fuzz(value: Any) -> None:
    if not isinstance(value, dict):
        value = {"model": value}
    try:
        config_from_mapping(value, source="fuzz.yaml")
    except PoiseError as exc:
        assert "fuzz.yaml" in exc.one_line()


# --------------------------------------------------------------------------- traces (.npz)
def _trace_arrays() -> dict[str, np.ndarray]:
    """The arrays of a valid saved trace (`Trace.save`), to mutate."""
    t = generate("zipf", steps=2, layers=2, devices=4, experts=8, top_k=2, tokens_per_device=16)
    with tempfile.TemporaryDirectory() as d:
        t.save(Path(d) / "t.npz")
        with np.load(Path(d) / "t.npz", allow_pickle=False) as z:
            return {k: z[k] for k in z.files}


TRACE_BASE = _trace_arrays()
odd_arrays = st.one_of(
    st.sampled_from(
        [
            np.array(5),
            np.array(-1),
            np.array(2.5),
            np.array("x"),
            np.array([1, 2]),
            np.zeros((0,)),
            np.zeros((1, 1, 1, 1)),
            np.full((2, 2, 4, 8), -1),
            np.full((2, 2, 4, 8), np.nan),
            np.full((2, 2, 4, 8), 2**62, dtype=np.int64),
            np.ones((2, 2, 4, 8), dtype=np.float32),
            np.ones((2, 2, 4, 8), dtype=bool),
            np.array("{not json"),
            np.array("[1, 2]"),
            np.array(1, dtype=np.uint8),
            np.array([0, 0]),
            np.array([1, 0]),
        ]
    ),
    st.integers(-3, 3).map(np.array),
)


@FUZZ
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from([*sorted(TRACE_BASE), "extra"]),
            st.one_of(st.none(), odd_arrays),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_trace_npz_fuzz(scratch: Path, edits: list[tuple[str, np.ndarray | None]]) -> None:
    arrays = dict(TRACE_BASE)
    for key, value in edits:
        if value is None:
            arrays.pop(key, None)
        else:
            arrays[key] = value
    path = scratch / "trace.npz"
    np.savez(path, **arrays)
    trace = _expect_clean(lambda: load_any(path), path)
    if trace is not None:
        assert trace.counts.ndim == 4 and trace.counts.min() >= 0


@FUZZ
@given(raw=st.binary(max_size=300))
def test_trace_raw_bytes(scratch: Path, raw: bytes) -> None:
    for suffix in (".npz", ".npy", ".json"):
        path = scratch / f"raw{suffix}"
        path.write_bytes(raw)
        _expect_clean(lambda p=path: load_any(p), path)


# --------------------------------------------------------------------------- EPLB weight
@FUZZ
@given(
    value=mutated({"weight": [[3, 0, 5, 1], [2, 2, 2, 2]]}) | json_values,
    devices=st.integers(-2, 5),
)
def test_eplb_json_fuzz(scratch: Path, value: Any, devices: int) -> None:
    path = scratch / "weight.json"
    path.write_text(json.dumps(value, allow_nan=True))
    _expect_clean(lambda: load_any(path, format="eplb", devices=devices), path)


@FUZZ
@given(array=odd_arrays, devices=st.integers(-2, 5))
def test_eplb_npy_fuzz(scratch: Path, array: np.ndarray, devices: int) -> None:
    path = scratch / "weight.npy"
    np.save(path, array)
    _expect_clean(lambda: load_any(path, devices=devices), path)


# --------------------------------------------------------------------------- expert counts JSON
COUNTS_BASE = {
    "_doc": "fuzz",
    "data": {
        "olmoe": {
            "expert_counts": {"arxiv": [[4, 0, 2, 9], [1, 1, 1, 1]], "github": [[0] * 4, [7] * 4]}
        }
    },
}


@FUZZ
@given(
    value=mutated(COUNTS_BASE, ["data", "olmoe", "expert_counts", "arxiv", "github"]),
    domain=st.one_of(st.none(), st.sampled_from(["arxiv", "github", "arxiv,github", "", "x"])),
)
def test_expert_counts_fuzz(scratch: Path, value: Any, domain: str | None) -> None:
    path = scratch / "counts.json"
    path.write_text(json.dumps(value, allow_nan=True))
    _expect_clean(lambda: load_any(path, format="expert-counts", domain=domain), path)


# --------------------------------------------------------------------------- SmartMoE-AE logs
@FUZZ
@given(
    lines=st.lists(
        st.one_of(
            st.sampled_from(["0 1 2 3", "1 1 1 1", "", "  ", "a b", "-1 2", "1.5 2", "9" * 30]),
            st.text(max_size=20),
        ),
        max_size=6,
    ),
    names=st.lists(
        st.sampled_from(
            ["table_iter1_rank0.log", "table_iter1_rank1.log", "table_iterx_rank0.log", "other.txt"]
        ),
        min_size=1,
        max_size=3,
        unique=True,
    ),
)
def test_smartmoe_folder_fuzz(lines: list[str], names: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="poise-smartmoe-") as d:
        folder = Path(d)
        for name in names:
            (folder / name).write_text("\n".join(lines))
        _expect_clean(lambda: load_any(folder), folder)


# --------------------------------------------------------------------------- poise plan, end to end
@settings(max_examples=60, deadline=None, database=None)
@given(
    counts=st.sampled_from([[[1, 2], [3, 4]], [[-1, 2]], [[1.5]], [], [[0, 0], [0, 0]], "x"]),
    slots=st.sampled_from(["1", "2", "9", "0", "-3", "x"]),
    policy=st.sampled_from(["static", "auto", "eplb", "prophet", "nope"]),
    cluster=st.sampled_from(["cpu-2", "dgx-h100:0", "nowhere", "v100-ib50"]),
)
def test_plan_cli_fuzz(scratch: Path, counts: Any, slots: str, policy: str, cluster: str) -> None:
    path = scratch / "loads.json"
    path.write_text(json.dumps({"weight": counts}))
    argv = ["plan", str(path), "--policy", policy, "--cluster", cluster, "--slots", slots]
    argv += ["--out", str(scratch / "plan.json")]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse rejects the flag itself (usage + one error line)
            code = exc.code
    assert code in (0, 2), (argv, err.getvalue())
    if code == 2 and "usage:" not in err.getvalue():
        assert err.getvalue().count("\n") == 1, err.getvalue()
        assert err.getvalue().startswith("poise: error: ")
