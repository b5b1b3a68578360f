"""Shared fixtures: the real routing data in ../shared/data (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("POISE_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared routing data not found at {SHARED_DATA} (set POISE_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smartmoe_dir(shared_data: Path) -> Path:
    return shared_data / "smartmoe-ae-sample"


@pytest.fixture(scope="session")
def olmoe_json(shared_data: Path) -> Path:
    return shared_data / "olmoe-expert-counts" / "expert_counts.json"
