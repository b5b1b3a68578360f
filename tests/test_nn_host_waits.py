"""Host waits in an MoE layer's forward under expert parallelism, counted on 2 gloo ranks; and the
device-built indices equal the host-built ones they replaced.

On a GPU each of these makes the host wait for the stream: a tensor read (`.cpu()`, `.numpy()`,
`.tolist()`, `.item()`, `int(t)`, `bool(t)`, `np.asarray(t)`), a pageable upload
(`torch.from_numpy(a).to(cuda)`, `torch.as_tensor(list, device=cuda)`) and an op whose output
size depends on the data (`nonzero`, boolean masks, `repeat_interleave` without
`output_size`, `unique`, `bincount`). A CPU has no stream, so the test records each such call
by the innermost `poise` source line it came from (`HostCalls`) and asserts that the forward
of every layer makes one: `poise.nn.host.read_sizes`, the read of the sizes the token
all-to-all needs. Uploads go through `poise.nn.host.upload` only (pinned and non-blocking on
CUDA: no wait). The same recorder run on the code before this change (NumPy indices, counts
read to the host and sent back) counts 3 to 6 per layer (docs/benchmarks.md)."""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.core.placement import Assignment, Placement
from poise.nn.dispatch import (
    RankRouting,
    gather_index,
    gather_index_t,
    is_identity_gather,
    routes_t,
    split_parts,
    split_parts_t,
)
from poise.nn.slots import slot_maps
from poise.runtime.launch import run_ranks

from .test_nn_dispatch import plans

READS = ("cpu", "numpy", "tolist", "item", "__int__", "__bool__", "__float__", "__index__",
         "__array__")  # fmt: skip
UPLOADS = ("from_numpy", "as_tensor", "tensor")
DATA_DEPENDENT = ("nonzero", "masked_select", "_local_scalar_dense", "unique", "_unique2",
                  "unique_dim", "unique_consecutive", "bincount", "is_nonzero", "equal",
                  "allclose")  # fmt: skip


class HostCalls:
    """While active, every host read, upload and data-dependent op made from `poise` code,
    counted as `"kind file:function"` of the innermost `poise` frame; and the calls of
    `poise.nn.host.read_sizes` (`reads`)."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self.reads = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def note(self, kind: str) -> None:
        frames = [f for f in traceback.extract_stack() if "/poise/" in f.filename]
        if frames:
            f = frames[-1]
            self.sites[f"{kind} {Path(f.filename).name}:{f.name}"] += 1

    def _patch(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.note(kind)
            return original(*args, **kwargs)

        self._undo.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> HostCalls:
        from torch.utils._python_dispatch import TorchDispatchMode

        import poise.nn.host as host

        for name in READS:
            self._patch(torch.Tensor, name, f"read.{name}")
        for name in UPLOADS:
            self._patch(torch, name, f"upload.{name}")
        original = host.read_sizes

        def read_sizes(t: torch.Tensor) -> np.ndarray:
            self.reads += 1
            return original(t)

        self._undo.append((host, "read_sizes", original))
        host.read_sizes = read_sizes  # type: ignore[assignment]
        recorder = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                if name in DATA_DEPENDENT:
                    recorder.note(f"op.{name}")
                elif name == "repeat_interleave" and kwargs.get("output_size") is None:
                    recorder.note("op.repeat_interleave")
                elif name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if len(args) > 1 else ())
                ):
                    recorder.note(f"op.{name}[bool]")
                return func(*args, **kwargs)

        self._mode = Ops()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def outside_the_door(self) -> dict[str, int]:
        """The sites other than `read_sizes` and `upload` themselves."""
        door = ("host.py:read_sizes", "host.py:upload")
        return {k: v for k, v in self.sites.items() if not k.endswith(door)}


# ----------------------------------------------------------------------------- 2 gloo ranks
class TwoLayers(torch.nn.Module):
    def __init__(self, moes: list[Any]) -> None:
        super().__init__()
        self.moes = torch.nn.ModuleList(moes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.moes:
            x = x + m(x)
        return x


def _replicas(world: int, E: int) -> tuple[Placement, Assignment, Assignment]:
    """Expert 0 on every rank, expert 3 on rank 0 too: an even split, and one by counts."""
    home = (np.arange(E) * world) // E
    placement = Placement.from_homes(home[None, :], world, E // world + 2)
    placement.copies[0, :, 0] = 1
    placement.copies[0, 0, 3] = 1
    even = Assignment.even(placement)
    return placement, even, even.with_split(True)


def _count(rank: int, world: int, routing: str, overlap: int) -> dict[str, Any]:
    import torch.distributed as dist

    from poise.nn import MoE, MoEConfig, apply_expert_parallel

    torch.manual_seed(0)
    E = 8
    cap = 1.0 if routing == "capacity" else None
    moes = [MoE(MoEConfig(16, 32, E, 2, overlap_degree=overlap, capacity_factor=cap))
            for _ in range(2)]  # fmt: skip
    model = TwoLayers(moes)
    apply_expert_parallel(model, dist.group.WORLD, num_slots=E // world + 2)
    if routing in ("replicas", "by_counts"):
        placement, even, by_counts = _replicas(world, E)
        assignment = even if routing == "replicas" else by_counts
        for m in moes:
            m.set_routing(placement, assignment, slot_maps(placement, 0, m.num_slots)[rank])
    x = torch.randn(40 + 9 * rank, 16, requires_grad=True)
    model(x).sum().backward()  # warm-up: the routing's tables go to the device once
    with HostCalls() as fwd:
        y = model(x)
    with HostCalls() as bwd:
        y.sum().backward()
    return {
        "reads": fwd.reads,
        "forward": fwd.outside_the_door(),
        "backward": bwd.outside_the_door(),
        "backward_reads": bwd.reads,
        "by_counts": moes[0].routing.by_counts,
    }


def test_each_layer_forward_under_ep_reads_the_host_once() -> None:
    """Two MoE layers on 2 gloo ranks, static EP, replicas with an even split (non-identity
    permutations), a split by counts, overlap chunks, and a capacity factor with overlap: two
    reads a forward (one a layer), nothing else, and none in backward."""
    cases = (("static", 1), ("replicas", 1), ("by_counts", 1), ("replicas", 3), ("capacity", 2))
    for routing, overlap in cases:
        per_rank = run_ranks(_count, 2, routing, overlap)
        for rank, got in enumerate(per_rank):
            where = (routing, overlap, rank)
            assert got["by_counts"] == (routing == "by_counts"), where
            assert got["reads"] == 2, (where, got)
            assert got["forward"] == {}, (where, got["forward"])
            assert got["backward"] == {} and got["backward_reads"] == 0, (where, got)


def test_the_recorder_sees_a_read_an_upload_and_a_mask() -> None:
    """`HostCalls` itself: a `.tolist()`, a `torch.from_numpy` and a boolean mask made from a
    `poise` function are each recorded (so their absence above means something)."""
    from poise.nn.dispatch import RankRouting as R

    routing = R.static(4, 1, 0, 4)
    with HostCalls() as calls:
        routing.tables(torch.device("cpu"))  # through upload: allowed
        torch.arange(3).tolist()  # from the test, not poise: not recorded
    assert calls.outside_the_door() == {}
    import poise.nn.experts as experts

    with HostCalls() as calls:
        experts._as_int_list(torch.arange(3))  # a poise function that reads
    assert calls.outside_the_door() == {"read.tolist experts.py:_as_int_list": 1}
    fake: dict[str, Any] = {"torch": torch, "np": np}  # code that says it is poise's
    source = "def mask(v): return v[v > 0]\ndef up(a): return torch.from_numpy(a)\n"
    exec(compile(source, "/src/poise/nn/fake.py", "exec"), fake)
    with HostCalls() as calls:
        fake["mask"](torch.arange(3))
        fake["up"](np.arange(3))
    assert calls.outside_the_door() == {
        "op.index[bool] fake.py:mask": 1,
        "upload.from_numpy fake.py:up": 1,
    }, calls.sites


# ----------------------------------------------------------------------------- same indices
@settings(max_examples=60, deadline=None)
@given(case=plans())
def test_routes_on_the_device_equal_the_hosts(case: tuple[Placement, Assignment, np.ndarray]):
    placement, assignment, counts = case
    maps = slot_maps(placement, 0, placement.experts)
    for rank in range(placement.devices):
        routing = RankRouting.from_plan(placement, assignment, maps[rank], rank)
        c = counts[0, rank]
        got = routes_t(torch.from_numpy(c), routing.tables(torch.device("cpu")), rank)
        np.testing.assert_array_equal(got.numpy(), routing.routes(c))


def test_routes_on_the_device_break_ties_as_numpy() -> None:
    """Equal remainders go to the lower rank first, as NumPy's stable argsort ranks them:
    expert 0 held by ranks 0, 1 and 2, split evenly from rank 3 (thirds: every count that 3
    does not divide leaves tied remainders)."""
    placement = Placement.from_homes(np.array([[0, 1, 2, 3]]), 4, 4)
    placement.copies[0, 1, 0] = placement.copies[0, 2, 0] = 1
    assignment = Assignment.even(placement)
    maps = slot_maps(placement, 0, 4)
    routing = RankRouting.from_plan(placement, assignment, maps[3], 3)
    for n in range(8):
        c = np.array([n, 1, 2, 3])
        got = routes_t(torch.from_numpy(c), routing.tables(torch.device("cpu")), 3)
        np.testing.assert_array_equal(got.numpy(), routing.routes(c))
    assert routing.routes(np.array([2, 0, 0, 0]))[0].tolist() == [1, 1, 0, 0]


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
    parts=st.integers(1, 4),
)
def test_gather_index_on_the_device_equals_the_hosts(sizes: list[int], seed: int, parts: int):
    s = np.array(sizes, dtype=np.int64)
    blocks = np.random.default_rng(seed).permutation(s.size)
    want = gather_index(s, blocks)
    got = gather_index_t(torch.from_numpy(s), torch.from_numpy(blocks), int(s.sum()))
    np.testing.assert_array_equal(got.numpy(), want)
    assert is_identity_gather(s, blocks) == np.array_equal(want, np.arange(want.size))
    np.testing.assert_array_equal(split_parts_t(torch.from_numpy(s), parts).numpy(),
                                  split_parts(s, parts))  # fmt: skip


# ----------------------------------------------------------------------------- the benchmark
def _one_rank_ep(rank: int, world: int) -> list[float]:
    """`benchmarks/cuda_syncs.py --ep`'s layer on a one-rank group, against the local path."""
    from .helpers import load_benchmark

    bench = load_benchmark("cuda_syncs")
    small = ["--tokens", "48", "--d-model", "16", "--d-expert", "32", "--experts", "4"]
    gaps = []
    for overlap in ("1", "2"):
        ep_args = bench.parse_args([*small, "--ep", "--overlap", overlap])
        for name in bench.LAYERS:
            ep = bench.make_layer(ep_args, name, torch.device("cpu"))
            local = bench.make_layer(bench.parse_args(small), name, torch.device("cpu"))
            assert isinstance(ep.dispatcher, bench.EPOnOneRank)
            x = torch.randn(48, 16, dtype=torch.bfloat16)
            gaps.append(float((ep(x).float() - local(x).float()).abs().max()))
    return gaps


def test_the_benchmarks_ep_path_on_one_rank_is_the_layer() -> None:
    """The one-GPU mode of `cuda_syncs.py --ep` (the EP path held on a one-rank group) computes
    what the local path computes; without CUDA the script says so and exits 0."""
    from .helpers import load_benchmark

    assert run_ranks(_one_rank_ep, 1)[0] == [0.0] * 6
    if not torch.cuda.is_available():
        assert load_benchmark("cuda_syncs").main(["--ep"]) == 0
