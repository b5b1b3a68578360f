"""The manifest of a checkpoint folder: the size and SHA-256 of every file in it, written last
(before the folder is published) and checked before anything of the checkpoint is used.

    write_manifest(folder, hashed)   # rank 0, after every other file is written
    verify(folder)                   # CheckpointError (field `manifest`) naming the first bad file

`manifest.json` is `{"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "files": {name:
{"size", "sha256"}}}`; it must list `poise.pt` and DCP's `.metadata`. Each rank hashes the
shards it wrote (`own_shards`), so the digests of large files are computed in parallel.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from poise.core.errors import PoiseError
from poise.util.atomic import atomic_write_text

META = "poise.pt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "poise-checkpoint-manifest"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20  # bytes read at a time while hashing


class CheckpointError(PoiseError):
    """A checkpoint that cannot be found, read or used."""


def _file_entry(path: Path) -> dict[str, Any]:
    """`{"size", "sha256"}` of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def own_shards(folder: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Entries of the DCP shards this rank wrote (`__<rank>_*.distcp`)."""
    if not folder.is_dir():
        return {}
    return {p.name: _file_entry(p) for p in sorted(folder.glob(f"__{rank}_*.distcp"))}


def write_manifest(folder: str | Path, hashed: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write `manifest.json` into the checkpoint folder (atomically): every other file's size
    and SHA-256, taken from `hashed` (what the ranks hashed of their own shards) where its size
    still matches, else hashed here. Call it after every file of the checkpoint is written."""
    folder = Path(folder)
    hashed = hashed or {}
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        entry = hashed.get(p.name)
        if entry is None or entry.get("size") != p.stat().st_size:
            entry = _file_entry(p)
        files[p.name] = entry
    doc = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "files": files}
    path = folder / MANIFEST
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def _manifest_files(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's `files`, checked for shape; `CheckpointError` (field `manifest`)."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            "no manifest.json: unfinished, or written by a Poise before checkpoints carried "
            "checksums, so it cannot be verified",
            source=str(folder),
            field="manifest",
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"unreadable ({type(exc).__name__})", source=str(path), field="manifest"
        ) from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != MANIFEST_FORMAT
        or doc.get("version") != MANIFEST_VERSION
        or not isinstance(files, dict)
    ):
        raise CheckpointError(
            f"not a {MANIFEST_FORMAT} v{MANIFEST_VERSION}", source=str(path), field="manifest"
        )
    for name, entry in files.items():
        ok = (
            isinstance(name, str)
            and name not in ("", ".", "..", MANIFEST)
            and "/" not in name
            and "\\" not in name
            and isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
        )
        if not ok:
            raise CheckpointError(
                f"malformed entry {str(name)[:80]!r}", source=str(path), field="manifest"
            )
    for needed in (META, ".metadata"):
        if needed not in files:
            raise CheckpointError(f"does not list {needed}", source=str(path), field="manifest")
    return files


def verify(folder: str | Path) -> None:
    """Check every file the checkpoint's `manifest.json` lists: present, of its size and its
    SHA-256. One `CheckpointError` (field `manifest`) naming the first file that is not."""
    folder = Path(folder)
    for name, entry in sorted(_manifest_files(folder).items()):
        p = folder / name
        if not p.is_file():
            raise CheckpointError(
                f"{name} is missing (listed in manifest.json)", source=str(folder),
                field="manifest",
            )  # fmt: skip
        size = p.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{name} is {size} bytes, manifest.json says {entry['size']} (truncated or "
                "overwritten)",
                source=str(folder),
                field="manifest",
            )
        if _file_entry(p)["sha256"] != entry["sha256"]:
            raise CheckpointError(
                f"{name} does not match its SHA-256 in manifest.json (damaged)",
                source=str(folder),
                field="manifest",
            )
