"""Megatron-Core router traces (`poise.trace.megatron`, the format of megatron-core 0.19.2's
`router_trace.py`): read into a `Trace`, written back, read again."""

from __future__ import annotations

import json

import numpy as np
import pytest

from poise.core.errors import TraceError
from poise.trace.importers import detect_format, load_any
from poise.trace.megatron import MegatronTraceWriter, import_megatron

# Two ranks, MoE decoder layers 1 and 3 (layer 0 dense), top-2 of 4 experts, steps 0 and 1;
# an MTP record (ignored) and sidecar fields (ignored), as Megatron-Core writes them.
RANK0 = [
    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 0,
     "num_tokens": 3, "topk": 2, "top_indices": [[0, 1], [0, 2], [3, 0]]},
    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 3, "topk": 2, "top_indices": [[1, 2], [1, 3], [2, 1]], "hs_offset": 0},
    {"step": 0, "stage": "pre_dispatch", "block": "mtp", "mtp_idx": 0, "layer": 1, "rank": 0,
     "num_tokens": 1, "topk": 2, "top_indices": [[3, 2]]},
    {"step": 1, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 0,
     "num_tokens": 2, "topk": 2, "top_indices": [[2, 3], [3, 2]]},
    {"step": 1, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 2, "topk": 2, "top_indices": [[0, 1], [0, 1]]},
]  # fmt: skip


def _write(folder, records_by_rank):
    folder.mkdir(parents=True, exist_ok=True)
    for rank, recs in records_by_rank.items():
        text = "".join(json.dumps(r) + "\n" for r in recs)
        (folder / f"router_trace_rank{rank}.jsonl").write_text(text)


def _rank1():
    out = []
    for r in RANK0:
        if r["block"] != "decoder":
            continue
        r = dict(r, rank=1, top_indices=[[3 - e for e in row] for row in r["top_indices"]])
        out.append(r)
    return out


def test_reads_megatron_core_router_traces(tmp_path):
    folder = tmp_path / "trace"
    _write(folder, {0: RANK0, 1: _rank1()})
    assert detect_format(folder) == "megatron"
    trace = load_any(folder)
    assert trace.counts.shape == (2, 2, 2, 4)  # [steps, MoE layers, ranks, experts]
    assert trace.top_k == 2 and trace.step_ids.tolist() == [0, 1]
    assert trace.meta["layers"] == [1, 3] and trace.meta["ranks"] == [0, 1]
    assert trace.counts[0, 0, 0].tolist() == [3, 1, 1, 1]  # layer 1, rank 0, step 0
    assert trace.counts[0, 1, 0].tolist() == [0, 3, 2, 1]
    assert trace.counts[0, 0, 1].tolist() == [1, 1, 1, 3]  # rank 1 chose 3 - e
    assert trace.counts[1, 1, 0].tolist() == [2, 2, 0, 0]
    assert trace.tokens_per_device == 3
    assert import_megatron(folder, experts=6).experts == 6


def test_round_trip_through_the_writer(tmp_path):
    """Poise writes what it reads: counts survive write -> read, and a resumed writer drops
    the steps after its start."""
    src = tmp_path / "in"
    _write(src, {0: RANK0, 1: _rank1()})
    first = import_megatron(src)
    out = tmp_path / "out"
    rng = np.random.default_rng(0)
    for rank in (0, 1):
        w = MegatronTraceWriter(out, rank)
        for s, step in enumerate(first.step_ids):
            for li, layer in enumerate(first.meta["layers"]):
                c = first.counts[s, li, rank]  # rebuild per-token choices with these counts
                idx = np.repeat(np.arange(4), c)
                rows = idx.reshape(2, -1).T if idx.size % 2 == 0 else None
                assert rows is not None
                rows = rows[rng.permutation(len(rows))]
                w.record(int(step), int(layer), rows)
            w.flush()
        w.close()
    again = import_megatron(out)
    np.testing.assert_array_equal(again.counts, first.counts)
    assert again.meta["layers"] == [1, 3]
    line = json.loads((out / "router_trace_rank0.jsonl").read_text().splitlines()[0])
    assert set(line) == {"step", "stage", "block", "layer", "rank", "num_tokens", "topk",
                         "top_indices"}  # fmt: skip
    MegatronTraceWriter(out, 0, start=1).close()  # resuming at step 1 keeps step 0 only
    lines = (out / "router_trace_rank0.jsonl").read_text().splitlines()
    kept = [json.loads(x)["step"] for x in lines]
    assert set(kept) == {0}


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "line 1"),
        ('{"step": 0, "layer": 1, "rank": 0, "topk": 2, "top_indices": [[1]]}', "top_indices"),
        ('{"step": -1, "layer": 1, "rank": 0, "topk": 2, "top_indices": [[1, 0]]}', "step"),
        ('{"step": 0, "layer": 1, "rank": 0, "topk": 2, "num_tokens": 5, '
         '"top_indices": [[1, 0]]}', "num_tokens"),
    ],
)  # fmt: skip
def test_bad_records_name_the_file_and_line(tmp_path, line, field):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "router_trace_rank0.jsonl").write_text(line + "\n")
    with pytest.raises(TraceError, match=r"router_trace_rank0\.jsonl") as e:
        import_megatron(folder)
    assert field in str(e.value)
