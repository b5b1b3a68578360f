"""Trans, Agg and migration on 2 and 4 gloo ranks against a one-process reference.

Each spawn runs many random cases (random homes, replicas and slot orders; random weights,
gradients and AdamW moments): every rank builds the same global case from the same seed, runs
the collective on its own part and returns before/after; the parent checks against the
reference computed from all ranks' before-values."""

from __future__ import annotations

import numpy as np
import pytest

from poise.core.placement import Placement, transfers_between
from poise.core.spec import ModelSpec
from poise.nn.slots import SlotMap, slot_maps
from poise.runtime.launch import run_ranks
from poise.runtime.moves.exchange import (
    Routes,
    TransferError,
    agg_routes,
    home_slots,
    migration_routes,
    trans_routes,
)

D_MODEL, D_EXPERT = 3, 5
SHAPES = [(D_MODEL, D_EXPERT), (D_MODEL, D_EXPERT), (D_EXPERT, D_MODEL)]  # w_in, w_gate, w_out
ROW_BYTES = sum(a * b for a, b in SHAPES) * 4
CASES = 12


def random_placement(rng: np.random.Generator, W: int, E: int, S: int) -> Placement:
    """Homes spread at random within the slot budget, then random replicas in the free slots."""
    capacity = np.repeat(np.arange(W), S)
    home = rng.permutation(capacity)[:E]
    placement = Placement.from_homes(home[None, :], W, S)
    for rank in range(W):
        free = S - int(placement.copies[0, rank].sum())
        others = np.nonzero(placement.copies[0, rank] == 0)[0]
        extra = rng.permutation(others)[: rng.integers(0, min(free, others.size) + 1)]
        placement.copies[0, rank, extra] = 1
    placement.validate()
    return placement


def make_case(seed: int, W: int) -> dict:
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 3 * W + 1))
    S = -(-E // W) + int(rng.integers(0, 3))
    old = random_placement(rng, W, E, S)
    new = old.copy() if seed % 5 == 0 else random_placement(rng, W, E, S)

    def tensors() -> list[list[np.ndarray]]:
        return [[rng.standard_normal((S, *shape)).astype(np.float32) for shape in SHAPES]]

    return {
        "E": E,
        "S": S,
        "old": old,
        "new": new,
        "weights": [tensors()[0] for _ in range(W)],
        "grads": [tensors()[0] for _ in range(W)],
        "grads2": [tensors()[0] for _ in range(W)],
        "step_grads": [tensors()[0] for _ in range(W)],
    }


def _rank_cases(rank: int, W: int, seeds: list[int], shared: bool = False) -> list[dict]:
    import torch

    from poise.runtime.moves import transfers as tr
    from poise.runtime.moves.exchange import Scratch
    from poise.runtime.moves.host_link import HostLink

    link = HostLink.connect() if shared else None
    assert (link is not None) == shared

    def channel(key: str):
        return None if link is None else link.channel(key)

    scratch = Scratch()  # one for every case: reused at other sizes, stale rows left in it
    out = []
    for seed in seeds:
        case = make_case(seed, W)
        old_maps = slot_maps(case["old"], 0, case["S"])
        new_maps = slot_maps(case["new"], 0, case["S"])
        res: dict = {}
        # Trans, async, with a second layer's Trans in flight at the same time.
        w = [torch.tensor(x) for x in case["weights"][rank]]
        w2 = [t.clone() * 2 for t in w]
        p1 = tr.trans_async(w, old_maps, rank, link=channel("trans-1"))
        p2 = tr.trans_async(w2, old_maps, rank, link=channel("trans-2"))
        p2.wait()
        p1.wait()
        res["trans"] = [t.numpy() for t in w]
        res["trans2"] = [t.numpy() for t in w2]
        res["trans_bytes"] = (p1.sent_bytes, p1.received_bytes, p1.total_bytes)
        # Agg over two micro-batches, the second accumulated while the first is in flight.
        g = [torch.tensor(x) for x in case["grads"][rank]]
        a1 = tr.agg_async(g, old_maps, rank, link=channel("agg"))
        for t, x in zip(g, case["grads2"][rank], strict=True):
            t += torch.tensor(x)
        a2 = tr.agg_async(g, old_maps, rank, link=channel("agg"))  # a1 not yet read
        a1.wait()
        a2.wait()
        res["agg"] = [t.numpy() for t in g]
        res["agg_bytes"] = (a1.sent_bytes, a1.total_bytes)
        # Migration with AdamW state after one step.
        params = [torch.nn.Parameter(torch.tensor(x)) for x in case["weights"][rank]]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
        for p, x in zip(params, case["step_grads"][rank], strict=True):
            p.grad = torch.tensor(x)
        opt.step()
        res["before"] = _snapshot(params, opt)
        mig = tr.migrate(params, opt, old_maps, new_maps, rank, link=channel("migrate"))
        res["after"] = _snapshot(params, opt)
        res["migration"] = mig
        if link is not None:  # the same migration over the link's cap: through the group
            params = [torch.nn.Parameter(torch.tensor(x)) for x in case["weights"][rank]]
            opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
            for p, x in zip(params, case["step_grads"][rank], strict=True):
                p.grad = torch.tensor(x)
            opt.step()
            capped = channel("capped")
            tr.migrate(params, opt, old_maps, new_maps, rank, link=capped, link_max_bytes=0)
            res["after_capped"] = _snapshot(params, opt)
            res["capped_turns"] = capped.turns
        else:  # the same migration through reused buffers (`Scratch`)
            params = [torch.nn.Parameter(torch.tensor(x)) for x in case["weights"][rank]]
            opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
            for p, x in zip(params, case["step_grads"][rank], strict=True):
                p.grad = torch.tensor(x)
            opt.step()
            tr.migrate(params, opt, old_maps, new_maps, rank, scratch=scratch)
            res["after_scratch"] = _snapshot(params, opt)
            res["scratch_bytes"] = scratch.nbytes
        out.append(res)
    return out


def _snapshot(params, opt) -> dict:
    return {
        "w": [p.detach().numpy().copy() for p in params],
        "m": [opt.state[p]["exp_avg"].numpy().copy() for p in params],
        "v": [opt.state[p]["exp_avg_sq"].numpy().copy() for p in params],
        "step": [float(opt.state[p]["step"]) for p in params],
    }


def _homes(maps: list[SlotMap]) -> dict[int, tuple[int, int]]:
    return {int(e): (r, s) for r, m in enumerate(maps) for s, e in enumerate(m.expert) if m.home[s]}


def _check_case(seed: int, W: int, results: list[dict]) -> None:
    case = make_case(seed, W)
    S = case["S"]
    old_maps = slot_maps(case["old"], 0, S)
    new_maps = slot_maps(case["new"], 0, S)
    homes = _homes(old_maps)
    n_replicas = int(case["old"].replicas().sum())
    spec = ModelSpec(
        "t", D_MODEL, D_EXPERT, case["E"], 1, 1, dtype_bytes=4, activation="swiglu",
        optimizer_bytes_per_param=8.0,
    )  # fmt: skip
    expected_trans = transfers_between(None, case["old"], spec).trans_bytes[0]
    for rank, res in enumerate(results):
        m = old_maps[rank]
        for k in range(3):
            w = case["weights"]
            want = w[rank][k].copy()
            want_agg = case["grads"][rank][k] + case["grads2"][rank][k]
            for slot, e in enumerate(m.expert):
                if e < 0:
                    continue
                hr, hs = homes[int(e)]
                if not m.home[slot]:
                    want[slot] = w[hr][k][hs]
                    want_agg[slot] = 0.0
                    continue
                for r2, m2 in enumerate(old_maps):  # replicas of e, ascending rank
                    for s2 in np.nonzero((m2.expert == e) & ~m2.home)[0]:
                        want_agg[slot] += case["grads"][r2][k][s2] + case["grads2"][r2][k][s2]
            np.testing.assert_array_equal(res["trans"][k], want)
            np.testing.assert_array_equal(res["trans2"][k], 2 * want)
            np.testing.assert_allclose(res["agg"][k], want_agg, rtol=1e-6, atol=1e-6)
        assert res["trans_bytes"][2] == n_replicas * ROW_BYTES == expected_trans
        _check_migration(rank, new_maps, homes, results, S)
    assert sum(r["trans_bytes"][0] for r in results) == n_replicas * ROW_BYTES
    assert sum(r["trans_bytes"][1] for r in results) == n_replicas * ROW_BYTES
    assert sum(r["agg_bytes"][0] for r in results) == results[0]["agg_bytes"][1]
    moved = int((case["old"].home != case["new"].home).sum())
    mig = [r["migration"] for r in results]
    assert mig[0].moved_homes == moved
    for rank, (old, new) in enumerate(zip(old_maps, new_maps, strict=True)):
        # Only a home that keeps its expert and slot is left alone; every other row is rewritten.
        kept = sum(
            bool(old.home[s] and new.home[s] and old.expert[s] == new.expert[s]) for s in range(S)
        )
        assert mig[rank].relaid_rows == S - kept
        assert mig[rank].relaid_bytes == (S - kept) * 3 * ROW_BYTES  # weights, exp_avg, exp_avg_sq
    assert sum(x.home_bytes for x in mig) == mig[0].home_total_bytes
    assert (
        mig[0].home_total_bytes
        == transfers_between(case["old"], case["new"], spec).migrate_bytes[0]
    )


def _check_migration(rank: int, new_maps, old_homes, results, S: int) -> None:
    after = results[rank]["after"]
    m = new_maps[rank]
    for k in range(3):
        for slot in range(S):
            e = int(m.expert[slot])
            if e < 0:
                for key in ("w", "m", "v"):
                    assert not after[key][k][slot].any()
                continue
            hr, hs = old_homes[e]
            before = results[hr]["before"]
            np.testing.assert_array_equal(after["w"][k][slot], before["w"][k][hs])
            for key in ("m", "v"):
                want = before[key][k][hs] if m.home[slot] else 0.0 * before[key][k][hs]
                np.testing.assert_array_equal(after[key][k][slot], want)
        assert after["step"] == results[rank]["before"]["step"]


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("shared", [False, True], ids=["gloo", "shared-memory"])
def test_trans_agg_migrate_match_the_reference(world_size: int, shared: bool) -> None:
    """Through gloo's all-to-all, and with Trans, Agg and migration through shared memory
    (`HostLink`): two Trans in flight on two channels, a second Agg started on the channel of an
    unread one, the migration's homes with their moments and its replicas in one turn."""
    seeds = list(range(100 * world_size, 100 * world_size + CASES))
    results = run_ranks(_rank_cases, world_size, seeds, shared)
    for i, seed in enumerate(seeds):
        _check_case(seed, world_size, [results[r][i] for r in range(world_size)])
    every = [results[r][i] for r in range(world_size) for i in range(len(seeds))]
    if shared:  # over the cap the rows went through the group, to the same result
        for res in every:
            assert res["capped_turns"] == 0
            for key in ("w", "m", "v"):
                for got, want in zip(res["after_capped"][key], res["after"][key], strict=True):
                    np.testing.assert_array_equal(got, want)
    else:  # through buffers kept from case to case, to the same result
        assert max(res["scratch_bytes"] for res in every) > 0
        for res in every:
            for key in ("w", "m", "v"):
                for got, want in zip(res["after_scratch"][key], res["after"][key], strict=True):
                    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ routes (no process group)
def _maps(home: list[int], W: int, S: int, replicas: dict[int, list[int]] | None = None):
    placement = Placement.from_homes(np.array([home]), W, S)
    for rank, experts in (replicas or {}).items():
        placement.copies[0, rank, experts] = 1
    return slot_maps(placement, 0, S)


def test_trans_routes_go_from_home_to_each_replica() -> None:
    maps = _maps([0, 0, 1, 1], W=2, S=3, replicas={1: [0], 0: [3]})
    r = trans_routes(maps)
    rows = list(zip(r.src_rank, r.src_slot, r.dst_rank, r.dst_slot, strict=True))
    assert rows == [(0, 0, 1, 2), (1, 1, 0, 2)]
    back = agg_routes(maps)
    assert list(zip(back.src_rank, back.dst_rank, strict=True)) == [(0, 1), (1, 0)]
    assert r.remote_rows() == 2


def test_migration_routes_split_homes_and_replicas() -> None:
    old = _maps([0, 0, 1, 1], W=2, S=3)
    new = _maps([1, 0, 0, 1], W=2, S=3, replicas={0: [3]})
    homes, replicas = migration_routes(old, new)
    assert homes.remote_rows() == 2  # experts 0 and 2 changed rank
    assert len(homes) == 4 and len(replicas) == 1
    assert (replicas.src_rank[0], replicas.src_slot[0]) == (1, 1)  # expert 3 from its home


def test_maps_without_a_home_are_refused() -> None:
    bad = SlotMap(expert=np.array([0, 1]), home=np.array([True, False]))
    with pytest.raises(TransferError, match="no home"):
        home_slots([bad])
    assert len(Routes.build([])) == 0
