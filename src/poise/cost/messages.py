"""Messages: how many peers each device exchanges data with in a phase, per link level.

A phase's latency term (`poise.cost.network`) is charged per message: a device d that sends to
p devices and receives from q devices over level v pays lat_v * max(p, q) there (its sends and
its receives overlap, as the two directions of a link do). This module counts those peers.

A pair of devices (i, j), i != j, exchanges a message in a phase when a *feature* links them:
`src[i, f]` and `dst[j, f]` both hold for some f. For the dispatch all-to-all the features are
the experts: `src[i, e]` says device i sends tokens of e away (at least a byte,
`poise.cost.traffic.sends`), `dst[j, e]` that j takes a share of e's remote tokens
(`w[j, e] > 0`), so i sends to j iff

    exists e:  src[i, e] and dst[j, e]      (i sends tokens of some expert j serves)

and per device and level v (the level between the two devices, `Cluster.level_between`)

    out[v, i]  = #{j != i at level v from i :  src[i] . dst[j] > 0}     (peers i sends to)
    into[v, j] = #{i != j at level v from j :  src[i] . dst[j] > 0}     (peers j receives from)

No D x D matrix is formed where the runs are long: `within_runs` counts the pairs inside
contiguous runs of devices (a node, a domain, the cluster: devices are numbered node-major) and
the levels are differences of those counts (all pairs in the domain minus those in the node are
level 1, ...); on a cluster of up to `DIRECT_RUN` devices all pairs are tested at once (a
float32 matmul of the bool masks, `meet_matrix`) and counted per level in one pass
(`linked_levels`). Otherwise masks are packed into words (`pack`, W = ceil(F / 64) words). Inside a
short run (up to `DIRECT_RUN` devices) the run's pairs are tested at once, [runs, r, r] per
layer (cost L * D * r * W); in a long run the devices are grouped by their masks into classes
(np.unique of the packed rows: J source classes, K destination classes), the J x K class pairs
tested, and each device's count is a sum of its class's hits weighted by the other side's class
histogram of its run (cost per layer D log D + J K W + (D / r) J K). Exact either way: these
are integer counts.

This is the pairwise-exchange all-to-all of the alpha-beta model, (p - 1) alpha + bytes beta
for p devices (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005), with p - 1 the peers a device really exchanges with, so
that fewer peers (HybridEP's domains, Yang et al. arXiv 2510.19470, Table VII) cost fewer
latencies.
"""

from __future__ import annotations

import functools

import numpy as np

from poise.core.cluster import Cluster

DIRECT_RUN = 128  # runs up to this many devices test their pairs at once
assert DIRECT_RUN < 256  # a device's peers at one level fit in one base-256 digit (`linked_levels`)
_DIRECT_CELLS = 2**22  # pair cells tested per batch on the direct path


def pack(mask: np.ndarray) -> np.ndarray:
    """`[..., W]` unsigned words of a bool `mask[..., F]` (feature f is bit f % b of word f // b,
    b the word's bits: one word of 8, 16, 32 or 64 bits up to 64 features, else 64-bit
    words), so that two masks meet iff some word of their AND is nonzero. Masks already
    packed (not bool) come back as they are."""
    if mask.dtype != np.bool_:
        return mask
    packed = np.packbits(mask, axis=-1, bitorder="little")  # [..., ceil(F / 8)]
    nbytes = packed.shape[-1]
    size = next((b for b in (1, 2, 4) if nbytes <= b), -(-nbytes // 8) * 8)
    if size != nbytes:
        wide = np.zeros((*packed.shape[:-1], size), dtype=np.uint8)
        wide[..., :nbytes] = packed
        packed = wide
    word = np.dtype(f"u{min(size, 8)}")
    return np.ascontiguousarray(packed).view(word)


def within_runs(src: np.ndarray, dst: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(out, into)`, each `[L, D]`, for masks `src[L, D, F]`, `dst[L, D, F]` (bool) and runs of
    `size` consecutive devices: out[l, i] = #{j in i's run : src[l, i] . dst[l, j] > 0} and
    into[l, j] = #{i in j's run : the same}, the device itself included (module docstring)."""
    return _within(pack(src), pack(dst), size)


def _within(a: np.ndarray, b: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """`within_runs` on packed masks `a[L, D, W]`, `b[L, D, W]` (`pack`)."""
    L, D, _ = a.shape
    if L == 0 or D == 0:
        return np.zeros((L, D), dtype=np.int64), np.zeros((L, D), dtype=np.int64)
    if size <= DIRECT_RUN:
        return _direct(a, b, size)
    out = np.empty((L, D), dtype=np.int64)
    into = np.empty((L, D), dtype=np.int64)
    for layer in range(L):
        out[layer], into[layer] = _by_classes(a[layer], b[layer], size)
    return out, into


def _meets(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`[..., i, j]` bool: packed masks `a[..., i, W]` and `b[..., j, W]` meet."""
    if a.shape[-1] == 1:
        return (a[..., :, None, 0] & b[..., None, :, 0]) != 0
    return ((a[..., :, None, :] & b[..., None, :, :]) != 0).any(axis=-1)


def meet_matrix(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """`[..., i, j]` bool: masks `src[..., i, F]` and `dst[..., j, F]` meet (share a feature).
    Two bool masks meet where their float32 product src @ dst^T is nonzero (one BLAS call; a
    sum of non-negative terms is nonzero iff one term is); packed ones (`pack`) word by word."""
    if src.dtype == np.bool_ and dst.dtype == np.bool_:
        shared = np.matmul(src.astype(np.float32), dst.astype(np.float32).swapaxes(-1, -2))
        return shared > 0
    return _meets(pack(src), pack(dst))


def _direct(a: np.ndarray, b: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """`within_runs` testing every pair of a run: `[runs, size, size]` hits per batch."""
    L, D, W = a.shape
    runs = L * (D // size)
    a = a.reshape(runs, size, W)
    b = b.reshape(runs, size, W)
    out = np.empty(runs * size, dtype=np.int64)
    into = np.empty(runs * size, dtype=np.int64)
    step = max(1, _DIRECT_CELLS // (size * size * W))
    for lo in range(0, runs, step):
        hi = min(runs, lo + step)
        hit = _meets(a[lo:hi], b[lo:hi])  # [r, i, j]
        out[lo * size : hi * size] = hit.sum(axis=2).ravel()
        into[lo * size : hi * size] = hit.sum(axis=1).ravel()
    return out.reshape(L, D), into.reshape(L, D)


def _classes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(rows[K, W], index[D])`: the distinct rows of packed masks `x[D, W]` and each row's
    class."""
    if x.shape[1] == 1:
        keys = x[:, 0]
    else:
        keys = np.ascontiguousarray(x).view(np.dtype((np.void, x.itemsize * x.shape[1]))).ravel()
    _, first, index = np.unique(keys, return_index=True, return_inverse=True)
    return x[first], index.ravel()


def _by_classes(src: np.ndarray, dst: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """`within_runs` of one layer (packed `src[D, W]`, `dst[D, W]`) through classes of equal
    masks:

        out[i]  = sum_k hit[J(i), k] * hist_dst[run(i), k]
        into[j] = sum_c hist_src[run(j), c] * hit[c, K(j)]

    with hit[c, k] = [class c's mask meets class k's] and hist_x[r, k] the devices of run r in
    class k of side x."""
    D = src.shape[0]
    a_rows, a_of = _classes(src)
    b_rows, b_of = _classes(dst)
    J, K = len(a_rows), len(b_rows)
    hit = _meets(a_rows, b_rows).astype(np.float64)  # [J, K]
    run = np.arange(D) // size
    runs = D // size  # long runs: few of them (at most D / DIRECT_RUN)
    hist_b = np.bincount(run * K + b_of, minlength=runs * K).reshape(runs, K).astype(np.float64)
    hist_a = np.bincount(run * J + a_of, minlength=runs * J).reshape(runs, J).astype(np.float64)
    # (NumPy's matmul is fast on C-contiguous operands: the transpose is copied.)
    out = (hist_b @ np.ascontiguousarray(hit.T))[run, a_of]  # [runs, J] per run, source class
    into = (hist_a @ hit)[run, b_of]  # [runs, K] per run and destination class
    return np.rint(out).astype(np.int64), np.rint(into).astype(np.int64)


def level_counts(
    cluster: Cluster,
    src: np.ndarray,
    dst: np.ndarray,
    local_src: np.ndarray | None = None,
    local_dst: np.ndarray | None = None,
    group_size: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """`(out, into)`, each `[3, L, D]` float: the peers each device sends to and receives from
    per link level (module docstring), for masks `src[L, D, F]`, `dst[L, D, F]` (bool, or
    already packed: `pack`).

    With group-local routing, `local_src[L, D, F]` and `local_dst[L, D, F]` link pairs only
    inside the same group of `group_size` consecutive devices (a group nests with the levels:
    it lies in one node, is a run of whole nodes in one domain, or a run of whole domains). Per
    cumulative region R (the node, the domain, the cluster) a device's pairs are

        X(R) = N_R(src, dst) + N_{R & g}(src|local_src, dst|local_dst) - N_{R & g}(src, dst)

    with N_R the pairs inside R (`within_runs`) and R & g its group or R, whichever is smaller
    (the groups nest); level 0 = X(node) - self, level 1 = X(domain) - X(node), level 2 =
    X(cluster) - X(domain)."""
    dpn, dpd, D = cluster.devices_per_node, cluster.devices_per_domain, cluster.num_devices
    local = local_src is not None and local_dst is not None and group_size > 0
    if D <= DIRECT_RUN:  # few devices: every pair at once, split by the level table
        hit = meet_matrix(src, dst)  # [L, D, D]
        if local:
            assert local_src is not None and local_dst is not None
            hit |= meet_matrix(local_src, local_dst) & _same_run(D, group_size)
        out, into = linked_levels(cluster, hit).transpose(0, 2, 1, 3)  # [3, L, D] each
        return out, into
    glob_src, glob_dst = pack(src), pack(dst)
    both_src, both_dst = glob_src, glob_dst
    if local:  # the global features' words, then the local ones'
        assert local_src is not None and local_dst is not None
        both_src = np.concatenate([glob_src, pack(local_src)], axis=-1)
        both_dst = np.concatenate([glob_dst, pack(local_dst)], axis=-1)
    memo: dict[tuple[bool, int], tuple[np.ndarray, np.ndarray]] = {}

    def pairs(combined: bool, size: int) -> tuple[np.ndarray, np.ndarray]:
        key = (combined or not local, size)
        if key not in memo:
            a, b = (both_src, both_dst) if key[0] else (glob_src, glob_dst)
            memo[key] = _within(a, b, size)
        return memo[key]

    totals = []
    for size in (dpn, dpd, D):
        out, into = pairs(False, size)
        if local:
            g = min(size, group_size)
            out_c, into_c = pairs(True, g)
            out_g, into_g = pairs(False, g)
            out, into = out + out_c - out_g, into + into_c - into_g
        totals.append((out, into))
    own = ((both_src & both_dst) != 0).any(axis=-1)  # a device's pair with itself: no message
    (o0, i0), (o1, i1), (o2, i2) = totals
    out = np.stack([o0 - own, o1 - o0, o2 - o1]).astype(np.float64)
    into = np.stack([i0 - own, i1 - i0, i2 - i1]).astype(np.float64)
    return out, into


@functools.lru_cache(maxsize=32)
def level_masks(cluster: Cluster) -> np.ndarray:
    """`[3, D, D]` float32: 1 where `Cluster.level_between` of the pair is v (0 on the
    diagonal), read-only."""
    devices = np.arange(cluster.num_devices)
    level = cluster.level_between(devices[:, None], devices[None, :])
    table = np.stack([level == v for v in range(3)]).astype(np.float32)
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=32)
def level_index(cluster: Cluster) -> np.ndarray:
    """`[D, D]` int64: `Cluster.level_between` of each pair, -1 on the diagonal (a device's
    pair with itself carries no message); read-only."""
    devices = np.arange(cluster.num_devices)
    level = cluster.level_between(devices[:, None], devices[None, :]).astype(np.int64)
    np.fill_diagonal(level, -1)
    level.setflags(write=False)
    return level


@functools.lru_cache(maxsize=32)
def level_code(cluster: Cluster) -> np.ndarray:
    """`[D, D]` float32: 256^v for a pair at level v (`level_masks`), 0 on the diagonal;
    read-only. For `linked_levels`, on clusters of at most `DIRECT_RUN` devices."""
    at = level_masks(cluster)
    code = (at[0] + 256 * at[1] + 65536 * at[2]).astype(np.float32)
    code.setflags(write=False)
    return code


def linked_levels(
    cluster: Cluster, linked: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """`[2, ..., 3, D]` float: for a pair mask `linked[..., D, D]` (bool: i sends to j), [0,
    ..., v, i] = #{j at level v from i : linked[i, j]} (the peers i sends to) and [1, ..., v, j]
    = #{i at level v from j : linked[i, j]} (the peers j receives from); a device's pair with
    itself never counts. Written into `out` where given (any float array of that shape). On
    clusters of at most `DIRECT_RUN` devices.

    The three levels are counted in one sum: a linked pair adds 256^v (`level_code`; at most
    D - 1 < 256 peers a level) and the base-256 digits are read back. The sums are float32
    matmuls with ones, exact: every partial sum is an integer below 2^24."""
    D = linked.shape[-1]
    lead = linked.shape[:-2]
    coded = linked.astype(np.float32)
    coded *= level_code(cluster)
    ones = np.ones(D, dtype=np.float32)
    packed = np.empty((2, *lead, D), dtype=np.float32)
    np.matmul(coded, ones, out=packed[0])
    np.matmul(ones, coded, out=packed[1])
    digit = packed.astype(np.int32)
    counts = np.empty((2, *lead, 3, D)) if out is None else out
    np.bitwise_and(digit, 255, out=counts[..., 0, :], casting="unsafe")
    np.bitwise_and(digit >> 8, 255, out=counts[..., 1, :], casting="unsafe")
    np.right_shift(digit, 16, out=counts[..., 2, :], casting="unsafe")
    return counts


@functools.lru_cache(maxsize=32)
def _same_run(D: int, size: int) -> np.ndarray:
    """`[D, D]` bool: the two devices lie in one run of `size` consecutive devices."""
    run = np.arange(D) // size
    table = run[:, None] == run[None, :]
    table.setflags(write=False)
    return table


def pair_counts(
    cluster: Cluster, layer: np.ndarray, sender: np.ndarray, receiver: np.ndarray, layers: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(out, into)` `[3, L, D]` for an explicit list of messages `(layer[i], sender[i],
    receiver[i])` (Trans from a home to its replicas, migrations): each distinct pair of
    devices of a layer is one message, at the level between them; a device's pair with itself
    is none."""
    D = cluster.num_devices
    out = np.zeros((3, layers, D))
    into = np.zeros((3, layers, D))
    keep = sender != receiver
    if not keep.any():
        return out, into
    key = np.sort((layer[keep] * D + sender[keep]) * D + receiver[keep])
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    key = key[first]  # each pair once (a sort: faster here than np.unique's hashing)
    ly, rest = np.divmod(key, D * D)
    s, r = np.divmod(rest, D)
    lv = cluster.level_between(s, r)
    cells = 3 * layers * D
    out += np.bincount((lv * layers + ly) * D + s, minlength=cells).reshape(3, layers, D)
    into += np.bincount((lv * layers + ly) * D + r, minlength=cells).reshape(3, layers, D)
    return out, into


__all__ = ["DIRECT_RUN", "level_counts", "level_masks", "pack", "pair_counts", "within_runs"]
