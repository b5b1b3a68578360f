"""Compiled loops (Numba) for `cost.message_pairs`: the message rows of a search's candidates
from the pair multiplicities in force and the few cells each candidate changes.

A candidate changes one or two expert columns of its layer. With s = sends(c) & ~held (the
devices sending the expert's tokens) and t = shares > 0 (its takers), the dispatch kind's
multiplicities change by

    delta[i, j] = s'[i] t'[j] - s[i] t[j]

which is zero unless s[i] or t[j] changed: only the rows where s changed and the columns where t
changed are visited (about 2 D cells for an expand, not D^2). Trans changes the home's row (+1
per replica of the new column, -1 per replica of the old), migration one cell per side ((previous
home, home) where they differ). A pair's message appears or disappears only where its
multiplicity crosses zero, so a candidate's rows are the rows in force plus, per changed cell
(i, j) at level v = `level[i, j]`, the flip [n + delta > 0] - [n > 0] added to out[kind, v, i]
and into[kind, v, j]. The counts are integers: the result equals a recount bit for bit.

Rows are `[18, D]` per layer (`message_pairs.MessagePairs.rows`): peers sent to, kind-major
(dispatch, Trans, migration) then level, then peers received from likewise.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

_KIND_ROWS = 3  # rows per kind: the three link levels
_INTO = 9  # first row of the peers received from


def _array(dtype: types.Type, ndim: int, readonly: bool = False) -> types.Array:
    return types.Array(dtype, ndim, "A", readonly=readonly)


_I8, _F8, _B1 = types.int64, types.float64, types.boolean
# The arguments shared by `candidate_rows` and `adopt`: n, level, rows_now, layers, experts,
# new_home, new_copies, new_weights, home, copies_t, weights, go_t, prev_home, select. Typed
# up front: the kernels are compiled (or loaded from Numba's cache) when this module is
# imported, never inside a timed plan.
_SHARED = (
    _array(types.float32, 4), _array(_I8, 2, readonly=True), _array(_F8, 3), _array(_I8, 1),
    _array(_I8, 2), _array(_I8, 2), _array(_I8, 3), _array(_F8, 3), _array(_I8, 2),
    _array(_I8, 3), _array(_F8, 3), _array(_B1, 3), _array(_I8, 2), _array(_B1, 2),
)  # fmt: skip
_CANDIDATE_ROWS = types.void(*_SHARED, _array(_B1, 2), _array(_F8, 4))
_ADOPT = types.void(*_SHARED, _array(_I8, 1), _array(_I8, 1))


@njit(cache=True, nogil=True, inline="always")
def _touch(delta, mark, cells, count, stamp, kind, i, j, d):  # type: ignore[no-untyped-def]
    """Add `d` to `delta[kind, i, j]`, listing the cell in `cells[count]` on its first touch
    by candidate `stamp`; returns the new count."""
    if mark[kind, i, j] != stamp:
        mark[kind, i, j] = stamp
        delta[kind, i, j] = d
        cells[count, 0] = kind
        cells[count, 1] = i
        cells[count, 2] = j
        return count + 1
    delta[kind, i, j] += d
    return count


@njit(cache=True, nogil=True)
def _column(  # type: ignore[no-untyped-def]
    delta,
    mark,
    cells,
    count,
    stamp,
    go,
    held_new,
    takes_new,
    home_new,
    held_now,
    takes_now,
    home_now,
    prev,
    s_changed,
):
    """Add one expert column's change (now -> new) to the candidate's cell deltas; `go[D]`
    its load cells worth a message, `held_*[D]`, `takes_*[D]` bool, `prev` its previous home
    (-1: none, nothing migrates). `s_changed[D]` is scratch."""
    D = go.shape[0]
    for i in range(D):  # rows whose sending changed: every column may change there
        s1 = go[i] and not held_new[i]
        s0 = go[i] and not held_now[i]
        s_changed[i] = s1 != s0
        if s1 != s0:
            for j in range(D):
                d = (1 if s1 and takes_new[j] else 0) - (1 if s0 and takes_now[j] else 0)
                if d != 0:
                    count = _touch(delta, mark, cells, count, stamp, 0, i, j, d)
    for j in range(D):  # columns whose taking changed, on the rows not visited above
        if takes_new[j] != takes_now[j]:
            d = 1 if takes_new[j] else -1
            for i in range(D):
                if not s_changed[i] and go[i] and not held_now[i]:
                    count = _touch(delta, mark, cells, count, stamp, 0, i, j, d)
    for j in range(D):  # Trans: home -> each replica
        if held_new[j] and j != home_new:
            count = _touch(delta, mark, cells, count, stamp, 1, home_new, j, 1)
        if held_now[j] and j != home_now:
            count = _touch(delta, mark, cells, count, stamp, 1, home_now, j, -1)
    if prev >= 0:  # migration: previous home -> home
        if prev != home_new:
            count = _touch(delta, mark, cells, count, stamp, 2, prev, home_new, 1)
        if prev != home_now:
            count = _touch(delta, mark, cells, count, stamp, 2, prev, home_now, -1)
    return count


@njit(cache=True, nogil=True)
def _candidate_cells(  # type: ignore[no-untyped-def]
    delta,
    mark,
    cells,
    stamp,
    scratch,
    b,
    m,
    layer,
    experts,
    new_home,
    new_copies,
    new_weights,
    home,
    copies_t,
    weights,
    go_t,
    prev_home,
    select,
):
    """The cells candidate m of batch row b changes (`cells[:count]`, deltas in `delta`)."""
    count = 0
    D = go_t.shape[2]
    held_new, takes_new, held_now, takes_now, s_changed = scratch
    for k in range(select.shape[1]):
        if not select[m, k]:
            continue
        e = experts[b, k]
        for d in range(D):
            held_new[d] = new_copies[b, k, d] > 0
            takes_new[d] = new_weights[b, k, d] > 0
            held_now[d] = copies_t[layer, e, d] > 0
            takes_now[d] = weights[layer, e, d] > 0
        count = _column(
            delta,
            mark,
            cells,
            count,
            stamp,
            go_t[layer, e],
            held_new,
            takes_new,
            new_home[b, k],
            held_now,
            takes_now,
            home[layer, e],
            prev_home[layer, e],
            s_changed,
        )
    return count


@njit(cache=True, nogil=True)
def _add_flips(rows, n_layer, level, delta, cells, count):  # type: ignore[no-untyped-def]
    """Add to `rows[18, D]` the messages the listed cells' deltas make appear (+1) or go (-1)
    over the layer's multiplicities `n_layer[kinds, D, D]`."""
    for c in range(count):
        kind, i, j = cells[c, 0], cells[c, 1], cells[c, 2]
        v = level[i, j]
        if v < 0:  # a device's pair with itself: no message
            continue
        old = n_layer[kind, i, j]
        flip = (1 if old + delta[kind, i, j] > 0 else 0) - (1 if old > 0 else 0)
        if flip != 0:
            rows[kind * _KIND_ROWS + v, i] += flip
            rows[_INTO + kind * _KIND_ROWS + v, j] += flip


@njit(cache=True, nogil=True)
def _work(kinds, D):  # type: ignore[no-untyped-def]
    """A kernel's scratch: cell deltas and their candidate stamps `[kinds, D, D]`, the listed
    cells `[kinds D^2, 3]` (kind, i, j) and five `[D]` bool columns."""
    scratch = (
        np.empty(D, np.bool_), np.empty(D, np.bool_), np.empty(D, np.bool_),
        np.empty(D, np.bool_), np.empty(D, np.bool_),
    )  # fmt: skip
    delta = np.zeros((kinds, D, D), np.int64)
    mark = np.zeros((kinds, D, D), np.int64)
    return delta, mark, np.empty((kinds * D * D, 3), np.int64), scratch


@njit(_CANDIDATE_ROWS, cache=True, nogil=True)
def candidate_rows(  # type: ignore[no-untyped-def]
    n,
    level,
    rows_now,
    layers,
    experts,
    new_home,
    new_copies,
    new_weights,
    home,
    copies_t,
    weights,
    go_t,
    prev_home,
    select,
    valid,
    out,
):
    """Message rows `out[B, M, 18, D]` of candidate m of batch row b (layer `layers[b]`): the
    columns `experts[b, k]` with `select[m, k]` take `new_home[B, K]`, `new_copies[B, K, D]`,
    `new_weights[B, K, D]` in place of the columns in force (`home[L, E]`, `copies_t[L, E, D]`,
    `weights[L, E, D]`); `n[L, kinds, D, D]` and `rows_now[L, 18, D]` are the layers'
    multiplicities and rows in force, `go_t[L, E, D]` the load cells worth a message,
    `prev_home[L, E]` the previous homes (-1: none), `level[D, D]` the pairs'
    link levels (-1 on the diagonal). Zero where not `valid[B, M]`."""
    B = layers.shape[0]
    M = select.shape[0]
    kinds, D = n.shape[1], n.shape[2]
    delta, mark, cells, scratch = _work(kinds, D)
    stamp = 0
    for b in range(B):
        layer = layers[b]
        for m in range(M):
            if not valid[b, m]:
                out[b, m] = 0.0
                continue
            stamp += 1
            count = _candidate_cells(
                delta, mark, cells, stamp, scratch, b, m, layer, experts, new_home, new_copies,
                new_weights, home, copies_t, weights, go_t, prev_home, select,
            )  # fmt: skip
            out[b, m] = rows_now[layer]
            _add_flips(out[b, m], n[layer], level, delta, cells, count)


@njit(_ADOPT, cache=True, nogil=True)
def adopt(  # type: ignore[no-untyped-def]
    n,
    level,
    rows_now,
    layers,
    experts,
    new_home,
    new_copies,
    new_weights,
    home,
    copies_t,
    weights,
    go_t,
    prev_home,
    select,
    picks,
    moves,
):
    """Layer `layers[picks[r]]` takes the multiplicities and rows of its candidate `moves[r]`
    (`candidate_rows`' arguments), in place in `n` and `rows_now`; before the columns in
    force change."""
    kinds, D = n.shape[1], n.shape[2]
    delta, mark, cells, scratch = _work(kinds, D)
    for r in range(picks.shape[0]):
        b, m = picks[r], moves[r]
        layer = layers[b]
        count = _candidate_cells(
            delta, mark, cells, r + 1, scratch, b, m, layer, experts, new_home, new_copies,
            new_weights, home, copies_t, weights, go_t, prev_home, select,
        )  # fmt: skip
        _add_flips(rows_now[layer], n[layer], level, delta, cells, count)
        for c in range(count):
            n[layer, cells[c, 0], cells[c, 1], cells[c, 2]] += delta[
                cells[c, 0], cells[c, 1], cells[c, 2]
            ]
