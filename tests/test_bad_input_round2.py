"""Bad input, round 2 (issue 68): outputs that would replace what is not Poise's, numbers as YAML
users write them and repeated keys, corrupt compressed traces. Each refusal is exit status 2
and one line naming the file and the field; nothing already there is replaced."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import stat
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.cli import main
from poise.core.cluster import LINK_LAT_S, Cluster
from poise.core.errors import ConfigError, TraceError
from poise.core.outputs import check_output_dir, check_output_file, output_lock
from poise.core.presets import PRESETS
from poise.trace.generate import generate
from poise.trace.trace import Trace
from poise.train.config import config_from_mapping, load_config, parse_override
from poise.util.atomic import NotReplacedError, atomic_write_text
from poise.util.yaml_load import load_yaml

ROOT = Path(__file__).resolve().parents[1]


def run_cli(argv: list[str]) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, err.getvalue()


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("poise: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("round2") / "t.npz"
    trace = generate("zipf", steps=4, layers=1, devices=4, experts=8, tokens_per_device=64)
    trace.meta["model"] = "tiny"
    trace.save(path)
    return path


# --------------------------------------------------------------------- outputs not theirs


def _symlink_to_file(d: Path) -> Path:
    (d / "keep.txt").write_text("keep\n")
    (d / "link").symlink_to(d / "keep.txt")
    return d / "link"


def _dangling_symlink(d: Path) -> Path:
    (d / "link").symlink_to(d / "nowhere")
    return d / "link"


def _symlink_to_folder(d: Path) -> Path:
    (d / "real").mkdir()
    (d / "link").symlink_to(d / "real")
    return d / "link"


def _fifo(d: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    try:
        os.mkfifo(d / "fifo")
    except OSError as exc:
        pytest.skip(f"cannot make a FIFO here: {exc}")
    return d / "fifo"


def _socket(d: Path) -> Path:
    if not hasattr(socket, "AF_UNIX"):
        pytest.skip("no Unix sockets on this platform")
    path = d / "sock"
    if len(os.fsencode(path)) > 100:
        pytest.skip("the temporary path is too long for a Unix socket")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def _device(d: Path) -> Path:
    """A character device node (a copy of /dev/null's, 1:3) made in `d`: never the real
    /dev/null, which a broken check would replace for the whole machine."""
    if not hasattr(os, "mknod"):
        pytest.skip("no device nodes on this platform")
    path = d / "null"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


TARGETS = {
    "symlink to a file": _symlink_to_file,
    "dangling symlink": _dangling_symlink,
    "symlink to a folder": _symlink_to_folder,
    "FIFO": _fifo,
    "socket": _socket,
    "device node": _device,
}


def _snapshot(path: Path) -> tuple[int, int, int]:
    st_ = os.lstat(path)
    return st_.st_mode, st_.st_ino, st_.st_size


FILE_COMMANDS = [
    (["plan", "TRACE", "--out", "X"], "--out"),
    (["trace", "convert", "TRACE", "X"], "dst"),
    (["layouts", "TRACE", "--json", "X"], "--json"),
]
DIR_COMMANDS = [
    (["simulate", "TRACE", "--out", "X", "--policies", "static"], "--out"),
    (["train", "tiny", "--steps", "1", "--out", "X"], "--out"),
]


@pytest.mark.parametrize("kind", sorted(TARGETS))
@pytest.mark.parametrize(
    ("argv", "field"),
    [*FILE_COMMANDS, *DIR_COMMANDS],
    ids=[" ".join(a[:2]) for a, _ in [*FILE_COMMANDS, *DIR_COMMANDS]],
)
def test_an_output_that_is_not_a_regular_file_is_refused_and_kept(
    tmp_path: Path, trace_file: Path, kind: str, argv: list[str], field: str
) -> None:
    target = TARGETS[kind](tmp_path)
    before = _snapshot(target)
    filled = [str(trace_file) if a == "TRACE" else str(target) if a == "X" else a for a in argv]
    started = time.perf_counter()
    code, err = run_cli(filled)
    assert_one_line(code, err, str(target), field)
    assert _snapshot(target) == before  # nothing replaced
    if kind == "symlink to a file":
        assert (tmp_path / "keep.txt").read_text() == "keep\n"
    assert time.perf_counter() - started < 10.0


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["plan", "TRACE", "--out", "LONG.json"], "--out"),
        (["trace", "generate", "zipf", "LONG.npz"], "out"),
        (["simulate", "TRACE", "--out", "LONG"], "--out"),
        (["simulate", "TRACE", "--out", "LONG/sub"], "--out"),
        (["train", "tiny", "--out", "LONG"], "--out"),
    ],
)
def test_a_name_longer_than_the_file_system_allows_is_one_line(
    tmp_path: Path, trace_file: Path, argv: list[str], field: str
) -> None:
    long = str(tmp_path / ("a" * 300))
    filled = [str(trace_file) if a == "TRACE" else a.replace("LONG", long) for a in argv]
    code, err = run_cli(filled)
    assert_one_line(code, err, field, "this file system allows")
    assert list(tmp_path.iterdir()) == []


def test_a_name_near_the_limit_is_written(tmp_path: Path, trace_file: Path) -> None:
    """A name that fits is written (its temporary name must fit too)."""
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("b" * (name_max - 5) + ".json")
    code, err = run_cli(["plan", str(trace_file), "--out", str(out)])
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_the_checks_themselves(tmp_path: Path) -> None:
    link = _symlink_to_file(tmp_path)
    with pytest.raises(ConfigError, match="symbolic link"):
        check_output_file(link, "--out")
    with pytest.raises(ConfigError, match="symbolic link"):
        check_output_dir(link, "--out")
    assert check_output_file(tmp_path / "keep.txt", "--out") == tmp_path / "keep.txt"
    assert check_output_dir(tmp_path, "--out") == tmp_path


def test_an_atomic_write_never_renames_over_a_special_file(tmp_path: Path) -> None:
    """Checked again at the rename: a target that became a link after its check is kept."""
    link = _symlink_to_file(tmp_path)
    with pytest.raises(NotReplacedError, match="symbolic link"):
        atomic_write_text(link, "new")
    assert link.is_symlink() and (tmp_path / "keep.txt").read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "link"]


def test_a_second_run_into_a_locked_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with output_lock(out, "--out"):
        busy = rf"--out: another run \(pid {os.getpid()}\)"
        with pytest.raises(ConfigError, match=busy), output_lock(out, "--out"):
            pass
        code, err = run_cli(["train", "tiny", "--steps", "1", "--out", str(out)])
        assert_one_line(code, err, str(out), "--out", "another run")
    with output_lock(out, "--out"):  # released on exit
        pass


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = (
        "import os, sys; from poise.core.outputs import output_lock\n"
        f"cm = output_lock({str(out)!r}, '--out'); cm.__enter__(); os._exit(9)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert proc.returncode == 9 and (out / ".lock").exists()
    with output_lock(out, "--out"):
        pass


# --------------------------------------------------------------------- numbers as written

SPELLINGS = ["3e-4", "3E-4", "+3e-4", "0.0003", "3.0e-4", ".0003", "30e-5", "3_0e-5"]


def _cluster_lat(folder: Path, text: str) -> float:
    """A cluster file whose `links.inter_node.lat_s` is written `text`, loaded: that figure (a
    field whose bounds, 0 to 10 s, admit the spellings of 3e-4)."""
    data = PRESETS["v100-ib50"].to_dict()
    data["links"]["inter_node"]["lat_s"] = "LAT"
    path = folder / "k.yaml"
    path.write_text(yaml.safe_dump(data).replace("LAT", text))
    return Cluster.load(path).inter_node.lat_s


@pytest.mark.parametrize("text", SPELLINGS)
def test_a_number_as_users_write_it_is_read_everywhere(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"model: tiny\nlr: {text}\n")
    assert load_config(path).lr == pytest.approx(3e-4)
    assert parse_override(f"lr={text}") == ("lr", pytest.approx(3e-4))
    assert _cluster_lat(tmp_path, text) == pytest.approx(3e-4)


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-Infinity", ".inf", ".nan"])
def test_non_finite_spellings_are_refused_as_non_finite(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"model: tiny\nlr: {text}\n")
    code, err = run_cli(["train", str(path), "--steps", "1", "--out", str(tmp_path / "o")])
    assert_one_line(code, err, str(path), "lr", "finite")
    code, err = run_cli(["train", "tiny", "--set", f"lr={text}", "--out", str(tmp_path / "o")])
    assert_one_line(code, err, "lr", "finite")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["yes", "true", '"3e-4"', "'1e3'"])
def test_booleans_and_quoted_text_are_no_numbers(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"model: tiny\nlr: {text}\n")
    with pytest.raises(ConfigError, match="lr"):
        load_config(path)


FINITE = st.floats(allow_nan=False, allow_infinity=False, min_value=1e-12, max_value=1e12)
FORMATS = st.sampled_from([repr, "{:e}".format, "{:g}".format, "{:.17g}".format, "{:E}".format])


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(value=FINITE, fmt=FORMATS)
def test_any_float_formatting_round_trips(tmp_path: Path, value: float, fmt) -> None:
    """`repr`, `%e` and `%g` of a finite float read back as that float from a training config,
    a cluster file and `--set` alike."""
    text = fmt(value)
    expect = float(text)
    assert config_from_mapping(load_yaml(f"model: tiny\nlr: {text}"), source="x").lr == expect
    assert parse_override(f"lr={text}")[1] == expect
    if expect <= LINK_LAT_S[1]:  # within what a link's latency can mean
        assert _cluster_lat(tmp_path, text) == expect


# --------------------------------------------------------------------- repeated keys


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ("model: tiny\nlr: 1.0e-3\nsteps: 4\nlr: 2.0e-3\n", "lr"),
        ("model: tiny\nmodel_overrides: {d_model: 64, d_model: 32}\n", "d_model"),
    ],
    ids=["top level", "nested flow mapping"],
)
def test_a_repeated_key_in_a_config_is_refused(tmp_path: Path, body: str, key: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(body)
    code, err = run_cli(["train", str(path), "--steps", "1", "--out", str(tmp_path / "o")])
    assert_one_line(code, err, str(path), key, "duplicate key")
    assert not (tmp_path / "o").exists()


def test_a_repeated_key_in_a_cluster_file_and_in_set_is_refused(tmp_path: Path) -> None:
    body = yaml.safe_dump(PRESETS["v100-ib50"].to_dict())
    path = tmp_path / "k.yaml"
    path.write_text(body + "devices_per_node: 4\n")
    with pytest.raises(ConfigError, match=r"k\.yaml: devices_per_node: duplicate key"):
        Cluster.load(path)
    (tmp_path / "k.json").write_text('{"name": "a", "name": "b"}')
    with pytest.raises(ConfigError, match=r"k\.json: name: duplicate key"):
        Cluster.load(tmp_path / "k.json")
    with pytest.raises(ConfigError, match=r"--set .*: a: duplicate key"):
        parse_override("x={a: 1, a: 2}")


def test_merge_keys_may_still_be_overridden() -> None:
    assert load_yaml("b: &b {a: 1, c: 3}\nd:\n  <<: *b\n  a: 2\n")["d"] == {"a": 2, "c": 3}


# --------------------------------------------------------------------- corrupt compressed data


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0xFF
    return bytes(b)


def _damaged(trace_file: Path) -> dict[str, bytes]:
    """The trace with one byte flipped at every position, cut in half, and empty."""
    data = trace_file.read_bytes()
    out = {f"flip {i}": _flip(data, i) for i in range(len(data))}
    out["truncated"] = data[: len(data) // 2]
    out["empty"] = b""
    return out


def test_every_damaged_byte_of_a_compressed_trace_is_one_error(
    tmp_path: Path, trace_file: Path
) -> None:
    """A flip at any byte (header, compressed stream, CRC, directory), a cut file or an empty
    one: `Trace.load` raises only `TraceError`, one line naming the file, or loads a trace that
    validates (a flip in bytes nobody reads, such as a timestamp)."""
    bad = tmp_path / "bad.npz"
    zlib_hits = 0
    for what, body in _damaged(trace_file).items():
        bad.write_bytes(body)
        try:
            Trace.load(bad)
        except TraceError as exc:
            line = exc.one_line()
            assert line.startswith(str(bad)) and "\n" not in line, (what, line)
            zlib_hits += "corrupt compressed data" in line
    assert zlib_hits > 0  # the sweep reached the compressed stream


@pytest.mark.parametrize(
    "argv", [["trace", "stats", "X"], ["simulate", "X", "--out", "OUT"], ["plan", "X"]]
)
def test_a_corrupt_compressed_trace_is_one_line_at_the_command_line(
    tmp_path: Path, trace_file: Path, argv: list[str]
) -> None:
    import numpy as np

    data = trace_file.read_bytes()
    bad = tmp_path / "bad.npz"
    for at in range(len(data)):  # the first flip that breaks the compressed stream itself
        bad.write_bytes(_flip(data, at))
        try:
            with np.load(bad, allow_pickle=False) as z:
                [z[k] for k in z.files]
        except zlib.error:
            break
        except Exception:  # damage elsewhere: not this test's case
            continue
    else:
        pytest.skip("no flip reached the compressed stream")
    filled = [str(bad) if a == "X" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with contextlib.chdir(tmp_path):
        code, err = run_cli(filled)
    assert_one_line(code, err, str(bad), "corrupt compressed data")
    assert not (tmp_path / "out").exists()
