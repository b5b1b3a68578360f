from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from poise.core.cluster import GBIT, Cluster, HostCosts
from poise.core.errors import ConfigError
from poise.core.presets import PRESETS, get_cluster

from .helpers import toy_cluster


def assert_load_names_file_and_field(tmp_path, data: dict, field: str) -> None:
    """Loading `data` written as YAML raises one `ConfigError` naming the file and `field`."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        Cluster.load(path)
    assert str(path) in str(info.value)
    assert field in str(info.value)


def test_presets_have_paper_shapes() -> None:
    assert get_cluster("v100-ib50").num_devices == 16
    assert get_cluster("v100-ib50").inter_node.bw_Bps == pytest.approx(50 * GBIT)
    assert get_cluster("v100-nvlink-ib100").num_devices == 64
    assert get_cluster("rtx3090-ib100").num_devices == 16
    assert get_cluster("rtx3090-ib100:8").num_devices == 32
    assert get_cluster("a800-eth10").domains == 2
    assert get_cluster("a800-eth10:4").num_devices == 32
    assert get_cluster("a800-eth10").inter_domain.bw_Bps == pytest.approx(10 * GBIT)
    assert get_cluster("dgx-h100").devices_per_node == 8
    assert get_cluster("cross-dc-1000").domains == 1000
    assert get_cluster("cpu-2").num_devices == 2


def test_levels_between_devices() -> None:
    c = toy_cluster(devices_per_node=2, nodes=2, domains=2)  # 8 devices
    assert c.level_between(0, 0) == -1
    assert c.level_between(0, 1) == 0
    assert c.level_between(1, 2) == 1
    assert c.level_between(3, 4) == 2
    np.testing.assert_array_equal(c.node_of(), [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(c.domain_of(), [0, 0, 0, 0, 1, 1, 1, 1])


def test_gemm_rate_small_batch_curve() -> None:
    c = PRESETS["v100-ib50"]
    assert c.gemm_rate(c.gemm_half_rows, "fp32") == pytest.approx(c.gemm_flops("fp32") / 2)
    assert c.gemm_rate(1e9, "fp32") == pytest.approx(c.gemm_flops("fp32"), rel=1e-5)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_roundtrip(tmp_path, name: str) -> None:
    path = tmp_path / f"{name}.yaml"
    PRESETS[name].save(path)
    assert Cluster.load(path) == PRESETS[name]
    assert get_cluster(str(path)) == PRESETS[name]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("devices_per_node"), "devices_per_node"),
        (lambda d: d.__setitem__("devices_per_node", 0), "devices_per_node"),
        (lambda d: d.__setitem__("devices_per_node", 2.5), "devices_per_node"),
        (lambda d: d["device"]["peak_flops"].__setitem__("fp32", -1), "device.peak_flops.fp32"),
        (lambda d: d["device"]["peak_flops"].__setitem__("bf16", "x"), "device.peak_flops.bf16"),
        (lambda d: d["device"]["peak_flops"].pop("fp32"), "device.peak_flops.fp32"),
        (lambda d: d["device"]["peak_flops"].__setitem__("fp8", 1e15), "device.peak_flops.fp8"),
        (lambda d: d["device"].__setitem__("peak_flops", 1e12), "device.peak_flops"),
        (lambda d: d["device"].__setitem__("gemm_flops", 1e12), "device.gemm_flops"),
        (lambda d: d["device"].__setitem__("gemm_efficiency", 1.5), "device.gemm_efficiency"),
        (lambda d: d["device"].__setitem__("gemm_efficiency", 0), "device.gemm_efficiency"),
        (lambda d: d["device"].pop("peak_flops"), "device.peak_flops"),
        (
            lambda d: d["device"].__setitem__("expert_call_floor_s", -1e-3),
            "device.expert_call_floor_s",
        ),
        (
            lambda d: d["device"].__setitem__("expert_call_floor_s", float("nan")),
            "device.expert_call_floor_s",
        ),
        (
            lambda d: d["device"].__setitem__("expert_call_floor_s", float("inf")),
            "device.expert_call_floor_s",
        ),
        (
            lambda d: d["device"].__setitem__("expert_call_floor_s", "1 ms"),
            "device.expert_call_floor_s",
        ),
        (lambda d: d["links"]["intra_node"].__setitem__("bw_Bps", 0), "links.intra_node.bw_Bps"),
        (lambda d: d["links"].pop("intra_node"), "links.intra_node"),
        (lambda d: d.__setitem__("colour", "red"), "colour"),
        (
            lambda d: d["links"]["inter_node"].__setitem__("shared_by", 0),
            "links.inter_node.shared_by",
        ),
    ],
)
def test_bad_yaml_names_file_and_field(tmp_path, mutate, field: str) -> None:
    data = PRESETS["v100-ib50"].to_dict()
    mutate(data)
    assert_load_names_file_and_field(tmp_path, data, field)


def test_expert_call_floor_in_yaml(tmp_path) -> None:
    """`device.expert_call_floor_s` loads as `Cluster.expert_call_floor_s` (left out: 0, no
    floor, and a cluster without one saves without it); `dgx-h100` carries the measured 0.9 ms
    (docs/benchmarks.md, "Expert compute on an H100") and every other preset none; a bad value
    built in code is refused too."""
    data = PRESETS["v100-ib50"].to_dict()
    assert "expert_call_floor_s" not in data["device"]
    path = tmp_path / "floor.yaml"
    path.write_text(yaml.safe_dump(data))
    assert Cluster.load(path).expert_call_floor_s == 0.0
    data["device"]["expert_call_floor_s"] = 2.5e-4
    path.write_text(yaml.safe_dump(data))
    loaded = Cluster.load(path)
    assert loaded.expert_call_floor_s == 2.5e-4
    assert loaded == dataclasses.replace(PRESETS["v100-ib50"], expert_call_floor_s=2.5e-4)
    assert PRESETS["dgx-h100"].expert_call_floor_s == pytest.approx(0.90e-3)
    assert PRESETS["dgx-h100"].to_dict()["device"]["expert_call_floor_s"] == pytest.approx(9e-4)
    assert get_cluster("dgx-h100:4").expert_call_floor_s == pytest.approx(0.90e-3)
    assert {n for n, c in PRESETS.items() if c.expert_call_floor_s} == {"dgx-h100"}
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="expert_call_floor_s"):
            dataclasses.replace(PRESETS["v100-ib50"], expert_call_floor_s=bad)


def test_unreadable_yaml(tmp_path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("links: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML"):
        Cluster.load(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        Cluster.load(path)
    with pytest.raises(ConfigError, match="file not found"):
        Cluster.load(tmp_path / "missing.yaml")


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="unknown cluster preset"):
        get_cluster("tpu-pod")
    with pytest.raises(ConfigError, match="positive integer"):
        get_cluster("dgx-h100:zero")


# ------------------------------------------------------------------------------- host costs
def test_presets_have_no_host_costs_and_save_as_before() -> None:
    for cluster in PRESETS.values():
        assert cluster.host.is_default and cluster.host == HostCosts()
        assert "host" not in cluster.to_dict()


def test_host_costs_roundtrip_through_yaml(tmp_path) -> None:
    host = HostCosts(
        dense_fwd_flops=3e10, dense_fwd_half_tokens=20.0, dispatch_fwd_s=2e-3,
        dispatch_fwd_s_per_row=5e-7, optimizer_s_per_param=2e-9, allreduce_lat_s=1e-3,
        allreduce_bw_Bps=1.3e9,
    )  # fmt: skip
    cluster = dataclasses.replace(PRESETS["cpu-2"], host=host)
    data = cluster.to_dict()
    assert data["host"]["dense_fwd_flops"] == 3e10
    assert "dense_bwd_flops" not in data["host"]  # None: left out
    path = tmp_path / "c.yaml"
    cluster.save(path)
    assert Cluster.load(path) == cluster
    assert get_cluster(str(path)).host.dispatch_fwd_s_per_row == 5e-7


@pytest.mark.parametrize(
    ("host", "field"),
    [
        ({"dense_fwd_flops": 0}, "host.dense_fwd_flops"),
        ({"dispatch_bwd_s": -1e-3}, "host.dispatch_bwd_s"),
        ({"optimizer_s_per_param": "fast"}, "host.optimizer_s_per_param"),
        ({"allreduce_lat_s": 1e-4}, "host.allreduce_bw_Bps"),  # one of the pair
        ({"colour": 1}, "host.colour"),
    ],
)
def test_bad_host_costs_name_the_file_and_field(tmp_path, host: dict, field: str) -> None:
    data = PRESETS["cpu-2"].to_dict()
    data["host"] = host
    assert_load_names_file_and_field(tmp_path, data, field)
    with pytest.raises(ConfigError, match="clip_s"):
        HostCosts(clip_s=float("nan"))
