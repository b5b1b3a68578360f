"""Bad input: a `.npy` header (alone, or a member of a `.npz` trace) whose shape claims far more
data than the file holds. `np.load` would try to allocate it (a `MemoryError` of "128 TiB");
Poise refuses it with one `TraceError` naming the file and the array, before anything is read."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy_format

from poise.core.errors import TraceError
from poise.trace.importers import load_any
from poise.trace.trace import Trace

from .test_bad_input_round2 import assert_one_line, run_cli

HUGE = (2**22, 2**22)  # of int64: 128 TiB


def lying_npy(shape: tuple[int, ...], data: bytes = b"\0" * 16) -> bytes:
    """A `.npy` whose header states `shape` of int64, followed by only `data`."""
    buf = io.BytesIO()
    header = {"descr": "<i8", "fortran_order": False, "shape": shape}
    npy_format.write_array_header_1_0(buf, header)
    return buf.getvalue() + data


def lying_trace(tmp_path: Path, counts_npy: bytes) -> Path:
    """A valid Poise trace with its `counts` member replaced by `counts_npy` (deflated)."""
    good = tmp_path / "good.npz"
    counts = np.arange(2 * 1 * 2 * 4, dtype=np.int64).reshape(2, 1, 2, 4)
    Trace(counts, np.array([0, 1]), top_k=2, tokens_per_device=64, name="t").save(good)
    bad = tmp_path / "lying.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, counts_npy if name == "counts.npy" else src.read(name))
    return bad


def state_size_in_directory(path: Path, member: str, file_size: int) -> None:
    """Rewrite the uncompressed size the archive's central directory states for `member`."""
    data = bytearray(path.read_bytes())
    end = data.rindex(b"PK\x05\x06")  # end of central directory: where the directory starts
    (at,) = struct.unpack_from("<I", data, end + 16)
    while True:
        assert data[at : at + 4] == b"PK\x01\x02"
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        if data[at + 46 : at + 46 + name_len].decode() == member:
            struct.pack_into("<I", data, at + 24, file_size)
            break
        at += 46 + name_len + extra_len + comment_len
    path.write_bytes(bytes(data))
    assert zipfile.ZipFile(path).getinfo(member).file_size == file_size


@pytest.mark.parametrize("lie", ["header", "header and directory"])
def test_a_trace_member_whose_header_lies_is_one_error(tmp_path: Path, lie: str) -> None:
    """`counts.npy` states 128 TiB (or, with the archive's directory stating 2 GiB too, 2 GiB)
    and holds 16 bytes: one `TraceError` naming the file and `counts`, no allocation."""
    if lie == "header":
        bad = lying_trace(tmp_path, lying_npy(HUGE))
    else:  # the directory agrees with the header; the 16 deflated bytes cannot hold it
        bad = lying_trace(tmp_path, lying_npy((2**28,)))
        state_size_in_directory(bad, "counts.npy", 2**31 + 4096)
    with pytest.raises(TraceError) as exc:
        Trace.load(bad)
    assert exc.value.source == str(bad) and exc.value.field == "counts"
    line = exc.value.one_line()
    assert line.startswith(f"{bad}: counts: ") and "header states" in line, line
    assert ("128.0 TiB" if lie == "header" else "2.0 GiB") in line, line


def test_an_eplb_npy_whose_header_lies_is_one_error(tmp_path: Path) -> None:
    """An EPLB weight `.npy` (read by `load_any`) stating 128 TiB in 16 bytes: one error."""
    bad = tmp_path / "weight.npy"
    bad.write_bytes(lying_npy(HUGE))
    with pytest.raises(TraceError) as exc:
        load_any(bad, format="eplb")
    line = exc.value.one_line()
    assert line.startswith(f"{bad}: ") and "128.0 TiB" in line and "16 B" in line, line
    good = tmp_path / "good.npy"  # a truthful header still loads
    np.save(good, np.ones((2, 4), dtype=np.int64))
    assert load_any(good, format="eplb").counts.shape == (1, 2, 1, 4)


@pytest.mark.parametrize("kind", ["npz", "npy"])
def test_a_lying_header_is_one_line_at_the_command_line(tmp_path: Path, kind: str) -> None:
    """`poise trace stats` of either file: exit status 2, one line naming it, no traceback."""
    if kind == "npz":
        bad = lying_trace(tmp_path, lying_npy(HUGE))
    else:
        bad = tmp_path / "weight.npy"
        bad.write_bytes(lying_npy(HUGE))
    code, err = run_cli(["trace", "stats", str(bad)])
    assert_one_line(code, err, str(bad), "header states", "128.0 TiB")


def test_a_truthful_member_compressed_near_deflates_limit_still_loads(tmp_path: Path) -> None:
    """All-zero counts deflate about 1000-fold, close to DEFLATE's 1032-fold limit: the check's
    bound (compressed bytes x 1032) must not refuse them."""
    counts = np.zeros((16, 2, 16, 2048), dtype=np.int64)  # 8 MiB
    path = tmp_path / "zeros.npz"
    Trace(counts, np.arange(16), top_k=2, tokens_per_device=64, name="zeros").save(path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("counts.npy")
    assert info.file_size > 500 * info.compress_size  # near the limit, as meant
    assert Trace.load(path).counts.shape == counts.shape
