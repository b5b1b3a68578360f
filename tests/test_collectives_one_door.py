"""Every collective goes through `poise.nn.comm`, and `comm` puts its tensors where the backend
takes them.

- The door: every module under `src/poise` is parsed with `ast`; a call of a `torch.distributed`
  collective (under any alias: `dist.all_reduce(`, `torch.distributed.barrier(`,
  `from torch.distributed import all_reduce as ar; ar(`, functional collectives) outside
  `poise/nn/comm.py` fails the test, naming the file and line.
- The device: `comm_device_for` (the pure decision) sends a CPU tensor under NCCL to the current
  CUDA device and keeps gloo on the CPU; the hot path (`all_to_all_single`) refuses a CPU tensor
  under NCCL instead of copying it.
- The round trip: on 2 gloo ranks each wrapper gives what `torch.distributed` gives directly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import poise
from poise.nn import comm
from poise.nn.comm import CommDeviceError, comm_device_for, refuses, serves
from poise.runtime.launch import run_ranks

PACKAGE = Path(poise.__file__).parent
DOOR = PACKAGE / "nn" / "comm.py"

# Every collective and point-to-point call of torch.distributed (and its c10d module).
COLLECTIVES = frozenset(
    {
        "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
        "all_gather_single", "all_gather_coalesced", "all_gather_object", "all_to_all",
        "all_to_all_single", "broadcast", "broadcast_object_list", "barrier",
        "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
        "reduce_scatter_single", "gather", "gather_object", "scatter", "scatter_object_list",
        "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
        "recv_object_list", "all_gather_tensor", "all_gather_tensor_autograd",
        "all_reduce_inplace", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd",
        "permute_tensor", "wait_tensor",
    }
)  # fmt: skip
# Modules whose attributes above are collectives.
DIST_MODULES = frozenset(
    {
        "torch.distributed",
        "torch.distributed.distributed_c10d",
        "torch.distributed._functional_collectives",
    }
)


def direct_collective_calls(source: str, filename: str = "<src>") -> list[str]:
    """`file:line name` of each call of a torch.distributed collective in `source`: through a
    module alias (`import torch.distributed as dist`, `import torch`, `from torch import
    distributed`, `import torch.distributed._functional_collectives as funcol`) or a name
    imported from one (`from torch.distributed import all_reduce as ar`)."""
    tree = ast.parse(source, filename)
    modules: dict[str, str] = {}  # local name -> module it stands for
    names: dict[str, str] = {}  # local name -> collective it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    modules[a.asname] = a.name
                else:  # `import torch.distributed` binds `torch`
                    top = a.name.split(".")[0]
                    modules[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                local = a.asname or a.name
                full = f"{node.module}.{a.name}"
                if full in DIST_MODULES:
                    modules[local] = full
                elif node.module in DIST_MODULES and a.name in COLLECTIVES:
                    names[local] = a.name

    def dotted(expr: ast.expr) -> str | None:
        """`a.b.c` with `a` resolved through the module aliases; None for anything else."""
        if isinstance(expr, ast.Name):
            return modules.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        hit = None
        if isinstance(f, ast.Name) and f.id in names:
            hit = names[f.id]
        elif (
            isinstance(f, ast.Attribute)
            and f.attr in COLLECTIVES
            and dotted(f.value) in DIST_MODULES
        ):
            hit = f.attr
        if hit is not None:
            found.append(f"{filename}:{node.lineno} {hit}")
    return found


def test_every_collective_goes_through_the_one_door() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == DOOR:
            continue
        rel = str(path.relative_to(PACKAGE.parent))
        offenders += direct_collective_calls(path.read_text(), rel)
    assert not offenders, (
        "call these through poise.nn.comm (which puts the tensors on the group's device):\n"
        + "\n".join(offenders)
    )


def test_the_door_itself_calls_torch_distributed() -> None:
    """The check sees the door's own calls (so it would see them anywhere else)."""
    calls = direct_collective_calls(DOOR.read_text())
    assert {c.split()[-1] for c in calls} >= {"all_reduce", "all_to_all_single", "barrier"}


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("import torch.distributed as dist\ndist.all_reduce(t)", "all_reduce"),
        ("import torch.distributed\ntorch.distributed.barrier()", "barrier"),
        ("import torch\ntorch.distributed.broadcast(t, 0)", "broadcast"),
        ("from torch import distributed as d\nd.all_gather(xs, x)", "all_gather"),
        ("from torch.distributed import all_reduce\nall_reduce(t)", "all_reduce"),
        ("from torch.distributed import all_to_all_single as a2a\na2a(o, i)", "all_to_all_single"),
        ("import torch.distributed as dist\ndist.distributed_c10d.send(t, 1)", "send"),
        (
            "import torch.distributed._functional_collectives as funcol\n"
            "funcol.all_to_all_single(x, [1], [1], g)",
            "all_to_all_single",
        ),
        ("from torch.distributed import batch_isend_irecv as b\nb(ops)", "batch_isend_irecv"),
    ],
)
def test_the_check_catches_each_way_of_calling(source: str, name: str) -> None:
    assert [c.split()[-1] for c in direct_collective_calls(source)] == [name]


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.get_world_size(g)\ndist.ReduceOp.MAX",
        "from poise.nn import comm\ncomm.all_reduce(t)",
        "import torch.distributed as dist\nx.all_reduce(t)",  # not torch.distributed
        "def all_reduce(t): ...\nall_reduce(t)",
    ],
)
def test_the_check_lets_the_rest_pass(source: str) -> None:
    assert direct_collective_calls(source) == []


# ----------------------------------------------------------------------------- the device
def test_a_cpu_tensor_under_nccl_goes_to_the_current_gpu() -> None:
    cuda = torch.device("cuda", 3)
    assert comm_device_for("nccl", "cpu", 3) == cuda
    assert comm_device_for("nccl", torch.device("cuda", 1), 3) == torch.device("cuda", 1)
    with pytest.raises(CommDeviceError):
        comm_device_for("nccl", "cpu", None)


def test_gloo_and_no_group_keep_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert comm_device_for("gloo", "cpu", 0) == cpu
    assert comm_device_for("gloo", torch.device("cuda", 0), 0) == cpu  # gloo is fed CPU tensors
    assert comm_device_for(None, torch.device("cuda", 0), 0) == cpu
    assert comm_device_for("mpi", "cpu", None) == cpu


def test_a_mixed_group_keeps_each_tensor_where_it_is() -> None:
    mixed = "cpu:gloo,cuda:nccl"
    assert comm_device_for(mixed, "cpu", 0) == torch.device("cpu")
    assert comm_device_for(mixed, torch.device("cuda", 2), 0) == torch.device("cuda", 2)
    assert serves(mixed, "cpu") and serves(mixed, "cuda")
    assert serves("nccl", "cuda") and not serves("nccl", "cpu")
    assert serves("gloo", "cpu") and not serves("gloo", "cuda")


def test_the_hot_path_refuses_a_cpu_tensor_under_nccl_only() -> None:
    assert refuses("nccl", "cpu")
    assert not refuses("nccl", "cuda")
    assert not refuses("gloo", "cpu")
    assert not refuses("gloo", "cuda")  # as before: gloo's own rules
    assert not refuses("cpu:gloo,cuda:nccl", "cpu")


def test_no_process_group_is_the_cpu() -> None:
    assert comm.comm_device(None, "cpu") == torch.device("cpu")
    assert comm.group_backend(None) is None


# ----------------------------------------------------------------------------- 2 gloo ranks
def _round_trip(rank: int, world: int) -> dict[str, bool]:
    import torch.distributed as dist

    def base(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 10 + rank)
        return torch.randn(*shape, generator=g).to(dtype)

    same: dict[str, bool] = {}
    for op in (comm.ReduceOp.SUM, comm.ReduceOp.MAX, comm.ReduceOp.MIN):
        a, b = base(1, 5, 3), base(1, 5, 3)
        dist.all_reduce(a, op=op)
        comm.all_reduce(b, op=op)
        same[f"all_reduce {op}"] = torch.equal(a, b)
    a, b = base(2, 4, dtype=torch.long), base(2, 4, dtype=torch.long)
    dist.all_reduce(a, async_op=True).wait()
    comm.all_reduce(b, async_op=True).wait()
    same["all_reduce async"] = torch.equal(a, b)
    a, b = base(3, 6), base(3, 6)
    dist.broadcast(a, src=1)
    comm.broadcast(b, src=1)
    same["broadcast"] = torch.equal(a, b)
    x = base(4, 2, 3)
    la = [torch.empty_like(x) for _ in range(world)]
    lb = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(la, x)
    comm.all_gather(lb, x)
    same["all_gather"] = all(torch.equal(p, q) for p, q in zip(la, lb, strict=True))
    oa, ob = x.new_empty(world * x.numel()), x.new_empty(world * x.numel())
    dist.all_gather_single(oa, x.view(-1))
    comm.all_gather_single(ob, x.view(-1))
    same["all_gather_single"] = torch.equal(oa, ob)
    big = base(5, world * 4)
    ra, rb = big.new_empty(4), big.new_empty(4)
    dist.reduce_scatter_single(ra, big)
    comm.reduce_scatter_single(rb, big)
    same["reduce_scatter_single"] = torch.equal(ra, rb)
    pieces = [base(6 + i, 3) for i in range(world)]
    ra, rb = pieces[0].new_empty(3), pieces[0].new_empty(3)
    dist.reduce_scatter(ra, [p.clone() for p in pieces])
    comm.reduce_scatter(rb, [p.clone() for p in pieces])
    same["reduce_scatter"] = torch.equal(ra, rb)
    in_splits = [1 + rank, 2]  # rows to ranks 0 and 1
    out_splits = [1 + r if rank == 0 else 2 for r in range(world)]
    send = base(8, sum(in_splits), 3)
    ta, tb = send.new_empty(sum(out_splits), 3), send.new_empty(sum(out_splits), 3)
    dist.all_to_all_single(ta, send, out_splits, in_splits)
    comm.all_to_all_single(tb, send, out_splits, in_splits, async_op=True).wait()
    same["all_to_all_single"] = torch.equal(ta, tb) and ta.shape[0] == sum(out_splits)
    objs_a, objs_b = [None] * world, [None] * world
    dist.all_gather_object(objs_a, {"rank": rank})
    comm.all_gather_object(objs_b, {"rank": rank})
    same["all_gather_object"] = objs_a == objs_b == [{"rank": 0}, {"rank": 1}]
    box_a, box_b = [("plan", rank)], [("plan", rank)]
    dist.broadcast_object_list(box_a, src=0)
    comm.broadcast_object_list(box_b, src=0)
    same["broadcast_object_list"] = box_a == box_b == [("plan", 0)]
    comm.barrier()
    comm.barrier(group=dist.group.WORLD)
    same["barrier"] = True
    same["device"] = comm.comm_device(None, "cpu") == torch.device("cpu")
    same["backend"] = comm.group_backend(None) == "gloo"
    return same


def test_each_wrapper_gives_what_torch_distributed_gives_on_gloo() -> None:
    for rank, same in enumerate(run_ranks(_round_trip, 2)):
        assert all(same.values()), (rank, {k: v for k, v in same.items() if not v})
