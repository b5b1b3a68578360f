from __future__ import annotations

import pytest
import yaml

from poise.core.errors import ConfigError
from poise.core.spec import MODELS, ModelSpec, get_model


def test_derived_quantities() -> None:
    spec = ModelSpec(
        "m",
        d_model=1024,
        d_expert=2048,
        experts=32,
        top_k=2,
        moe_layers=24,
        dtype_bytes=2,
        optimizer_bytes_per_param=12,
    )
    assert spec.expert_params == 2 * 1024 * 2048
    assert spec.expert_bytes == 2 * 1024 * 2048 * 2
    assert spec.migration_bytes == 2 * 1024 * 2048 * 14
    assert spec.flops_per_token_fwd == 4 * 1024 * 2048
    assert spec.token_bytes == 2048
    swiglu = spec.with_(activation="swiglu")
    assert swiglu.expert_params == 3 * 1024 * 2048


def test_yaml_load_and_errors(tmp_path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(
        yaml.safe_dump({"d_model": 64, "d_expert": 128, "experts": 8, "top_k": 2, "moe_layers": 2})
    )
    spec = get_model(str(path))
    assert spec.name == "m" and spec.experts == 8
    path.write_text(
        yaml.safe_dump({"d_model": 64, "d_expert": 128, "experts": 8, "top_k": 9, "moe_layers": 2})
    )
    with pytest.raises(ConfigError, match="top_k"):
        ModelSpec.load(path)
    path.write_text(yaml.safe_dump({"d_model": 64, "experts": 8, "top_k": 2, "moe_layers": 2}))
    with pytest.raises(ConfigError, match=r"m\.yaml: d_expert: missing"):
        ModelSpec.load(path)
    with pytest.raises(ConfigError, match="unknown model"):
        get_model("gpt-99")
    assert "tiny" in MODELS
