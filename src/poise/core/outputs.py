"""Output paths, checked before any work: a run that would fail to write its result fails first.

`check_output_file` and `check_output_dir` refuse, as one `ConfigError` naming the option, a
path that cannot be written: a folder where a file is expected, a file where a folder is
expected (the path itself or one of its parents), or a folder where no file can be created.
They refuse too what Poise must not replace: a target that exists and is not what Poise writes
(a symbolic link, a FIFO, a device node, a socket), and a name longer than the file system
allows (`PC_NAME_MAX` of the folder it goes in, `PC_PATH_MAX` for the whole path). They create
nothing but a probe file, removed at once; the writers (`poise.util.atomic`) create missing
folders when they write, and refuse again, at the rename, to replace anything but a regular file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
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
    _check_names(p, src, option)
    kind = _kind(p)
    if kind == "folder":
        raise ConfigError("is a folder; expected a file name", source=src, field=option)
    if kind not in (None, "file"):
        raise ConfigError(
            f"is {kind}, not a regular file: Poise does not replace it (give another name)",
            source=src,
            field=option,
        )
    _check_folder_chain(p.parent, src, option)
    return p


def check_output_dir(path: str | Path, option: str) -> Path:
    """`path` as a `Path` if files can be written into it (it exists as a writable folder, or
    can be created); else `ConfigError` naming `option`."""
    p = Path(path)
    src = str(path)
    if not src.strip():
        raise ConfigError("empty path", source=option, field=option)
    _check_names(p, src, option)
    kind = _kind(p)
    if kind == "file":
        raise ConfigError("is a file; expected a folder", source=src, field=option)
    if kind not in (None, "folder"):
        raise ConfigError(
            f"is {kind}, not a folder: Poise does not write into it or replace it (give the "
            "folder itself or another name)",
            source=src,
            field=option,
        )
    _check_folder_chain(p, src, option)
    return p


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(p: Path) -> str | None:
    """What `p` is, not following a symbolic link: None (nothing there), "file" (regular),
    "folder", or the words for anything else ("a symbolic link to X", "a FIFO (named pipe)"...)."""
    try:
        mode = os.lstat(p).st_mode
    except FileNotFoundError:
        return None
    except OSError:
        return None  # a parent that is a file, or a name too long: the chain checks say which
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):
        with contextlib.suppress(OSError):
            return f"a symbolic link (to {os.readlink(p)})"
        return "a symbolic link"
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


NAME_MAX = 255  # bytes in one name where the file system does not say (ext4, xfs, btrfs, tmpfs)
PATH_MAX = 4096  # bytes in a whole path where the system does not say (Linux)


def _limit(folder: Path, name: str, fallback: int) -> int:
    try:
        value = os.pathconf(folder, name)
    except (OSError, ValueError):
        return fallback
    return value if value > 0 else fallback


def _check_names(p: Path, src: str, option: str) -> None:
    """Each name in `p` fits the file system's limit (that of the nearest existing folder), and
    so does the whole path: else one error, not an `OSError` at the first write."""
    existing = Path(os.path.abspath(p))
    while not os.path.isdir(existing) and existing.parent != existing:
        existing = existing.parent
    name_max = _limit(existing, "PC_NAME_MAX", NAME_MAX)
    for part in p.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise ConfigError(
                f"the name {part[:40]!r}... is {size} bytes; this file system allows "
                f"{name_max} in one name",
                source=src,
                field=option,
            )
    path_max = _limit(existing, "PC_PATH_MAX", PATH_MAX)
    size = len(os.fsencode(os.path.abspath(p)))
    if size >= path_max:
        raise ConfigError(
            f"the path is {size} bytes; this system allows {path_max - 1}",
            source=src,
            field=option,
        )


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


LOCK_NAME = ".lock"  # in a run's output folder, held by the run writing into it


@contextlib.contextmanager
def output_lock(folder: str | Path, option: str) -> Iterator[Path]:
    """Hold an exclusive lock on `folder` (created if missing) for the `with` block: a second
    run into the same folder is one `ConfigError` naming `option` and the holder's pid, instead
    of two runs renaming checkpoints over each other. The lock is `flock` on `folder/.lock`: the
    kernel drops it when its holder exits however it ends, so a lock left by a dead process
    never blocks. The (empty but for a pid) file stays: removing it would let two runs lock two
    different files."""
    folder = Path(folder)
    src = str(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot lock: {exc.strerror}", source=src, field=option) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise ConfigError(
                f"another run (pid {holder}) is writing into this folder; wait for it to end "
                "or give another folder",
                source=src,
                field=option,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield folder / LOCK_NAME
    finally:
        os.close(fd)  # releases the lock
