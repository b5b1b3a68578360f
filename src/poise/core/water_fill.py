"""Water-filling: a replicated expert's tokens split among its holders so that their loads
come out as level as the holders' own tokens allow (`Assignment.balanced`, and planners that
re-route one expert at a time, `plan.policies.vexpert`).

    weights = balanced_weights(local, remote, copies)      # [..., D], summing to one

Each holder d keeps `local[d]` tokens of its own; `remote` tokens come from sources holding no
copy. The fill level solves sum_d copies_d * max(0, level - local_d / copies_d) = remote over the
holders, and each holder takes its copies' shortfall below the level.
"""

from __future__ import annotations

import numpy as np

_TOL = 1e-9


def balanced_weights(local: np.ndarray, remote: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """Water-filling of `Assignment.balanced` on any leading shape: `local[..., D]` tokens each
    holder keeps (zero off the holders), `remote[...]` tokens to split, `copies[..., D]` float
    copy counts -> `weights[..., D]` (shares of `remote`, summing to one over the holders).

    `level` solves sum_d copies * max(0, level - local / copies) = remote over the holders; each
    holder gets its copies' shortfall below that level. Shared by `Assignment.balanced` (`[L, E,
    D]`) and planners that re-route one expert at a time (`[K, D]`). An expert with one holder
    sends it everything; only rows with several holders are water-filled."""
    D = copies.shape[-1]
    held = copies > 0
    out = held.astype(np.float64).reshape(-1, D)
    n_held = held.reshape(-1, D).sum(axis=1)
    multi = np.flatnonzero(n_held > 1)
    if not multi.size:
        return out.reshape(copies.shape)
    local_m, copies_m = local.reshape(-1, D)[multi], copies.reshape(-1, D)[multi]
    remote_m = remote.reshape(-1)[multi]
    width = int(n_held[multi].max())
    if 2 * width > D:
        out[multi] = _water_fill(local_m, remote_m, copies_m)
        return out.reshape(copies.shape)
    # Few holders per row (e.g. thousands of devices): fill on the holders only, packed left in
    # device order (ties still go to the lower device), then scatter back.
    rows, cols = np.nonzero(copies_m > 0)
    slot = np.arange(rows.size) - np.searchsorted(rows, rows)  # position among the row's holders
    packed_local = np.zeros((multi.size, width))
    packed_copies = np.zeros((multi.size, width))
    packed_local[rows, slot] = local_m[rows, cols]
    packed_copies[rows, slot] = copies_m[rows, cols]
    shares = _water_fill(packed_local, remote_m, packed_copies)
    filled = np.zeros((multi.size, D))
    filled[rows, cols] = shares[rows, slot]
    out[multi] = filled
    return out.reshape(copies.shape)


def _water_fill(local: np.ndarray, remote: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """`balanced_weights` on rows `[N, D]` (`remote[N]`)."""
    rows = np.arange(copies.shape[0])[:, None]
    held_t = copies > 0
    per_copy = np.where(held_t, local / np.maximum(copies, 1), np.inf)
    sorted_idx = np.argsort(per_copy, axis=-1, kind="stable")
    order = per_copy[rows, sorted_idx]
    c_sorted = copies[rows, sorted_idx]
    cum_c = np.cumsum(c_sorted, axis=-1)
    finite = np.isfinite(order)
    cum_cl = np.cumsum(np.where(finite, order, 0.0) * c_sorted, axis=-1)
    # Filling the first k holders up to order[k] costs order[k] * cum_c[k-1] - cum_cl[k-1].
    fill_to_next = np.where(
        finite[..., 1:], order[..., 1:] * cum_c[..., :-1] - cum_cl[..., :-1], np.inf
    )
    k = (fill_to_next < remote[..., None]).sum(axis=-1)  # holders below the final level - 1
    k = np.minimum(k, held_t.sum(axis=-1) - 1)[..., None]
    cc = cum_c[rows, k][..., 0]
    ccl = cum_cl[rows, k][..., 0]
    level = (remote + ccl) / np.maximum(cc, 1e-300)
    share = np.where(held_t, np.maximum(0.0, level[..., None] * copies - local), 0.0)
    # Summed in device order (a running sum): the non-holders' zeros change nothing, so a row
    # gets the same bits on all D devices and packed on its holders, whatever rows share its
    # batch (NumPy's pairwise `sum` groups the terms by the row's length).
    total = np.cumsum(share, axis=-1)[..., -1:]
    fallback = copies / np.maximum(copies.sum(axis=-1, keepdims=True), 1e-300)
    return np.where(total > _TOL, share / np.where(total > _TOL, total, 1.0), fallback)


__all__ = ["balanced_weights"]
