"""Synthetic routing traces: seeded, vectorised generators of `Trace` objects.

Every generator returns a `Trace` whose `counts` is an int64 array `[S, L, D, E]` (steps, MoE
layers, source devices, experts). Each source row `counts[s, l, d, :]` is one multinomial draw of
exactly `top_k * tokens_per_device` assignments from a probability vector over the experts, so
every row sums exactly to `top_k * tokens_per_device`.

Because a token picks `top_k` *distinct* experts, one source can send at most
`tokens_per_device` assignments to one expert. The generators respect that bound: probabilities
are capped at `1 / top_k` (excess poured into the other experts, water-filling), and the rare
sampled count above the bound is moved to experts with room.

Determinism: the same arguments and `seed` give the same trace on every machine. The seed is
split (`numpy.random.SeedSequence`) into one stream for the structure (popularity rankings,
random walks, hot experts) and one independent stream per step for sampling, so the result does
not depend on how many threads sample it.

Kinds (`generate(kind, ...)`): `uniform`, `zipf`, `drift`, `hot_set`, `hot_rank`, `rotating`,
`bursts`. Worked example::

    >>> t = generate("zipf", steps=2, layers=1, devices=2, experts=4, top_k=2,
    ...              tokens_per_device=8, seed=0, s=1.2)
    >>> t.counts.shape, t.counts.sum(axis=3).tolist()
    ((2, 1, 2, 4), [[[16, 16]], [[16, 16]]])
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from poise.core.errors import ConfigError
from poise.trace.trace import Trace

DEFAULT_TOP_K = 2
DEFAULT_TOKENS_PER_DEVICE = 1024

# --------------------------------------------------------------------------- parameter checks


def _where(kind: str) -> str:
    return f"trace generator {kind!r}"


def _check_int(kind: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"must be an integer, got {value!r}", source=_where(kind), field=name)
    value = int(value)
    if value < minimum:
        raise ConfigError(f"must be >= {minimum}, got {value}", source=_where(kind), field=name)
    if maximum is not None and value > maximum:
        raise ConfigError(f"must be <= {maximum}, got {value}", source=_where(kind), field=name)
    return value


def _check_float(
    kind: str,
    name: str,
    value: Any,
    minimum: float = 0.0,
    maximum: float | None = None,
    *,
    open_min: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"must be a number, got {value!r}", source=_where(kind), field=name)
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"must be finite, got {value!r}", source=_where(kind), field=name)
    if value < minimum or (open_min and value == minimum):
        op = ">" if open_min else ">="
        raise ConfigError(
            f"must be {op} {minimum:g}, got {value:g}", source=_where(kind), field=name
        )
    if maximum is not None and value > maximum:
        raise ConfigError(f"must be <= {maximum:g}, got {value:g}", source=_where(kind), field=name)
    return value


def _check_shape(
    kind: str,
    steps: Any,
    layers: Any,
    devices: Any,
    experts: Any,
    top_k: Any,
    tokens_per_device: Any,
    seed: Any,
) -> tuple[int, int, int, int, int, int, int]:
    S = _check_int(kind, "steps", steps, 1)
    L = _check_int(kind, "layers", layers, 1)
    D = _check_int(kind, "devices", devices, 1)
    E = _check_int(kind, "experts", experts, 1)
    k = _check_int(kind, "top_k", top_k, 1, E)
    T = _check_int(kind, "tokens_per_device", tokens_per_device, 1)
    sd = _check_int(kind, "seed", seed, 0)
    return S, L, D, E, k, T, sd


# --------------------------------------------------------------------------- probability helpers


def zipf_weights(experts: int, s: float) -> np.ndarray:
    """`[E]` Zipf probabilities by popularity rank: `p[r] ∝ (r + 1) ** -s`, summing to 1."""
    w = np.arange(1, experts + 1, dtype=np.float64) ** -s
    return w / w.sum()


def _rank_permutations(rng: np.random.Generator, layers: int, experts: int) -> np.ndarray:
    """`[L, E]` popularity rank of each expert, a different random permutation per layer."""
    return np.stack([rng.permutation(experts) for _ in range(layers)])


def _zipf_by_layer(rng: np.random.Generator, layers: int, experts: int, s: float) -> np.ndarray:
    """`[L, E]` per-layer Zipf(s) probabilities over experts, random ranking per layer."""
    return zipf_weights(experts, s)[_rank_permutations(rng, layers, experts)]


def cap_probabilities(p: np.ndarray, cap: float) -> np.ndarray:
    """Water-fill `p [..., E]` (rows summing to 1) so that no entry exceeds `cap`.

    Excess above the cap is poured into the uncapped entries in proportion to their mass (evenly
    where they have none). Requires `cap * E >= 1`. Returns a new array."""
    p = np.array(p, dtype=np.float64, copy=True)
    E = p.shape[-1]
    if cap * E < 1.0 - 1e-12:
        raise ValueError(f"cap {cap} too small for {E} entries")
    for _ in range(E + 1):
        over = p > cap * (1.0 + 1e-12)
        if not over.any():
            break
        excess = np.where(over, p - cap, 0.0).sum(axis=-1, keepdims=True)
        p = np.where(over, cap, p)
        free = p < cap * (1.0 - 1e-12)
        mass = np.where(free, p, 0.0)
        total = mass.sum(axis=-1, keepdims=True)
        n_free = free.sum(axis=-1, keepdims=True)
        share = np.where(
            total > 0, mass / np.where(total > 0, total, 1.0), free / np.maximum(n_free, 1)
        )
        p = p + excess * share
    p = np.minimum(p, cap)
    return p / p.sum(axis=-1, keepdims=True)


def _normalise(p: np.ndarray) -> np.ndarray:
    return p / p.sum(axis=-1, keepdims=True)


# --------------------------------------------------------------------------- sampling


def _sample_step(
    rng: np.random.Generator, probs: np.ndarray, top_k: int, tokens_per_device: int
) -> np.ndarray:
    """`[L, D, E]` counts: one multinomial row per (layer, device), each capped at
    `tokens_per_device` per expert with the row sum kept at `top_k * tokens_per_device`."""
    n = top_k * tokens_per_device
    counts = rng.multinomial(n, probs)
    over = counts > tokens_per_device
    if over.any():
        for idx in zip(*np.nonzero(over.any(axis=-1)), strict=True):
            row = counts[idx]
            overflow = int(np.maximum(row - tokens_per_device, 0).sum())
            row = np.minimum(row, tokens_per_device)
            room = tokens_per_device - row
            row = row + rng.multivariate_hypergeometric(room, overflow)
            counts[idx] = row
    return counts


def sample_counts(
    probs: np.ndarray,
    steps: int,
    devices: int,
    top_k: int,
    tokens_per_device: int,
    seed_seq: np.random.SeedSequence,
) -> np.ndarray:
    """Draw counts `[S, L, D, E]` from probabilities broadcastable to that shape.

    `probs` has shape `[S or 1, L, D or 1, E]` with rows summing to 1. Step s uses its own
    generator spawned from `seed_seq`, so the result is independent of the thread count."""
    P, L, _, E = probs.shape
    probs = cap_probabilities(probs, 1.0 / top_k)
    children = seed_seq.spawn(steps)

    def one(s: int) -> np.ndarray:
        p = np.broadcast_to(probs[min(s, P - 1)], (L, devices, E))
        return _sample_step(np.random.default_rng(children[s]), p, top_k, tokens_per_device)

    workers = min(8, os.cpu_count() or 1, steps)
    if workers <= 1 or steps * L * devices * E < 200_000:
        parts = [one(s) for s in range(steps)]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            parts = list(pool.map(one, range(steps)))
    return np.stack(parts).astype(np.int64, copy=False)


def _build(
    kind: str,
    probs: np.ndarray,
    ss: np.random.SeedSequence,
    steps: int,
    devices: int,
    top_k: int,
    tokens_per_device: int,
    seed: int,
    name: str | None,
    params: dict[str, Any],
    extra_meta: dict[str, Any] | None = None,
) -> Trace:
    counts = sample_counts(probs, steps, devices, top_k, tokens_per_device, ss)
    meta: dict[str, Any] = {"generator": kind, "params": params, "seed": seed}
    if extra_meta:
        meta.update(extra_meta)
    return Trace(
        counts, np.arange(steps, dtype=np.int64), top_k, tokens_per_device, name or kind, meta
    )


def _streams(seed: int) -> tuple[np.random.Generator, np.random.SeedSequence]:
    structure, sampling = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(structure), sampling


# --------------------------------------------------------------------------- generators


def uniform(
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    *,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Every expert equally likely: counts `[S, L, D, E]`, rows sum to `top_k * T`."""
    S, L, D, E, k, T, sd = _check_shape(
        "uniform", steps, layers, devices, experts, top_k, tokens_per_device, seed
    )
    _, ss = _streams(sd)
    probs = np.full((1, L, 1, E), 1.0 / E)
    return _build("uniform", probs, ss, S, D, k, T, sd, name, {})


def zipf(
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    *,
    s: float = 1.0,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Static Zipf skew: in layer l expert e has probability `∝ (rank[l, e] + 1) ** -s`, with
    `rank [L, E]` a random permutation per layer. All devices and steps share it.
    Counts `[S, L, D, E]`. `s = 0` is uniform."""
    S, L, D, E, k, T, sd = _check_shape(
        "zipf", steps, layers, devices, experts, top_k, tokens_per_device, seed
    )
    s = _check_float("zipf", "s", s, 0.0)
    rng, ss = _streams(sd)
    probs = _zipf_by_layer(rng, L, E, s)[None, :, None, :]
    return _build("zipf", probs, ss, S, D, k, T, sd, name, {"s": s})


def drift(
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    *,
    s: float = 1.0,
    rate: float = 0.05,
    revert: float = 0.0,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Zipf(s) skew whose logits follow a slow random walk over steps.

    `logits[t, l, e] = -s * log(rank[l, e] + 1) + W[t, l, e]`, `W[0] = 0`,
    `W[t] = (1 - revert) * W[t-1] + rate * N(0, 1)`; probabilities are `softmax(logits)`.
    `rate` is the per-step standard deviation of the walk (small: loads drift slowly);
    `revert` in [0, 1] pulls the walk back to the Zipf base (0: a pure random walk).
    Counts `[S, L, D, E]`."""
    S, L, D, E, k, T, sd = _check_shape(
        "drift", steps, layers, devices, experts, top_k, tokens_per_device, seed
    )
    s = _check_float("drift", "s", s, 0.0)
    rate = _check_float("drift", "rate", rate, 0.0)
    revert = _check_float("drift", "revert", revert, 0.0, 1.0)
    rng, ss = _streams(sd)
    base = -s * np.log(_rank_permutations(rng, L, E) + 1.0)  # [L, E]
    noise = rng.standard_normal((S, L, E)) * rate
    noise[0] = 0.0
    if revert == 0.0:
        walk = np.cumsum(noise, axis=0)
    else:
        walk = np.empty_like(noise)
        walk[0] = 0.0
        for t in range(1, S):
            walk[t] = (1.0 - revert) * walk[t - 1] + noise[t]
    logits = base[None] + walk
    logits -= logits.max(axis=-1, keepdims=True)
    probs = _normalise(np.exp(logits))[:, :, None, :]
    return _build(
        "drift", probs, ss, S, D, k, T, sd, name, {"s": s, "rate": rate, "revert": revert}
    )


def hot_set(
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    *,
    hot: int | None = None,
    share: float = 0.5,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """`hot` experts per layer (default `min(2, E)`; chosen at random, `[L, hot]` in
    `meta["hot_experts"]`) share `share` of the traffic evenly; the rest is spread evenly over
    the others.
    Counts `[S, L, D, E]`."""
    S, L, D, E, k, T, sd = _check_shape(
        "hot_set", steps, layers, devices, experts, top_k, tokens_per_device, seed
    )
    hot = _check_int("hot_set", "hot", min(2, E) if hot is None else hot, 1, E)
    share = _check_float("hot_set", "share", share, 0.0, 1.0)
    rng, ss = _streams(sd)
    chosen = np.stack([rng.choice(E, size=hot, replace=False) for _ in range(L)])  # [L, hot]
    probs = _hot_mix(np.full((L, E), 1.0 / E), chosen, share, exclude_hot=True)
    return _build(
        "hot_set",
        probs[None, :, None, :],
        ss,
        S,
        D,
        k,
        T,
        sd,
        name,
        {"hot": hot, "share": share},
        {"hot_experts": chosen.tolist()},
    )


def _hot_mix(
    base: np.ndarray, chosen: np.ndarray, share: float, *, exclude_hot: bool = False
) -> np.ndarray:
    """`[L, E]`: `share` of each row spread evenly over `chosen[l]`, the rest following `base`
    (restricted to the other experts when `exclude_hot`)."""
    L, E = base.shape
    mask = np.zeros((L, E), dtype=bool)
    np.put_along_axis(mask, chosen, True, axis=1)
    rest = np.where(mask, 0.0, base) if exclude_hot else base.copy()
    total = rest.sum(axis=1, keepdims=True)
    if np.any(total <= 0):  # every expert hot: all traffic is hot traffic
        return _normalise(mask.astype(np.float64))
    return (1.0 - share) * rest / total + share * mask / mask.sum(axis=1, keepdims=True)


def hot_rank(
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    *,
    device: int = 0,
    hot: int | None = None,
    share: float = 0.8,
    s: float = 0.0,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """One source device is skewed differently from the others.

    All devices follow a per-layer Zipf(s) base (`s = 0`: uniform); source `device` sends
    `share` of its assignments to `hot` experts per layer (default `min(2, E)`;
    `meta["hot_experts"]`, `[L, hot]`),
    the others' popularity notwithstanding. Counts `[S, L, D, E]`."""
    S, L, D, E, k, T, sd = _check_shape(
        "hot_rank", steps, layers, devices, experts, top_k, tokens_per_device, seed
    )
    device = _check_int("hot_rank", "device", device, 0, D - 1)
    hot = _check_int("hot_rank", "hot", min(2, E) if hot is None else hot, 1, E)
    share = _check_float("hot_rank", "share", share, 0.0, 1.0)
    s = _check_float("hot_rank", "s", s, 0.0)
    rng, ss = _streams(sd)
    base = _zipf_by_layer(rng, L, E, s)  # [L, E]
    chosen = np.stack([rng.choice(E, size=hot, replace=False) for _ in range(L)])
    probs = np.repeat(base[:, None, :], D, axis=1)  # [L, D, E]
    probs[:, device, :] = _hot_mix(base, chosen, share)
    return _build(
        "hot_rank",
        probs[None],
        ss,
        S,
        D,
        k,
        T,
        sd,
        name,
        {"device": device, "hot": hot, "share": share, "s": s},
        {"hot_experts": chosen.tolist()},
    )


def rotating(
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    *,
    period: int = 10,
    width: int = 1,
    share: float = 0.5,
    s: float = 0.0,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """A hotspot of `width` consecutive experts that moves to the next `width` experts every
    `period` steps. In layer l at step t the hot experts are
    `(start[l] + (t // period) * width + i) % E` for `i < width` (`start` random per layer,
    `meta["start"]`); they take `share` of the traffic, the rest follows Zipf(s).
    Counts `[S, L, D, E]`."""
    S, L, D, E, k, T, sd = _check_shape(
        "rotating", steps, layers, devices, experts, top_k, tokens_per_device, seed
    )
    period = _check_int("rotating", "period", period, 1)
    width = _check_int("rotating", "width", width, 1, E)
    share = _check_float("rotating", "share", share, 0.0, 1.0)
    s = _check_float("rotating", "s", s, 0.0)
    rng, ss = _streams(sd)
    base = _zipf_by_layer(rng, L, E, s)  # [L, E]
    start = rng.integers(0, E, size=L)
    t = np.arange(S)
    first = start[None, :] + (t // period)[:, None] * width  # [S, L]
    hot_idx = (first[..., None] + np.arange(width)) % E  # [S, L, width]
    mask = np.zeros((S, L, E))
    np.put_along_axis(mask, hot_idx, 1.0 / width, axis=2)
    probs = (1.0 - share) * base[None] + share * mask
    return _build(
        "rotating",
        probs[:, :, None, :],
        ss,
        S,
        D,
        k,
        T,
        sd,
        name,
        {"period": period, "width": width, "share": share, "s": s},
        {"start": start.tolist()},
    )


def bursts(
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    *,
    prob: float = 0.05,
    share: float = 0.5,
    s: float = 0.0,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Occasional burst steps: each step is a burst with probability `prob`; in a burst step
    one random expert per layer takes `share` of the traffic. Other steps follow a per-layer
    Zipf(s) base. `meta["burst_steps"]` lists the burst rows. Counts `[S, L, D, E]`."""
    S, L, D, E, k, T, sd = _check_shape(
        "bursts", steps, layers, devices, experts, top_k, tokens_per_device, seed
    )
    prob = _check_float("bursts", "prob", prob, 0.0, 1.0)
    share = _check_float("bursts", "share", share, 0.0, 1.0)
    s = _check_float("bursts", "s", s, 0.0)
    rng, ss = _streams(sd)
    base = _zipf_by_layer(rng, L, E, s)  # [L, E]
    is_burst = rng.random(S) < prob  # [S]
    spike = rng.integers(0, E, size=(S, L))  # [S, L]
    onehot = np.zeros((S, L, E))
    np.put_along_axis(onehot, spike[..., None], 1.0, axis=2)
    w = np.where(is_burst, share, 0.0)[:, None, None]
    probs = (1.0 - w) * base[None] + w * onehot
    burst_rows = np.flatnonzero(is_burst)
    return _build(
        "bursts",
        probs[:, :, None, :],
        ss,
        S,
        D,
        k,
        T,
        sd,
        name,
        {"prob": prob, "share": share, "s": s},
        {"burst_steps": burst_rows.tolist(), "burst_experts": spike[burst_rows].tolist()},
    )


# --------------------------------------------------------------------------- registry

GENERATORS: dict[str, Callable[..., Trace]] = {
    "uniform": uniform,
    "zipf": zipf,
    "drift": drift,
    "hot_set": hot_set,
    "hot_rank": hot_rank,
    "rotating": rotating,
    "bursts": bursts,
}

_COMMON = ("steps", "layers", "devices", "experts", "top_k", "tokens_per_device", "seed", "name")


def generator_params(kind: str) -> dict[str, Any]:
    """The kind-specific parameters of a generator and their defaults."""
    fn = _lookup(kind)
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.name not in _COMMON
    }


def _lookup(kind: str) -> Callable[..., Trace]:
    key = str(kind).strip().lower().replace("-", "_")
    if key not in GENERATORS:
        raise ConfigError(
            f"unknown trace generator {kind!r} (expected one of {', '.join(GENERATORS)})",
            field="kind",
        )
    return GENERATORS[key]


def generate(
    kind: str,
    *,
    steps: int,
    layers: int,
    devices: int,
    experts: int,
    top_k: int = DEFAULT_TOP_K,
    tokens_per_device: int = DEFAULT_TOKENS_PER_DEVICE,
    seed: int = 0,
    name: str | None = None,
    **params: Any,
) -> Trace:
    """Generate a `[S, L, D, E]` trace of the given `kind` (see `GENERATORS`); `params` are the
    kind's own parameters (`generator_params(kind)` lists them). Unknown kinds and parameters,
    and out-of-range values, raise `ConfigError`."""
    fn = _lookup(kind)
    allowed = generator_params(kind)
    for key in params:
        if key not in allowed:
            choices = ", ".join(allowed) or "none"
            raise ConfigError(
                f"unknown parameter (this generator takes: {choices})",
                source=_where(fn.__name__),
                field=key,
            )
    return fn(
        steps,
        layers,
        devices,
        experts,
        top_k=top_k,
        tokens_per_device=tokens_per_device,
        seed=seed,
        name=name,
        **params,
    )
