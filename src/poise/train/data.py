"""Byte-level text data: a corpus tokenised once into a cached memory-mapped file, batches by
position.

    corpus = build_corpus(None)                  # the Python standard library's *.py files
    corpus = build_corpus("notes/", glob="*.md") # or any text file or folder
    sampler = Sampler(corpus.train, context=128, seed=0)
    x, y = sampler.batch(position, rows=range(r * b, (r + 1) * b), size=B)  # x, y [b, T] int64

Tokens are bytes (vocabulary 256); documents (files) are joined with a NUL byte, which no text
file contains, as the end-of-document token. The token stream is written once to
`<cache>/corpus-<key>.bin` (uint8, atomic write) and read back memory-mapped; `key` hashes the
source list (paths relative to the root, sizes and modification times), so any change makes a
new cache file.

Split: the last `val_fraction` of the stream (at least `min_val` tokens) is validation, the rest
training; deterministic for a given source list.

Batches: the training stream is cut into `N = (len - 1) // T` windows of `T + 1` tokens (input
and shifted target). Sample `g` (counted from the start of training) is window
`perm_{g // N}[g % N]`, where `perm_k` is a permutation drawn from `(seed, k)`. A global batch
at data position `p` is samples `p .. p + B - 1`; rank r of D takes rows `r B/D .. (r+1) B/D - 1`
of it (its own shard), and the position then advances by `B`. The position (one integer) is
what a checkpoint stores: restoring it restores the data exactly, on any number of ranks.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from poise.core.errors import ConfigError, PoiseError
from poise.util.atomic import atomic_write_bytes, atomic_write_text

FORMAT = 1
EOD = 0  # end of document: the NUL byte
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", ".git", ".hg", ".svn"})


class DataError(PoiseError):
    """A corpus that cannot be used: missing, empty, binary, too small."""


@dataclass(frozen=True)
class Corpus:
    """The token stream `tokens [N]` uint8 (memory-mapped) split at `split`: `train` is
    `tokens[:split]`, `val` is `tokens[split:]`. `files`: how many documents; `path`: the cache
    file."""

    tokens: np.ndarray
    split: int
    files: int
    path: Path
    source: str

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.split]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.split :]


def default_cache_dir() -> Path:
    """`$POISE_CACHE`, else `$XDG_CACHE_HOME/poise`, else `~/.cache/poise`."""
    if os.environ.get("POISE_CACHE"):
        return Path(os.environ["POISE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "poise"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(path: str | Path | None, glob: str | None = None) -> tuple[Path, list[Path]]:
    """`(root, files)`: the files of the corpus in sorted order.

    `path` None: the standard library's `*.py` files (without site-packages). A file: itself.
    A folder: every file matching `glob` (default `*`) below it, hidden and cache folders
    skipped."""
    if path is None:
        root = stdlib_root()
        pattern = glob or "*.py"
    else:
        root = Path(path).expanduser()
        pattern = glob or "*"
        if not root.exists():
            raise DataError("no such file or folder", source=str(root), field="data")
        if root.is_file():
            return root.parent, [root]
        if not root.is_dir():
            raise DataError("not a file or folder", source=str(root), field="data")
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for name in names:
            if not name.startswith(".") and fnmatch.fnmatchcase(name, pattern):
                p = Path(folder, name)
                if p.is_file():
                    files.append(p)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(
            f"no files matching {pattern!r} (an empty folder?)", source=str(root), field="data"
        )
    return root, files


def cache_key(root: Path, files: Sequence[Path], val_fraction: float, min_val: int) -> str:
    """A digest of the source list (relative path, size, modification time) and the split."""
    h = hashlib.sha256(f"poise-corpus-v{FORMAT}|{val_fraction!r}|{min_val}\n".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def read_text_bytes(path: Path, *, strict: bool) -> bytes | None:
    """The file's bytes if it is UTF-8 text without NUL bytes. Otherwise a `DataError` naming
    the file (`strict`), or None (the default corpus skips such files)."""
    data = path.read_bytes()
    problem = ""
    if b"\0" in data:
        problem = "contains NUL bytes: a binary file, not text"
    else:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = f"is not UTF-8 text (byte {exc.start}): a binary file?"
    if problem:
        if strict:
            raise DataError(problem, source=str(path), field="data")
        return None
    return data


def build_corpus(
    path: str | Path | None = None,
    *,
    glob: str | None = None,
    cache_dir: str | Path | None = None,
    val_fraction: float = 0.005,
    min_val: int = 4096,
) -> Corpus:
    """Tokenise the sources (see `list_sources`) into the cache, or reuse it; memory-map it.

    Files of a user's corpus must all be UTF-8 text (else `DataError` naming the file); the
    default corpus skips the few standard-library files that are not (test data in other
    encodings)."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"must be in (0, 1), got {val_fraction}", field="val_fraction")
    root, files = list_sources(path, glob)
    source = "python-stdlib" if path is None else str(root if len(files) > 1 else files[0])
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(root, files, val_fraction, min_val)
    bin_path = cache / f"corpus-{key}.bin"
    meta_path = cache / f"corpus-{key}.json"
    meta = _read_meta(meta_path, bin_path)
    if meta is None:
        meta = _write_cache(
            root, files, path is not None, bin_path, meta_path, val_fraction, min_val, source
        )
    tokens = np.memmap(bin_path, dtype=np.uint8, mode="r")
    return Corpus(tokens, int(meta["split"]), int(meta["files"]), bin_path, source)


def _read_meta(meta_path: Path, bin_path: Path) -> dict | None:
    try:
        meta = json.loads(meta_path.read_text())
        if bin_path.stat().st_size == meta["tokens"] and meta["format"] == FORMAT:
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_cache(
    root: Path,
    files: list[Path],
    strict: bool,
    bin_path: Path,
    meta_path: Path,
    val_fraction: float,
    min_val: int,
    source: str,
) -> dict:
    parts = []
    for f in files:
        data = read_text_bytes(f, strict=strict)
        if data:
            parts.append(data)
    if not parts:
        raise DataError("every file is empty or not text", source=str(root), field="data")
    stream = b"\0".join(parts) + b"\0"
    n = len(stream)
    n_val = max(int(n * val_fraction), min(min_val, n // 2))
    meta = {
        "format": FORMAT,
        "source": source,
        "files": len(parts),
        "skipped": len(files) - len(parts),
        "tokens": n,
        "split": n - n_val,
    }
    atomic_write_bytes(bin_path, stream)
    atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    return meta


class Sampler:
    """Windows of `context + 1` tokens from `tokens`, in an order fixed by `seed` (see the module
    docstring). `batch(position, rows, size)` is pure: the same arguments give the same batch."""

    def __init__(self, tokens: np.ndarray, context: int, seed: int = 0, shuffle: bool = True):
        self.tokens = tokens
        self.context = int(context)
        self.windows = (len(tokens) - 1) // self.context
        if self.windows < 1:
            raise DataError(
                f"{len(tokens)} tokens do not fill one window of context {context} + 1",
                field="context",
            )
        self.seed = int(seed)
        self.shuffle = shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._perm = (epoch, rng.permutation(self.windows))
            else:
                self._perm = (epoch, np.arange(self.windows))
        return self._perm[1]

    def window_ids(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """Window index of each global sample number."""
        g = np.asarray(samples, dtype=np.int64)
        out = np.empty_like(g)
        for epoch in np.unique(g // self.windows).tolist():
            sel = g // self.windows == epoch
            out[sel] = self._order(int(epoch))[g[sel] % self.windows]
        return out

    def batch(
        self, position: int, rows: Sequence[int] | range, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets `[len(rows), T]` int64 of samples `position + rows`."""
        ids = self.window_ids(np.asarray(list(rows), dtype=np.int64) + int(position))
        starts = ids * self.context
        idx = starts[:, None] + np.arange(self.context + 1)[None, :]
        chunk = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        chunk = chunk.to(device)
        return chunk[:, :-1], chunk[:, 1:]


def shard_rows(batch: int, rank: int, world: int) -> range:
    """Rank `rank`'s rows of a global batch of `batch` samples (`batch` divisible by `world`)."""
    if batch % world:
        raise ConfigError(f"global batch {batch} is not divisible by {world} ranks", field="batch")
    per = batch // world
    return range(rank * per, (rank + 1) * per)


__all__ = [
    "EOD",
    "Corpus",
    "DataError",
    "Sampler",
    "build_corpus",
    "default_cache_dir",
    "list_sources",
    "read_text_bytes",
    "shard_rows",
]
