"""The package layout the README's "Architecture" section promises, checked on the code."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import poise

PACKAGE = Path(poise.__file__).parent
ROOT = PACKAGE.parent.parent


def test_at_most_four_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 4, top
    assert {"__init__.py", "cli.py"} <= set(top)


def test_every_package_folder_is_a_package() -> None:
    for folder in PACKAGE.rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), folder


def test_import_contracts_hold() -> None:
    """The layers (core <- trace <- cost <- plan <- layouts <- nn <- models <- sim | runtime <-
    train | calibrate | report <- commands <- cli), the independence of `sim` and `runtime`, and
    no import cycles: `lint-imports` with the contracts in pyproject.toml."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is missing: install the dev extra (pip install -e '.[dev]')")
    done = subprocess.run(
        [exe, "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 kept, 0 broken" in done.stdout


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_map_names_every_package() -> None:
    """Every package folder of `src/poise` has its line in the README's architecture table, and
    the table names no package that does not exist."""
    section = _readme().split("## Architecture", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`poise\.(\w+)`", section))
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders <= named, folders - named
    assert named - {"cli"} <= folders | {"core"}, named - folders


def test_readme_library_example_runs() -> None:
    """The README's "Library" snippet, with loads drawn for its model and cluster."""
    import numpy as np

    section = _readme().split("## Library", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    from poise.core.presets import get_cluster
    from poise.core.spec import MODELS

    spec, devices = MODELS["zipf-256"], get_cluster("dgx-h100:4").num_devices
    loads = np.random.default_rng(0).integers(0, 50, size=(2, devices, spec.experts))
    scope: dict = {"loads": loads}
    exec(compile(code, "README.md", "exec"), scope)
    plan = scope["plan"]
    assert plan.placement.home.shape == (2, spec.experts)
    assert plan.cost.step_s > 0
