"""Per-step token splitting: a replicated expert's tokens split among its holders by the counts
of *this* step, not by the shares a plan fixed from a forecast.

One layer, `D` devices, `E` experts; `c[s, e]` tokens source s routes to expert e this step
(known on every rank once the dispatcher has gathered the counts), `H_e` the devices holding a
copy of e, `w[e, d]` the plan's fixed shares (`Assignment.weights`). A plan's fixed split lets a
holder keep its own tokens and splits only the remote ones (`Assignment.to_home`, `balanced`);
the step's split chooses how many of *all* e's tokens, `T_e = sum_s c[s, e]`, each holder
computes, `y[e, h] >= 0` over `h in H_e` with `sum_h y[e, h] = T_e`. Device d then computes

    load[d] = sum_{e : d in H_e} y[e, d]

and the split aims at the least `max_d load[d]`. A holder keeps `min(c[h, e], y[e, h])` of its
own tokens; one with more of its own than its share (`c[h, e] > y[e, h]`) sheds the rest
(`shed[e, h]`) to the other holders, which receive `x[e, h] = y[e, h] - min(c[h, e], y[e, h])`
from the pool of the non-holders' tokens and the shed ones. Keeping its own tokens is then the
rule wherever it levels the loads, and shedding what the all-to-all moves besides: with two
ranks that both hold a hot expert there are no remote tokens to split, and only shedding can
level them (what LLEP and MoonEP do per micro-batch).

Algorithm (block coordinate descent over experts, Gauss-Seidel):

1. Start from the plan's split: `y[e, h] = c[h, e] + w[e, h] R_e` (real; `R_e` the remote
   tokens) or the integer routes of `Assignment.split` (integer).
2. `SWEEPS` times, for each expert with several holders and tokens, in expert order (layers at
   once): take y[e, :] off the loads, `base[h] = load[h]`, and water-fill T_e onto the holders:
   `y[e, h] = max(0, lam - base[h])` with `lam` solving `sum_h y[e, h] = T_e`. Integer:
   `floor(max(0, lam - base[h]))`, then the tokens left (fewer than |H_e| + 1) one each to the
   holders with the least `base + y`, the lower device first on ties.

Each block step gives e's holders the least maximum they can have with the other experts fixed
and touches no other device, so the largest device load never rises: the split is never worse
than the plan's fixed one (real or integer). Where the plan's split already levels a block
(every holder's level at or above its own tokens), the water-fill gives the same loads as
splitting the remote tokens alone, so nothing is shed. Water-filling also minimises the sum of
squared loads over H_e, so the sweeps descend the sum of squared device loads; on this problem
(divisible tokens, holders fixed) the load vector minimising it is the lexicographically
optimal one, which also has the least maximum (Fujishige, "Lexicographically optimal base of a
polymatroid with respect to a weight vector", Math. Oper. Res. 5(2), 1980: the achievable load
vectors form a polymatroid's base polytope). A fixed number of sweeps need not reach it
exactly; one sweep from the plan's split usually does when the holder sets of replicated
experts do not overlap.

Integer routes per source (`split_routes`): holder h's quota `x[e, h]` is cut among the
sources that send (non-holders: all their tokens; shedding holders: what they shed) in
proportion to what they send by one deterministic sequence of the pool's tokens: holder h's
j-th token has the key `(j + 1/2) / x[e, h]` (Sainte-Lague's sequential apportionment), tokens
sorted by (key, holder); source s takes the positions `[C_{s-1}, C_s)` (C the running sum of
what the sources send, in device order). Both margins are exact: each source sends what it
sends, each holder receives its quota, and every source's split is close to proportional (what
the cost model's traffic assumes).

Everything is computed from the counts with the same code on every rank, so the ranks agree.
"""

from __future__ import annotations

import math

import numpy as np

SWEEPS = 2  # Gauss-Seidel sweeps over the replicated experts


def _level(base: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Water level `lam[m]` with `sum_h max(0, lam - base[m, h]) = total[m]`; `base[m, W]` with
    `inf` on padding (at least one finite entry per row)."""
    order = np.sort(base, axis=1)
    finite = np.isfinite(order)
    cum = np.cumsum(np.where(finite, order, 0.0), axis=1)
    k = np.arange(1, base.shape[1] + 1)[None, :]
    # Filling the k lowest holders up to the next one's base costs next * k - cum[k - 1].
    nxt = np.concatenate([order[:, 1:], np.full((len(order), 1), np.inf)], axis=1)
    need = np.where(np.isfinite(nxt), nxt * k - cum, np.inf)
    active = np.minimum((need < total[:, None]).sum(axis=1), finite.sum(axis=1) - 1)
    rows = np.arange(len(order))
    return (total + cum[rows, active]) / (active + 1)


def water_fill(base: np.ndarray, total: np.ndarray, integer: bool) -> np.ndarray:
    """`x[m, W]` splitting `total[m]` tokens over holders with loads `base[m, W]` (`inf` on
    padding, which gets nothing) to level them (module docstring, step 2)."""
    lam = _level(base, total)
    x = np.where(np.isfinite(base), np.maximum(0.0, lam[:, None] - base), 0.0)
    if not integer:
        return x
    x = np.floor(x)
    left = np.rint(total - x.sum(axis=1)).astype(np.int64)
    order = np.argsort(base + x, axis=1, kind="stable")  # padding (inf) last; lower device first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(base.shape[1])[None, :].repeat(len(base), 0), 1)
    return x + (rank < left[:, None])


def fill_row(base: list[float], total: float, integer: bool) -> list[float]:
    """`water_fill` of one row without padding, in Python floats: the same operations in the
    same order, so the same result to the last bit (`tests/test_token_split.py` checks). The
    runtime splits one layer at a time, whose rows are an expert's few holders; on such rows
    NumPy's cost per call is most of `water_fill`'s time (`benchmarks/token_split.py`)."""
    width = len(base)
    order = sorted(base)
    cum, run = [], 0.0
    for b in order:
        run += b
        cum.append(run)
    # filling the k lowest holders up to the next one's base costs next * k - cum[k - 1]
    active = sum(order[i + 1] * (i + 1) - cum[i] < total for i in range(width - 1))
    lam = (total + cum[active]) / (active + 1)
    x = [max(0.0, lam - b) for b in base]
    if not integer:
        return x
    x = [float(math.floor(v)) for v in x]
    left = round(total - sum(x))
    for i in sorted(range(width), key=lambda i: base[i] + x[i])[:left]:  # stable: lower first
        x[i] += 1.0
    return x


def splittable(copies: np.ndarray, counts: np.ndarray, only: np.ndarray | None) -> np.ndarray:
    """`[L, E]` bool: the experts a step splits: several holders, tokens, and `only` (`[L, E]`,
    default all: e.g. the experts no group routes locally)."""
    multi = ((copies > 0).sum(axis=1) > 1) & (np.asarray(counts).sum(axis=1) > 0)
    return multi if only is None else multi & only


def split_totals(
    copies: np.ndarray,
    counts: np.ndarray,
    start: np.ndarray,
    integer: bool = False,
    only: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`(x, shed)`, each `[L, D, E]`, for `counts[L, D, E]` on holders `copies[L, D, E] > 0`:
    `x` the tokens each holder receives from other devices, `shed` the tokens of its own each
    holder sends to the other holders (module docstring), from the plan's split `start[L, D,
    E]` (the remote tokens it gives each holder; zero off the holders). `integer`: counts,
    start and results in whole tokens. Experts outside `splittable(copies, counts, only)` keep
    `start` and shed nothing (and weigh on the loads)."""
    held = copies > 0
    counts = np.asarray(counts, dtype=np.float64)
    x = np.array(start, dtype=np.float64)
    shed = np.zeros_like(x)
    multi = splittable(copies, counts, only)
    layer, expert = np.nonzero(multi)  # row-major: experts in order within each layer
    if not layer.size:
        return x, shed
    own = np.where(held, counts, 0.0)
    load = own.sum(axis=2) + x.sum(axis=2)  # [L, D]
    total = counts.sum(axis=1)  # [L, E]
    # Holders packed left in device order: `dev[m, W]`, padding marked by `pad`.
    held_m = held[layer, :, expert]  # [M, D]
    width = int(held_m.sum(axis=1).max())
    dev = np.argsort(~held_m, axis=1, kind="stable")[:, :width]
    pad = ~np.take_along_axis(held_m, dev, axis=1)
    cells = (layer[:, None], dev, expert[:, None])
    own_m = np.where(pad, 0.0, own[cells])
    ym = np.where(pad, 0.0, x[cells] + own_m)  # [M, W] tokens each holder computes
    if layer[0] == layer[-1]:  # one layer (the runtime's): expert by expert, in Python floats
        _sweep_one_layer(load[layer[0]], ym, dev, pad, total[layer[0], expert], integer)
    else:  # many layers (the cost model's): the k-th expert of every layer at once
        first = np.searchsorted(layer, layer)  # position of each pair among its layer's pairs
        pos = np.arange(layer.size) - first
        for _ in range(SWEEPS):
            for k in range(int(pos.max()) + 1):
                m = np.flatnonzero(pos == k)
                lm, dm = layer[m][:, None], dev[m]
                base = np.where(pad[m], np.inf, load[lm, dm] - ym[m])
                new = water_fill(base, total[layer[m], expert[m]], integer)
                delta = np.where(pad[m], 0.0, new - ym[m])
                np.add.at(load, (np.broadcast_to(lm, dm.shape), dm), delta)
                ym[m] = new
    kept = np.minimum(ym, own_m)
    x[cells] = np.where(pad, x[cells], ym - kept)
    shed[cells] = np.where(pad, 0.0, own_m - kept)
    return x, shed


def _sweep_one_layer(
    load: np.ndarray,
    ym: np.ndarray,
    dev: np.ndarray,
    pad: np.ndarray,
    total: np.ndarray,
    integer: bool,
) -> None:
    """`split_totals`' sweeps over one layer's replicated experts, in place: `load[D]` the
    devices' loads, `ym[M, W]` the tokens each of expert m's holders `dev[M, W]` (padding
    `pad`) computes, `total[M]` each expert's tokens; `fill_row` per expert, in expert order."""
    loads = load.tolist()
    rows = []
    for m in range(len(ym)):
        width = int((~pad[m]).sum())
        rows.append((dev[m, :width].tolist(), float(total[m]), ym[m, :width].tolist()))
    for _ in range(SWEEPS):
        for devs, tot, y in rows:
            new = fill_row([loads[d] - y[i] for i, d in enumerate(devs)], tot, integer)
            for i, d in enumerate(devs):
                loads[d] += new[i] - y[i]
            y[:] = new
    load[:] = loads
    for m, (_, _, y) in enumerate(rows):
        ym[m, : len(y)] = y


def split_weights(
    copies: np.ndarray,
    weights: np.ndarray,
    counts: np.ndarray,
    start: np.ndarray,
    only: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`(weights, shed)`: the step's shares `[L, E, D]` of the sent tokens (an
    `Assignment.weights`) and the share `[L, D, E]` of its own tokens each holder sheds (an
    `Assignment.shed`), from the plan's `weights[L, E, D]`, holders `copies[L, D, E]`, the
    step's `counts[L, D, E]` and the remote tokens the plan gives each holder, `start[L, D, E]`
    (`Assignment.received` less the kept tokens), in real numbers (what the cost model prices).
    Experts outside `splittable`, or whose holders send nothing, keep `weights` and shed
    nothing."""
    held = copies > 0
    counts = np.asarray(counts, dtype=np.float64)
    x, shed = split_totals(copies, counts, start, only=only)
    pool = (np.where(held, 0.0, counts) + shed).sum(axis=1)  # [L, E] tokens that travel
    moves = splittable(copies, counts, only) & (pool > 0)
    shares = x.transpose(0, 2, 1) / np.where(pool > 0, pool, 1.0)[:, :, None]
    share_shed = shed / np.where(counts > 0, counts, 1.0)
    return np.where(moves[:, :, None], shares, weights), share_shed


def split_routes(
    copies: np.ndarray,
    plan_routes: np.ndarray,
    counts: np.ndarray,
    only: np.ndarray | None = None,
) -> np.ndarray:
    """Integer routes `[L, D_src, E, D_dst]` of the step's `counts[L, D, E]` (int): the integer
    split of `split_totals` started from `plan_routes` (the plan's fixed routes,
    `Assignment.split`): holders keep what they do not shed, and the non-holders' tokens and the
    shed ones are cut per source by the module docstring's token sequence. Experts outside
    `splittable` keep `plan_routes`."""
    counts = np.asarray(counts, dtype=np.int64)
    held = copies > 0
    kept = np.where(held, counts, 0)
    remote = counts - kept  # [L, D, E]
    received = np.asarray(plan_routes).sum(axis=1).transpose(0, 2, 1)  # [L, D, E]
    start = np.where(held, received - kept, 0)
    x, shed = split_totals(copies, counts, start, integer=True, only=only)
    x, shed = np.rint(x).astype(np.int64), np.rint(shed).astype(np.int64)
    routes = np.array(plan_routes, dtype=np.int64)
    layer, expert = np.nonzero(splittable(copies, counts, only))
    for lyr, e in zip(layer.tolist(), expert.tolist(), strict=True):
        col = _cut(remote[lyr, :, e] + shed[lyr, :, e], x[lyr, :, e])  # [D_src, D_dst]
        own = np.flatnonzero(held[lyr, :, e])
        col[own, own] += counts[lyr, own, e] - shed[lyr, own, e]
        routes[lyr, :, e, :] = col
    return routes


def _cut(sent: np.ndarray, quota: np.ndarray) -> np.ndarray:
    """`[D_src, D_dst]` tokens from each source (`sent[D]`) to each holder (`quota[D]`, same
    total): the token sequence of the module docstring."""
    D = sent.shape[0]
    holders = np.flatnonzero(quota > 0)
    q = quota[holders]
    tickets = np.repeat(np.arange(holders.size), q)
    j = np.arange(tickets.size) - np.repeat(np.cumsum(q) - q, q)
    order = np.lexsort((tickets, (j + 0.5) / q[tickets]))
    label = holders[tickets[order]]
    source = np.repeat(np.arange(D), sent)
    out = np.zeros((D, D), dtype=np.int64)
    np.add.at(out, (source, label), 1)
    return out
