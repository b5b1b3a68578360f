"""Check what a `.npy` header (alone or inside a `.npz`) claims against the bytes that follow it.

`np.load` trusts the header: one that states shape (2^22, 2^22) of int64 makes it allocate
128 TiB (a `MemoryError`, or a machine paging to death) even when the file holds 16 bytes.
These checks read only the headers and the archive's directory, never the data, and refuse a
header that claims more data than its file or archive member can hold with one `TraceError`
naming the file and the array. Anything they cannot read (a damaged archive or header, a file
that is missing) is left to `np.load`, whose error the callers already turn into one line.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from pathlib import Path
from typing import IO

import numpy as np
from numpy.lib import format as npy_format

from poise.core.budget import human_bytes
from poise.core.errors import TraceError

# What `np.load` raises on a file that is no array or archive, or one damaged on disk: a bad
# header (ValueError), a cut file (EOFError, OSError), a broken archive or a CRC mismatch
# (BadZipFile), a damaged compressed stream (zlib.error), a member the directory names but the
# archive lacks (KeyError), a damaged version or method field (NotImplementedError, zipfile's
# "zip file version" or "compression type"). Every reader of `.npy` / `.npz` files catches
# exactly these (`poise.trace.trace` re-exports them).
LOAD_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    EOFError,
    KeyError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)

# What the header checks leave to `np.load` to report as it does today: the above, and
# RuntimeError (zipfile opening a member whose "encrypted" flag is set).
SKIPPED_ERRORS: tuple[type[BaseException], ...] = (*LOAD_ERRORS, RuntimeError)

# DEFLATE expands at most 1032-fold (a 258-byte match costs at least a 1-bit length code and a
# 1-bit distance code; block headers only lower the ratio), so a deflated member cannot hold more
# than this many bytes per compressed byte, whatever the directory states.
DEFLATE_MAX_RATIO = 1032


def header_bytes(fp: IO[bytes]) -> tuple[int, int, str] | None:
    """Read the `.npy` header at `fp`'s position: (bytes of array data it claims, bytes from
    `fp`'s start to the data, the shape and dtype in words), or `None` for an array of Python
    objects (its size says nothing; `np.load(allow_pickle=False)` refuses it). Raises what NumPy
    raises on a bad magic string or header (ValueError, EOFError)."""
    major, minor = npy_format.read_magic(fp)
    if (major, minor) == (1, 0):
        shape, _, dtype = npy_format.read_array_header_1_0(fp)
    elif (major, minor) in ((2, 0), (3, 0)):
        # 3.0 differs from 2.0 only in encoding the header as UTF-8, not Latin-1; read as
        # Latin-1 it still parses (non-ASCII field names change, their sizes do not)
        shape, _, dtype = npy_format.read_array_header_2_0(fp)
    else:
        raise ValueError(f"unsupported .npy format version {major}.{minor}")
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        return None
    claimed = math.prod(int(n) for n in shape) * dtype.itemsize
    return claimed, fp.tell(), f"shape {tuple(shape)} of {dtype}"


def check_npy_size(path: Path) -> None:
    """Raise `TraceError` if the `.npy` header of `path` claims more array data than the file
    holds after the header. Returns silently when the file cannot be read as `.npy`."""
    try:
        with open(path, "rb") as fp:
            read = header_bytes(fp)
            size = fp.seek(0, 2)
    except SKIPPED_ERRORS:
        return
    if read is None:
        return
    claimed, offset, what = read
    holds = max(0, size - offset)
    if claimed > holds:
        raise TraceError(
            f"the .npy header states {what}, {_size(claimed)} of array data, but the file holds "
            f"only {_size(holds)} after its header",
            source=str(path),
        )


def check_npz_sizes(path: Path) -> None:
    """Raise `TraceError` naming the array if a member `KEY.npy` of the archive `path` has a
    header that claims more data than the member holds: its uncompressed size from the archive's
    directory, and no more than its compressed bytes can expand to. Returns silently when the
    file cannot be read as a zip archive or a member's header cannot be read."""
    try:
        archive_bytes = path.stat().st_size
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as member:
                    read = header_bytes(member)
                if read is None:
                    continue
                claimed, offset, what = read
                holds = max(0, _member_capacity(info, archive_bytes) - offset)
                if claimed > holds:
                    raise TraceError(
                        f"the .npy header states {what}, {_size(claimed)} of array data, but "
                        f"the archive member holds only {_size(holds)} after its header",
                        source=str(path),
                        field=info.filename.removesuffix(".npy"),
                    )
    except SKIPPED_ERRORS:
        return


def _member_capacity(info: zipfile.ZipInfo, archive_bytes: int) -> int:
    """The most bytes a member can decompress to: its stated uncompressed size, bounded by its
    compressed bytes (themselves bounded by the archive) for the methods NumPy writes."""
    compressed = min(info.compress_size, archive_bytes)
    if info.compress_type == zipfile.ZIP_STORED:
        return min(info.file_size, compressed)
    if info.compress_type == zipfile.ZIP_DEFLATED:
        return min(info.file_size, compressed * DEFLATE_MAX_RATIO)
    return info.file_size


def _size(n: int) -> str:
    """`16 B`, `128.0 TiB`; past any float, the power of ten."""
    if n < 2**70:
        return human_bytes(n)
    return f"about 10^{len(str(n)) - 1} bytes"
