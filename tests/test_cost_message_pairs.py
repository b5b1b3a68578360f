"""`cost.message_pairs`: a search candidate's messages from per-pair multiplicities equal a recount
of its whole layer (`ExpertColumns.layer_messages`, the counts `CostModel.price` uses), for the
layers in force, for candidates that move homes, add and drop copies, and after `apply`; on
clusters past `DIRECT_RUN` devices the recount is used."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest

from poise.core.presets import get_cluster
from poise.core.spec import MODELS
from poise.cost.expert_columns import TERMS, ExpertColumns
from poise.cost.message_pairs import MessagePairs, applies
from poise.cost.messages import DIRECT_RUN
from poise.cost.model import CostModel
from poise.cost.schedule import Schedule

from .helpers import toy_cluster


def _layers(cluster, layers: int, experts: int, seed: int, prev: bool) -> ExpertColumns:
    """Random layers with replicas, shares on the holders and (if `prev`) moved homes."""
    rng = np.random.default_rng(seed)
    D = cluster.num_devices
    home = np.stack([rng.integers(0, D, experts) for _ in range(layers)])  # [L, E]
    copies = np.zeros((layers, D, experts), dtype=np.int64)
    copies[np.arange(layers)[:, None], home, np.arange(experts)[None, :]] = 1
    extra = rng.random((layers, D, experts)) < 2.0 / D
    copies[extra] = 1
    counts = rng.poisson(3.0, (layers, D, experts)).astype(np.float64)
    counts[rng.random(counts.shape) < 0.3] = 0
    weights = copies.transpose(0, 2, 1) * rng.random((layers, experts, D))
    weights /= weights.sum(axis=2, keepdims=True)
    prev_home = None
    if prev:
        prev_home = home.copy()
        moved = rng.random(home.shape) < 0.2
        prev_home[moved] = rng.integers(0, D, moved.sum())
    spec = MODELS["zipf-256"].with_(experts=experts, moe_layers=layers)
    cost = CostModel(cluster, spec, Schedule("sync"))
    return ExpertColumns(cost, counts, home, copies, weights, prev_home)


def _recount(cols: ExpertColumns, layers: np.ndarray) -> np.ndarray:
    return cols.layer_messages(
        layers, cols.home[layers], cols.copies_t[layers] > 0, cols.weights[layers] > 0
    )


CLUSTERS = [toy_cluster(2, 2, 2), get_cluster("dgx-h100:4")]


@pytest.mark.parametrize("cluster", CLUSTERS, ids=["toy-3-levels", "dgx-h100:4"])
@pytest.mark.parametrize("prev", [True, False], ids=["migrations", "no-previous-homes"])
def test_pairs_count_the_messages_of_a_layer_recount(cluster, prev: bool) -> None:
    L, E = 3, 24
    cols = _layers(cluster, L, E, seed=1, prev=prev)
    assert cols.pairs is not None
    layers = np.arange(L)
    np.testing.assert_array_equal(cols.totals[:, TERMS:], _recount(cols, layers))
    assert cols.totals[:, TERMS:].sum() > 0

    # Candidates: in each layer, two experts change (a home move, a copy gained, one lost).
    rng = np.random.default_rng(2)
    D = cluster.num_devices
    for _ in range(5):
        experts = np.stack([rng.choice(E, 2, replace=False) for _ in range(L)])  # [B, K]
        new_home = rng.integers(0, D, (L, 2))
        new_copies = (rng.random((L, 2, D)) < 3.0 / D).astype(np.int64)
        new_copies[np.arange(L)[:, None], np.arange(2)[None, :], new_home] = 1
        shares = new_copies * rng.random((L, 2, D))
        shares /= shares.sum(axis=2, keepdims=True)
        select = np.array([[1, 0], [0, 1], [1, 1]], dtype=bool)
        valid = np.array([[True, True, False]] * L)
        got = cols.candidate_messages(layers, experts, new_home, new_copies, shares, select, valid)
        assert (got[:, 2] == 0).all()  # not valid: left zero
        for m in range(2):
            for b in range(L):
                h = cols.home[b].copy()
                held = cols.copies_t[b] > 0
                takes = cols.weights[b] > 0
                for k in np.flatnonzero(select[m]):
                    e = experts[b, k]
                    h[e], held[e], takes[e] = new_home[b, k], new_copies[b, k] > 0, shares[b, k] > 0
                want = cols.layer_messages(np.array([b]), h[None], held[None], takes[None])[0]
                np.testing.assert_array_equal(got[b, m], want)
        # Make candidate 2 (both columns) current in layer 0 and 2; the pairs follow, recounted
        # from the columns (`cols`) or adopted from the candidates just counted (`twin`).
        twin = copy.deepcopy(cols)
        both = np.array([0, 2])
        twin.apply(
            np.repeat(both, 2),
            experts[both].reshape(-1),
            new_home[both].reshape(-1),
            new_copies[both].reshape(-1, D),
            shares[both].reshape(-1, D),
            both,
            twin.totals[both],
            candidate=(both, np.array([2, 2])),  # (counted though not valid: left zero)
        )
        for b in (0, 2):
            cols.apply(
                np.array([b, b]),
                experts[b],
                new_home[b],
                new_copies[b],
                shares[b],
                np.array([b]),
                cols.totals[b][None],
            )
        np.testing.assert_array_equal(cols.pairs.rows(cols.pairs.n), _recount(cols, layers))
        np.testing.assert_array_equal(twin.pairs.n, cols.pairs.n)
        np.testing.assert_array_equal(twin.pairs.rows(twin.pairs.n), _recount(twin, layers))
        # The rows in force, from which the next candidates are counted, follow too.
        np.testing.assert_array_equal(cols.pairs.rows_now, _recount(cols, layers))
        np.testing.assert_array_equal(twin.pairs.rows_now, _recount(twin, layers))


def test_a_cluster_past_the_direct_run_recounts() -> None:
    cluster = toy_cluster(devices_per_node=8, nodes=DIRECT_RUN // 8 + 1)
    assert not applies(cluster) and applies(get_cluster("dgx-h100:4"))
    cols = _layers(cluster, 1, 8, seed=3, prev=True)
    assert cols.pairs is None
    np.testing.assert_array_equal(cols.totals[:, TERMS:], _recount(cols, np.arange(1)))


def test_multiplicities_by_hand() -> None:
    # 4 devices in 2 nodes, 2 experts. Expert 0: home 0, replica on 2; expert 1: home 3, moved
    # there from 1. Device 1 sends tokens of both (holds neither), device 2 of expert 1 only.
    # Shares: expert 0 taken by 0 and 2, expert 1 by 3.
    cluster = toy_cluster(devices_per_node=2, nodes=2)
    go = np.zeros((1, 4, 2), dtype=bool)
    go[0, 1] = [True, True]
    go[0, 2, 1] = True
    held = np.zeros((1, 2, 4), dtype=bool)
    held[0, 0, [0, 2]] = True
    held[0, 1, 3] = True
    takes = held.copy()
    pairs = MessagePairs(cluster, go, np.array([[0, 3]]), held, takes, np.array([[0, 1]]))
    n = pairs.n[0]
    want_dispatch = np.zeros((4, 4), dtype=np.int32)
    want_dispatch[1, [0, 2]] = 1  # 1 -> holders of expert 0
    want_dispatch[1, 3] += 1  # 1 -> holder of expert 1
    want_dispatch[2, 3] = 1  # 2 -> holder of expert 1 (2 holds expert 0, so sends none of it)
    np.testing.assert_array_equal(n[0], want_dispatch)
    assert n[1, 0, 2] == 1 and n[1].sum() == 1  # Trans: home 0 -> replica 2
    assert n[2, 1, 3] == 1 and n[2].sum() == 1  # migration: 1 -> 3
    rows = pairs.rows(pairs.n)[0]  # [18, D]: out (kind, level), then into
    # Device 1 sends dispatch messages to 0 (level 0, same node) and to 2, 3 (level 1).
    assert rows[0, 1] == 1 and rows[1, 1] == 2
    # Device 3 receives dispatch messages from 1 and 2: 2 is in its node, 1 is not.
    assert rows[9, 3] == 1 and rows[10, 3] == 1


def test_the_kernels_are_compiled_when_imported() -> None:
    # The simulator delays a background plan by its CPU time: a compile inside the first plan
    # (seconds) would put that plan in force steps late. A fresh process, before any call:
    code = "import poise.cost.pair_kernels as k; assert k.candidate_rows.overloads, 'rows'; "
    code += "assert k.adopt.overloads, 'adopt'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
