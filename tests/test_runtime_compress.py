"""HybridEP's compressed expert rows: the codec on one process, the compressed Trans on 2 gloo
ranks against the plain Trans and against the codec applied to the homes' rows."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from poise.core.errors import ConfigError
from poise.runtime.hybridep import compress as cz
from poise.runtime.launch import run_ranks


def _experts(seed: int = 0, E: int = 8, shape: tuple[int, ...] = (16, 32)) -> torch.Tensor:
    """`[E, *shape]` experts that share most of their weights: a common base, a sparse
    per-expert part and small noise (the structure HybridEP's Fig. 9 reports)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    sparse = torch.randn(E, *shape, generator=g) * (torch.rand(E, *shape, generator=g) < 0.05)
    return base + 3 * sparse + 0.01 * torch.randn(E, *shape, generator=g)


# ------------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_round_trip_is_exact_at_ratio_one(dtype: torch.dtype) -> None:
    w = _experts().to(dtype)
    shared = cz.shared_expert(w)
    enc = cz.encode(w, shared, 1.0)
    assert enc.indices is None  # dense
    buf = cz.pack(enc)
    assert buf.dtype == torch.uint8
    out = cz.decode(cz.unpack(buf, (16, 32), 1.0, dtype), shared)
    assert out.dtype == dtype
    assert torch.equal(out, w)
    assert cz.relative_error(w, out) == 0.0


def test_error_decreases_with_the_ratio() -> None:
    w = _experts()
    shared = cz.shared_expert(w)
    ratios = [0.002, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.5, 1.0]
    errors = [cz.relative_error(w, cz.roundtrip(w, shared, r)) for r in ratios]
    sparse = [e for r, e in zip(ratios, errors, strict=True) if not cz.is_dense(512, r, w.dtype)]
    assert all(a > b for a, b in itertools.pairwise(sparse)), errors
    assert errors[-2:] == [0.0, 0.0]  # fp32 rows go dense from ratio 0.5 on: exact
    # The shared expert carries most of the weights: keeping 20% of the residual leaves a
    # small error, far below sending the top 20% of the experts themselves (no shared part).
    assert errors[ratios.index(0.2)] < 0.1
    no_shared = cz.relative_error(w, cz.roundtrip(w, torch.zeros_like(shared), 0.2))
    assert errors[ratios.index(0.2)] < no_shared / 5


def test_the_largest_residual_entries_are_kept_sparse_rows_exact_there() -> None:
    shared = torch.zeros(4, 5)
    row = torch.zeros(1, 4, 5)
    row[0, 1, 2], row[0, 3, 4], row[0, 0, 0] = 9.0, -7.0, 0.5
    enc = cz.encode(row, shared, 0.1)  # k = ceil(2.0) = 2 of 20 entries
    assert enc.indices is not None  # sparse
    assert enc.indices.tolist() == [[7, 19]]  # sorted flat positions of 9 and -7
    assert enc.values.tolist() == [[9.0, -7.0]]
    out = cz.decode(enc, shared)
    want = row.clone()
    want[0, 0, 0] = 0.0
    assert torch.equal(out, want)


def test_bytes_on_the_wire_follow_the_formula() -> None:
    # fp32 rows of 512 entries: k = ceil(0.1 * 512) = 52 values and 52 int32 indices.
    assert cz.kept(512, 0.1) == 52
    assert cz.row_wire_bytes(512, 0.1, torch.float32) == 52 * (4 + 4) == 416
    assert cz.row_wire_bytes(512, 0.5, torch.float32) == 512 * 4  # break-even: dense
    # bf16: 2-byte values, 4-byte indices; dense from k * 6 >= 1024 (ratio 1/3).
    assert cz.row_wire_bytes(512, 0.1, torch.bfloat16) == 52 * 6
    assert cz.row_wire_bytes(512, 0.33, torch.bfloat16) == 169 * 6
    assert cz.row_wire_bytes(512, 0.34, torch.bfloat16) == 1024
    assert cz.row_wire_bytes(512, 0.1, torch.float64) == 52 * 16  # int64 indices
    assert cz.kept(512, 1e-9) == 1 and cz.kept(512, 1.0) == 512
    w = _experts()
    shared = cz.shared_expert(w)
    for dtype in (torch.float32, torch.bfloat16):
        for ratio in (0.003, 0.05, 0.2, 0.4, 1.0):
            enc = cz.encode(w.to(dtype), shared.to(dtype), ratio)
            per_row = cz.row_wire_bytes(512, ratio, dtype)
            assert cz.pack(enc).numel() == 8 * per_row
            assert cz.packed_bytes((16, 32), ratio, dtype) == per_row
            expected = min(cz.kept(512, ratio) * (dtype.itemsize + 4), 512 * dtype.itemsize)
            assert per_row == expected
            assert math.isclose(
                cz.relative_error(w.to(dtype), cz.roundtrip(w.to(dtype), shared.to(dtype), ratio)),
                cz.relative_error(
                    w.to(dtype),
                    cz.decode(cz.unpack(cz.pack(enc), (16, 32), ratio, dtype), shared.to(dtype)),
                ),
            )


def test_settings_are_checked() -> None:
    assert cz.Compression.parse(None) is None
    assert cz.Compression.parse(0.02) == cz.Compression(0.02)
    for bad in (0, 0.0, -0.1, 1.5, "0.1", True, float("nan")):
        with pytest.raises(ConfigError, match=r"compression\.ratio"):
            cz.Compression(bad)  # type: ignore[arg-type]
    assert cz.relative_error(torch.zeros(3), torch.ones(3)) == 0.0


def test_balancer_leaves_compression_off_by_default() -> None:

    from poise.nn import MoE, MoEConfig
    from poise.runtime.balancer import Balancer, BalancerConfig

    assert BalancerConfig().compression is None
    model = torch.nn.Sequential(MoE(MoEConfig(8, 16, 4, 2)))
    balancer = Balancer(model, torch.optim.AdamW(model.parameters()), "static")
    assert balancer.moves.compression is None
    balancer.close()
    with pytest.raises(ConfigError, match=r"compression\.ratio"):
        Balancer(model, torch.optim.AdamW(model.parameters()), "static", 10,
                 BalancerConfig(compression=2.0))  # fmt: skip


# ----------------------------------------------------------------- compressed Trans, 2 ranks
E, S, SHAPES = 4, 4, [(6, 10), (6, 10), (10, 6)]
RATIOS = (1.0, 0.5, 0.1, 0.02)


def _maps():
    from poise.core.placement import Placement
    from poise.nn.slots import slot_maps

    placement = Placement.from_homes(np.array([[0, 0, 1, 1]]), 2, S)
    placement.copies[0, 0, [2, 3]] = 1  # rank 0 holds replicas of experts 2 and 3
    placement.copies[0, 1, 0] = 1  # rank 1 of expert 0
    return slot_maps(placement, 0, S)


def _weights(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(S, *shape, generator=g) for shape in SHAPES]


def _compressed_trans(rank: int, W: int) -> dict:
    from poise.runtime.moves import transfers as tr
    from poise.runtime.moves.compressed_trans import trans_compressed

    maps = _maps()
    out: dict = {"before": [w.numpy().copy() for w in _weights(rank)]}
    plain = _weights(rank)
    done = tr.trans(plain, maps, rank)
    out["plain"] = ([w.numpy() for w in plain], done.total_bytes)
    for ratio in RATIOS:
        ws = _weights(rank)
        pending = trans_compressed(ws, maps, rank, ratio)
        out[ratio] = (
            [w.numpy() for w in ws],
            pending.payload_bytes,
            pending.shared_bytes,
            pending.dense_bytes,
            pending.total_bytes,
        )
        out[f"shared{ratio}"] = [t.numpy() for t in pending.shared]
    # A shared expert passed in is used as it is: no all-reduce, the same rows.
    ws = _weights(rank)
    again = trans_compressed(ws, maps, rank, 0.1, shared=[t.clone() for t in pending.shared])
    out["reused"] = ([w.numpy() for w in ws], again.shared_bytes, again.total_bytes)
    return out


@pytest.mark.dist
def test_compressed_trans_fills_replicas_with_shared_plus_sparse_residual() -> None:
    results = run_ranks(_compressed_trans, 2)
    maps = _maps()
    row_bytes = sum(a * b for a, b in SHAPES) * 4
    replicas = 3
    # The shared expert as every rank computes it: each rank's home rows summed, the two sums
    # added (all-reduce), divided by E.
    shared = []
    for k in range(3):
        sums = []
        for rank in range(2):
            home = np.flatnonzero(maps[rank].home & (maps[rank].expert >= 0))
            rows = torch.tensor(results[rank]["before"][k])
            sums.append(rows.index_select(0, torch.as_tensor(home)).sum(dim=0))
        shared.append((sums[0] + sums[1]) / E)
    homes = {
        int(e): (r, s) for r, m in enumerate(maps) for s, e in enumerate(m.expert) if m.home[s]
    }
    for ratio in RATIOS:
        for rank, res in enumerate(results):
            got, payload, shared_bytes, dense, total = res[ratio]
            if ratio in (1.0, 0.5):  # dense rows: exactly the plain Trans
                for a, b in zip(got, res["plain"][0], strict=True):
                    np.testing.assert_array_equal(a, b)
            m = maps[rank]
            for slot, e in enumerate(m.expert):
                for k in range(3):
                    if e < 0 or m.home[slot]:  # homes and empty slots untouched
                        np.testing.assert_array_equal(got[k][slot], res["before"][k][slot])
                        continue
                    hr, hs = homes[int(e)]
                    home_row = torch.tensor(results[hr]["before"][k][hs])[None]
                    want = cz.roundtrip(home_row, shared[k], ratio)[0].numpy()
                    np.testing.assert_allclose(got[k][slot], want, rtol=1e-6, atol=1e-6)
                    if ratio < 0.5:
                        assert not np.allclose(got[k][slot], home_row[0].numpy())
            wire = sum(cz.row_wire_bytes(a * b, ratio, torch.float32) for a, b in SHAPES)
            assert payload == replicas * wire
            assert dense == replicas * row_bytes == res["plain"][1]
            assert shared_bytes == 2 * (2 - 1) * row_bytes  # ring all-reduce: 2 (W - 1) rows
            assert total == payload + shared_bytes
            for k in range(3):  # every rank decoded against the same shared expert
                np.testing.assert_array_equal(res[f"shared{ratio}"][k], shared[k].numpy())
    for res in results:
        rows, shared_bytes, total = res["reused"]
        assert shared_bytes == 0 and total == res[0.1][1]
        for a, b in zip(rows, res[0.1][0], strict=True):
            np.testing.assert_array_equal(a, b)
