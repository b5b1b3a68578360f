"""Values that pass as numbers but overflow later (issue 68's "values that pass the checks"):
a cluster file's physical figures are bounded where they are read (`get_number(within=...)`,
`poise.core.cluster.LINK_BW_BPS`, `LINK_LAT_S`, `PEAK_FLOPS`), and every JSON output goes
through `poise.core.finite.json_text`, which refuses a non-finite figure (naming the output
and the entry) instead of writing `Infinity`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.core.cluster import LINK_BW_BPS, PEAK_FLOPS, Cluster
from poise.core.errors import ConfigError
from poise.core.finite import NonFiniteError, first_non_finite, json_text
from poise.core.presets import PRESETS
from poise.trace.generate import generate

from .test_bad_input_round2 import assert_one_line, run_cli


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("round3") / "t.npz"
    generate("zipf", steps=3, layers=1, devices=16, experts=16, tokens_per_device=64).save(path)
    return path


def _cluster_doc() -> dict:
    return PRESETS["dgx-h100"].to_dict()


def _with(doc: dict, path: str, value: float) -> dict:
    node = doc
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return doc


CASES = [
    ("links.inter_node.bw_Bps", 1e-300),
    ("links.intra_node.bw_Bps", 1e300),
    ("links.inter_node.lat_s", 1e9),
    ("device.peak_flops.fp32", 1e-200),
    ("device.peak_flops.bf16", 1e40),
]


@pytest.mark.parametrize(("field", "value"), CASES)
def test_a_physical_figure_no_hardware_has_is_one_line(
    field: str, value: float, tmp_path: Path, trace_file: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with(_cluster_doc(), field, value)))
    code, err = run_cli(["simulate", str(trace_file), "--cluster", str(bad), "--out",
                         str(tmp_path / "sim"), "--steps", "2"])  # fmt: skip
    assert_one_line(code, err, "bad.yaml", field, "must be within")
    assert not (tmp_path / "sim").exists() or not any((tmp_path / "sim").iterdir())


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(bw=st.floats(min_value=1e-320, max_value=1e300, allow_nan=False, allow_infinity=False))
def test_any_bandwidth_is_refused_or_gives_finite_figures(
    bw: float, tmp_path_factory: pytest.TempPathFactory, trace_file: Path
) -> None:
    tmp = tmp_path_factory.mktemp("bw")
    bad = tmp / "c.yaml"
    bad.write_text(yaml.safe_dump(_with(_cluster_doc(), "links.inter_node.bw_Bps", bw)))
    code, err = run_cli(["simulate", str(trace_file), "--cluster", str(bad), "--out",
                         str(tmp / "sim"), "--steps", "2", "--policies", "static"])  # fmt: skip
    if code == 2:
        assert_one_line(code, err, "bw_Bps")
        assert not LINK_BW_BPS[0] <= bw <= LINK_BW_BPS[1]
        return
    assert code == 0, err
    summary = (tmp / "sim" / "summary.json").read_text()
    assert "Infinity" not in summary and "NaN" not in summary
    assert first_non_finite(json.loads(summary)) is None


def test_json_text_refuses_non_finite_figures_naming_the_entry() -> None:
    payload = {
        "runs": {"static": {"mean_step_s": 0.5}, "auto": {"step_s": np.array([1.0, math.inf])}}
    }
    with pytest.raises(NonFiniteError, match=r"out\.json: output: runs\.auto\.step_s\[1\]"):
        json_text(payload, "out.json")
    assert first_non_finite([1, 2.5, {"a": float("nan")}]) == "[2].a"
    assert json.loads(json_text({"a": [1, 2.5], "b": np.float64(3.0)}, "x", default=float)) == {
        "a": [1, 2.5],
        "b": 3.0,
    }


def test_the_bounds_admit_every_preset() -> None:
    """No preset or data-sheet figure lies outside the bounds (they bound what hardware can
    mean, not what one scenario needs)."""
    for name, cluster in PRESETS.items():
        again = Cluster.from_dict(cluster.to_dict(), source=name)
        assert again.num_devices == cluster.num_devices
    assert PEAK_FLOPS[0] < 1e9 and PEAK_FLOPS[1] > 1e16  # a CPU core to far past a B200
    with pytest.raises(ConfigError, match="within"):
        Cluster.from_dict(_with(_cluster_doc(), "links.inter_node.bw_Bps", 1.0), "c.yaml")


@pytest.mark.parametrize("count", [2**61, 2**45])
def test_counts_no_routing_can_have_are_one_line(
    tmp_path: Path, trace_file: Path, count: int
) -> None:
    """A trace whose counts (and tokens per device, so that every other check passes) come from
    one corrupt value: refused where it is read, not summed into an overflow."""
    arrays = dict(np.load(trace_file, allow_pickle=False))
    arrays["counts"] = arrays["counts"].astype(np.int64)
    arrays["counts"][0, 0, 0, 0] = count
    arrays["tokens_per_device"] = np.int64(2**62)
    bad = tmp_path / "huge.npz"
    np.savez(bad, **arrays)
    for argv in (
        ["trace", "stats", str(bad)],
        ["simulate", str(bad), "--out", str(tmp_path / "s")],
    ):
        code, err = run_cli(argv)
        assert_one_line(code, err, "huge.npz", "counts", "beyond any routing trace")


@pytest.mark.parametrize(
    ("field", "value"),
    [("d_model", 2**40), ("d_expert", 2**30), ("moe_layers", 10**6), ("tokens_per_device", 2**40)],
)
def test_model_sizes_past_any_model_are_one_line(
    tmp_path: Path, trace_file: Path, field: str, value: int
) -> None:
    doc = {"d_model": 64, "d_expert": 128, "experts": 16, "top_k": 2, "moe_layers": 1}
    doc[field] = value
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump(doc))
    code, err = run_cli(["simulate", str(trace_file), "--model", str(model), "--out",
                         str(tmp_path / "s"), "--steps", "2"])  # fmt: skip
    assert_one_line(code, err, "m.yaml", field, "must be <=")


def _megatron(folder: Path, ranks: dict[int, list[dict]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, recs in ranks.items():
        text = "".join(json.dumps(r) + "\n" for r in recs)
        (folder / f"router_trace_rank{rank}.jsonl").write_text(text)
    return folder


def _record(rank: int, indices: list[list[int]]) -> dict:
    return {"step": 0, "block": "decoder", "layer": 1, "rank": rank, "topk": 2,
            "num_tokens": len(indices), "top_indices": indices}  # fmt: skip


@pytest.mark.parametrize(
    ("ranks", "needles"),
    [
        # one corrupt expert index would size the trace at 10^12 experts (119 GiB and more)
        (
            {0: [_record(0, [[0, 1], [10**12, 2]])], 1: [_record(1, [[1, 0]])]},
            ("router_trace_rank0.jsonl", "line 1.top_indices", "beyond any model"),
        ),
        # an empty rank file would leave its rank out: a 1-device trace
        (
            {0: [_record(0, [[0, 1], [1, 2]])], 1: []},
            ("router_trace_rank1.jsonl", "no decoder records"),
        ),
    ],
    ids=["huge expert index", "empty rank file"],
)
def test_a_router_trace_sized_by_one_corrupt_value_is_one_line(
    tmp_path: Path, ranks: dict, needles: tuple[str, ...]
) -> None:
    folder = _megatron(tmp_path / "mt", ranks)
    code, err = run_cli(["trace", "convert", str(folder), str(tmp_path / "t.npz")])
    assert_one_line(code, err, *needles)
    assert not (tmp_path / "t.npz").exists()


# ------------------------------------------------------------------ training: before any rank


@pytest.mark.parametrize(
    ("setting", "needles"),
    [
        ("model_args={d_expert: 4000000}", ("model_args", "needs about", "more than this machine")),
        ("model_args={vocab_size: 100}", ("model_args.vocab_size", "byte-level")),
        ("cache_dir=CACHE", ("cache_dir", "cannot be written")),
    ],
    ids=["memory", "vocabulary", "unwritable cache"],
)
@pytest.mark.parametrize("nproc", [1, 2])
def test_training_that_would_fail_inside_a_rank_is_one_line_first(
    tmp_path: Path, setting: str, needles: tuple[str, ...], nproc: int
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    setting = setting.replace("CACHE", str(tmp_path / "a-file" / "cache"))
    out = tmp_path / "out"
    code, err = run_cli(["train", "tiny", "--steps", "1", "--nproc", str(nproc), "--quiet",
                         "--out", str(out), "--set", setting])  # fmt: skip
    assert_one_line(code, err, *needles)
    assert not (out / "config.yaml").exists()  # no rank was started


def test_the_memory_estimate_counts_the_models_parameters() -> None:
    """`model_params` against the parameters of a real `GPTMoE` (on one rank every expert, no
    spare slot): the estimate may leave out only the norms' weights."""
    from poise.models.gpt import GPTMoE, model_config
    from poise.train.preflight import model_params

    mcfg = model_config("tiny", {"layers": 3, "moe_every": 2, "d_ff": 96})
    real = sum(p.numel() for p in GPTMoE(mcfg, seed=0).parameters())
    dense, experts = model_params(mcfg, ranks=1, spare_slots=0)
    norms = (2 * mcfg.layers + 1) * mcfg.d_model
    assert dense + experts == pytest.approx(real - norms, rel=0.02)
    assert model_params(mcfg, ranks=4, spare_slots=1)[1] < experts  # experts split over ranks
