"""Output paths, checked before any work: a run that would fail to write its result fails first.

`check_output_file` and `check_output_dir` refuse, as one `ConfigError` naming the option, a
path that cannot be written: a folder where a file is expected, a file where a folder is
expected (the path itself or one of its parents), or a folder where no file can be created.
They create nothing but a probe file, removed at once; the writers (`poise.util.atomic`) create
missing folders when they write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from poise.core.errors import ConfigError


def check_output_file(path: str | Path, option: str, *, suffixes: tuple[str, ...] = ()) -> Path:
    """`path` as a `Path` if a file can be written there; else `ConfigError` naming `option`."""
    p = Path(path)
    src = str(path)
    if not src.strip():
        raise ConfigError("empty path", source=option, field=option)
    if suffixes and p.suffix.lower() not in suffixes:
        raise ConfigError(f"must end in {' or '.join(suffixes)}", source=src, field=option)
    if p.is_dir():
        raise ConfigError("is a folder; expected a file name", source=src, field=option)
    _check_folder_chain(p.parent, src, option)
    return p


def check_output_dir(path: str | Path, option: str) -> Path:
    """`path` as a `Path` if files can be written into it (it exists as a writable folder, or
    can be created); else `ConfigError` naming `option`."""
    p = Path(path)
    src = str(path)
    if not src.strip():
        raise ConfigError("empty path", source=option, field=option)
    if p.exists() and not p.is_dir():
        raise ConfigError("is a file; expected a folder", source=src, field=option)
    _check_folder_chain(p, src, option)
    return p


def _check_folder_chain(folder: Path, src: str, option: str) -> None:
    """The nearest existing ancestor of `folder` (itself included) must be a writable folder."""
    current = folder if str(folder) else Path(".")
    while not current.exists():
        if current.parent == current:
            break
        current = current.parent
    if not current.is_dir():
        raise ConfigError(
            f"not writable: {current} is a file, not a folder", source=src, field=option
        )
    if not os.access(current, os.W_OK | os.X_OK) or not _can_create_in(current):
        raise ConfigError(f"folder {current} is not writable", source=src, field=option)


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in `folder` (a probe: permissions alone miss read-only
    file systems and pseudo file systems such as /proc)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".poise-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return True
