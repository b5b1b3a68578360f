"""Atomic file writes: a crash mid-write leaves the previous file intact, and only a regular
file is ever replaced (never a symbolic link, a FIFO, a device node or a socket)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


TMP_NAME_CHARS = 64  # of the target's name kept in a temporary name: it must fit NAME_MAX too


class NotReplacedError(FileExistsError):
    """The target of a write exists and is not a regular file: it is left as it is. Its message
    is one line naming the path (the CLI prints it as bad input)."""

    def __init__(self, path: Path, what: str):
        super().__init__(errno.EEXIST, f"is {what}, not a regular file: not replaced", str(path))
        self.path = path

    def one_line(self) -> str:
        return f"{self.path}: {self.strerror}"


_SPECIAL = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a device node"),
    (stat.S_ISBLK, "a device node"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_replaceable(path: Path) -> None:
    """Refuse (`NotReplacedError`) to rename over anything at `path` but a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # nothing there (or a parent that is no folder: the write itself says so)
    if stat.S_ISREG(mode):
        return
    what = next((words for test, words in _SPECIAL if test(mode)), "a special file")
    raise NotReplacedError(path, what)


def atomic_write_stream(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Run `write(fh)` into a temporary file in `path`'s folder, fsync it, rename it to `path`
    and fsync the folder: readers never see half a file, and a crash at any point leaves the
    previous file (the temporary one is removed on failure). The file gets the permissions a
    plain `open(path, "w")` would give (0666 less the umask), not `mkstemp`'s private 0600.
    A `path` that exists and is not a regular file is refused (`NotReplacedError`) before anything
    is written and again at the rename."""
    path = Path(path)
    _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = path.name[:TMP_NAME_CHARS]
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        _check_replaceable(path)
        _replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _replace(src: str, dst: Path) -> None:
    os.replace(src, dst)


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; folders that cannot be opened or synced are skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """`atomic_write_stream` of `data`."""
    atomic_write_stream(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_publish_dir(tmp: str | Path, final: str | Path) -> None:
    """Make the finished folder `tmp` appear as `final` in one rename: fsync `tmp`, move an
    existing `final` aside (it is removed once the new one is in place), rename, fsync the
    parent. A crash or error before the rename leaves `final` as it was (a failed rename puts
    the previous folder back); readers never see a folder half written (only a process killed
    between the two renames leaves the previous one beside it as `.NAME.old`)."""
    tmp, final = Path(tmp), Path(final)
    _fsync_dir(tmp)
    old = final.parent / f".{final.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        _replace(str(final), old)
    try:
        _replace(str(tmp), final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)  # put the previous folder back
        raise
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
