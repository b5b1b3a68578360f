"""Compute priced by dtype: the data sheets' peaks per dtype, the fraction large GEMMs reach and
the small-GEMM curve (`Cluster.gemm_rate`), in the model's compute dtype (`ModelSpec`). Expected
values are worked by hand from the data-sheet figures, not taken from the code."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from poise.core.cluster import Cluster, Link, PeakFlops
from poise.core.errors import ConfigError
from poise.core.placement import Assignment, Placement
from poise.core.presets import get_cluster
from poise.core.spec import ModelSpec
from poise.cost.model import CostModel, expert_seconds

# d_model 1024, d_expert 2048, GELU: P_e = 2 * 1024 * 2048 = 4,194,304; F_t = 2 P_e
F_T = 8_388_608.0


def _spec(dtype_bytes: int = 4, **kw) -> ModelSpec:
    return ModelSpec("m", 1024, 2048, 16, 2, 1, dtype_bytes=dtype_bytes, **kw)


def test_fp32_expert_seconds_on_v100_by_hand() -> None:
    # V100-PCIe fp32 peak 14 TFLOP/s (data sheet), 90% reached (FasterMoE §3.1), half rows 256:
    # 1,000 rows run at 14e12 * 0.9 * 1000 / 1256 FLOP/s.
    cluster = get_cluster("v100-ib50")
    spec = _spec(4)
    assert spec.gemm_dtype == "fp32"
    want = 1000 * F_T / (14e12 * 0.9 * 1000 / 1256)
    assert expert_seconds(cluster, spec, np.array([1000.0]))[0] == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(8.3620e-4, rel=1e-4)
    # the same through CostModel.expert_compute_s: two experts of 500 rows each on one device
    received = np.zeros((1, 16, 16))
    received[0, 0, :2] = 500.0
    got = CostModel(cluster, spec).expert_compute_s(received)
    assert got[0, 0] == pytest.approx(F_T * (1000 + 2 * 256) / (14e12 * 0.9), rel=1e-12)
    # non-MoE compute at the large-GEMM fp32 rate: 4096 tokens x 24 d_model^2 FLOPs
    fnec, bnec = CostModel(cluster, spec).non_moe_s
    assert fnec == pytest.approx(4096 * 24 * 1024**2 / (14e12 * 0.9), rel=1e-12)
    assert bnec == pytest.approx(2 * fnec)


def test_h100_fp32_over_bf16_is_the_data_sheet_ratio() -> None:
    # H100 SXM dense: fp32 66.9, bf16 989.4 TFLOP/s; the same efficiency applies to both.
    cluster = get_cluster("dgx-h100")
    rows = np.array([1.0, 64.0, 4096.0])
    fp32 = expert_seconds(cluster, _spec(4), rows)
    bf16 = expert_seconds(cluster, _spec(2), rows)
    np.testing.assert_allclose(fp32 / bf16, 989.4 / 66.9, rtol=1e-12)
    assert cluster.gemm_flops("tf32") == pytest.approx(494.7e12 * 565.0 / 989.4)


def test_priced_step_follows_the_dtype() -> None:
    # the cost model's phases (expert and non-MoE compute) scale by the dtype's peak on A800
    cluster = get_cluster("a800-eth10")
    D = cluster.num_devices
    placement = Placement.from_homes(np.arange(16)[None, :] % D, D, 2)
    counts = np.full((1, D, 16), 40.0)
    phases = {}
    for dtype in ("fp32", "tf32", "bf16"):
        spec = _spec(4, compute_dtype=dtype)
        phases[dtype], _ = CostModel(cluster, spec).phases(
            placement, Assignment.even(placement), counts
        )
    ratio = phases["fp32"].expert_fwd_s / phases["tf32"].expert_fwd_s
    np.testing.assert_allclose(ratio, 156 / 19.5, rtol=1e-12)
    ratio = phases["fp32"].non_moe_fwd_s / phases["bf16"].non_moe_fwd_s
    np.testing.assert_allclose(ratio, 312 / 19.5, rtol=1e-12)
    # the communication does not change with the compute dtype
    np.testing.assert_array_equal(phases["fp32"].dispatch_s, phases["bf16"].dispatch_s)


def test_v100_has_no_tf32_or_bf16_path_so_they_run_at_fp32() -> None:
    cluster = get_cluster("v100-nvlink-ib100")  # V100-SXM2: fp32 15.7, fp16 tensor 125
    assert cluster.peak_flops.tf32 is None and cluster.peak_flops.bf16 is None
    assert cluster.gemm_flops("tf32") == cluster.gemm_flops("fp32") == pytest.approx(15.7e12 * 0.9)
    assert cluster.gemm_flops("bf16") == pytest.approx(15.7e12 * 0.9)
    assert cluster.gemm_flops("fp16") == pytest.approx(125e12 * 0.9)
    rows = np.array([10.0, 1000.0])
    np.testing.assert_array_equal(
        expert_seconds(cluster, _spec(4, compute_dtype="tf32"), rows),
        expert_seconds(cluster, _spec(4, compute_dtype="fp32"), rows),
    )


def test_old_yaml_gemm_flops_loads_as_one_rate_for_every_dtype(tmp_path) -> None:
    old = {
        "name": "measured",
        "devices_per_node": 2,
        "device": {"gemm_flops": 2e11, "memory_bytes": 1e9, "gemm_half_rows": 40.0},
        "links": {"intra_node": {"bw_Bps": 1e9, "lat_s": 1e-4}},
    }
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    cluster = Cluster.load(path)
    assert [cluster.gemm_flops(t) for t in ("fp32", "tf32", "bf16", "fp16")] == [2e11] * 4
    # 100 rows: 100 * F_t / (2e11 * 100 / 140)
    for nbytes in (4, 2):
        got = expert_seconds(cluster, _spec(nbytes), np.array([100.0]))[0]
        assert got == pytest.approx(F_T * 140 / 2e11, rel=1e-12)
    # saved in the new schema, it loads back the same
    cluster.save(tmp_path / "new.yaml")
    text = (tmp_path / "new.yaml").read_text()
    assert "peak_flops" in text and "gemm_efficiency" in text and "gemm_flops" not in text
    assert Cluster.load(tmp_path / "new.yaml") == cluster


def test_round_trip_keeps_every_dtype_and_the_efficiency(tmp_path) -> None:
    link = Link(1e9, 0.0)
    cluster = Cluster(
        "c",
        2,
        1,
        1,
        PeakFlops(fp32=1e12, bf16=8e12),
        1e9,
        link,
        link,
        link,
        gemm_half_rows=32.0,
        gemm_efficiency=0.75,
    )
    path = tmp_path / "c.yaml"
    cluster.save(path)
    device = yaml.safe_load(path.read_text())["device"]
    assert device["peak_flops"] == {"fp32": 1e12, "bf16": 8e12}
    assert device["gemm_efficiency"] == 0.75
    loaded = Cluster.load(path)
    assert loaded == cluster
    assert loaded.gemm_rate(32.0, "bf16") == pytest.approx(8e12 * 0.75 / 2)
    assert loaded.gemm_rate(32.0, "fp16") == pytest.approx(1e12 * 0.75 / 2)  # no fp16 path


def test_a_bad_compute_dtype_names_the_field(tmp_path) -> None:
    with pytest.raises(ConfigError, match="compute_dtype"):
        _spec(4, compute_dtype="fp8")
    with pytest.raises(ConfigError, match="compute_dtype"):
        _spec(1)  # no default for one-byte data
    assert _spec(1, compute_dtype="fp16").gemm_dtype == "fp16"
    path = tmp_path / "m.yaml"
    fields = {"d_model": 8, "d_expert": 16, "experts": 4, "top_k": 1, "moe_layers": 1}
    path.write_text(yaml.safe_dump({**fields, "compute_dtype": "half"}))
    with pytest.raises(ConfigError) as info:
        ModelSpec.load(path)
    assert str(path) in str(info.value) and "compute_dtype" in str(info.value)
    path.write_text(yaml.safe_dump({**fields, "dtype_bytes": 4, "compute_dtype": "tf32"}))
    assert ModelSpec.load(path).gemm_dtype == "tf32"
    path.write_text(yaml.safe_dump({**fields, "dtype_bytes": 3}))
    with pytest.raises(ConfigError) as info:
        ModelSpec.load(path)
    assert str(path) in str(info.value) and "compute_dtype" in str(info.value)
    with pytest.raises(ConfigError, match="compute_dtype"):
        get_cluster("dgx-h100").gemm_flops("int8")
