"""Lower bounds on what a candidate policy's plan can cost, so `auto` can skip candidates that
cannot win a single layer without running them.

A bound is registered per policy (`BOUNDS[name](loads, ctx) -> [L]` seconds, or None where it
does not hold) and must never exceed the recurring time `layer_s - migrate_s` of any plan that
policy can return on `loads` `[L, D, E]`, under the cost model's schedule. `auto` runs the other
candidates first and skips a bounded one when `horizon * bound` exceeds the least total so far
(beyond the tie margin) in every layer: that candidate could neither be chosen nor tie.

`homes_only_layer_s` bounds any placement with one copy per expert and tokens sent to the homes
(`static` and `permute` with at least as many experts as devices). Every term of
`cost.PlanPricer` is at least what the bound charges:

- forward expert compute (FEC): the home of the expert with the most tokens computes all of them,
  `FEC >= expert_seconds(max_e sum_d x[d, e])` (`cost.expert_seconds`; its other experts add
  more);
- all-to-all: a device holds at most `slots` experts (a node `dpn * slots`, a domain `dpd *
  slots`), so each source sends at least its tokens beyond its largest counts out of its
  device, node and domain (`_all_to_all_s`); each device's time is a sum over link levels of
  max(sent, received) / bandwidth + latency (FasterMoE eq. 7-8's per-link model, as
  `cost.link_time` prices it), bounded from below by the sent part alone, one byte less per
  level (a level carrying less than `cost.MIN_TRAFFIC_BYTES` is free), latencies counted as
  zero;
- Trans, Agg and migration: zero (no replicas; migration is not recurring);
- non-MoE compute: exactly the cost model's (`CostModel.non_moe_s`); the dispatcher's host
  work (measured host costs only) counted as zero.

The schedules' `layer_time` is non-decreasing in every phase given zero Trans (`pipelined`:
d/dFEC >= 1/n; `prophet` hides Trans only, which is zero here), so the phases' bounds give a
bound on the layer time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from poise.cost.model import MIN_TRAFFIC_BYTES, expert_seconds, level_links
from poise.cost.phases import PhaseTimes
from poise.plan.policies.base import PlanContext

BoundFn = Callable[[np.ndarray, PlanContext], "np.ndarray | None"]

BOUNDS: dict[str, BoundFn] = {}


def register_bound(name: str) -> Callable[[BoundFn], BoundFn]:
    def wrap(fn: BoundFn) -> BoundFn:
        BOUNDS[name] = fn
        return fn

    return wrap


def homes_only_layer_s(loads: np.ndarray, ctx: PlanContext) -> np.ndarray | None:
    """`[L]` lower bound on the recurring layer seconds of any one-copy-per-expert plan on
    `loads[L, D, E]` (module docstring); None with more devices than experts (the static placement
    then keeps expert-data-parallel copies)."""
    L, D, E = loads.shape
    if D > E or L == 0:
        return None
    cluster, spec = ctx.cluster, ctx.spec
    expert_total = loads.sum(axis=1)  # [L, E]
    fec = expert_seconds(cluster, spec, expert_total.max(axis=1))  # [L]
    a2a = _all_to_all_s(loads, expert_total, ctx)
    fnec, bnec = ctx.cost.non_moe_s
    zero = np.zeros(L)
    phases = PhaseTimes.from_parts(a2a, fec, np.full(L, fnec), zero, zero.copy(), np.full(L, bnec))
    return ctx.cost.schedule.layer_time(phases)


def _all_to_all_s(loads: np.ndarray, expert_total: np.ndarray, ctx: PlanContext) -> np.ndarray:
    """`[L]` lower bound on the dispatch all-to-all seconds of a one-copy-per-expert plan.

    Source d keeps at most its `slots` largest counts on itself, its node's `dpn * slots`
    largest inside the node and its domain's `dpd * slots` inside the domain, so at least
    `S_dev`, `S_node`, `S_dom` of its tokens leave its device, node and domain. With link
    bandwidths falling outward (b0 >= b1 >= b2) its send time `(T - O) / b0 + (O - Q) / b1 +
    Q / b2` (T, O, Q: tokens leaving device, node, domain; T >= O >= Q) is least at the
    smallest feasible T, O, Q. The home of e likewise receives at least e's tokens beyond the
    largest device's, node's and domain's share from outside its device, node and domain. With
    bandwidths not falling outward, the bytes leaving the device over the fastest level."""
    L, D, E = loads.shape
    cluster, tb = ctx.cluster, ctx.spec.token_bytes
    bw, _ = level_links(cluster)
    slots = ctx.slots_per_device
    ascending = np.sort(loads, axis=2)  # [L, D, E]
    tokens = loads.sum(axis=2)  # [L, D]

    def leaving(holders: int) -> np.ndarray:
        """`[L, D]` tokens that must leave a run of `holders` devices: all but the source's
        largest `holders * slots` counts (at most E)."""
        kept = min(holders * slots, E)
        return np.maximum(tokens - ascending[:, :, E - kept :].sum(axis=2), 0.0)

    def level_s(tokens: np.ndarray, b: float) -> np.ndarray:
        return np.maximum(tokens * tb - MIN_TRAFFIC_BYTES, 0.0) / b

    def arriving(group: int) -> np.ndarray:
        """`[L, E]` tokens of e from outside its home's run of `group` devices: at least all
        but the largest such run's."""
        runs = loads.reshape(L, D // group, group, E).sum(axis=2)
        return expert_total - runs.max(axis=1)

    if not (bw[0] >= bw[1] >= bw[2]):
        sent = level_s(leaving(1).max(axis=1), bw.max())
        return np.maximum(sent, level_s(arriving(1).max(axis=1), bw.max()))
    dpn, dpd = cluster.devices_per_node, cluster.devices_per_domain
    sent = _outward_s(leaving(1), leaving(dpn), leaving(dpd), bw, level_s).max(axis=1)
    received = _outward_s(arriving(1), arriving(dpn), arriving(dpd), bw, level_s).max(axis=1)
    return np.maximum(sent, received)


def _outward_s(
    off_dev: np.ndarray,
    off_node: np.ndarray,
    off_dom: np.ndarray,
    bw: np.ndarray,
    level_s: Callable[[np.ndarray, float], np.ndarray],
) -> np.ndarray:
    """Least seconds to move tokens of which at least `off_dev`, `off_node`, `off_dom` cross a
    device's, node's and domain's boundary (any shape), bandwidths `bw[3]` falling outward:
    (T - O) / b0 + (O - Q) / b1 + Q / b2 at the smallest T >= O >= Q allowed."""
    off_node = np.maximum(off_node, off_dom)
    off_dev = np.maximum(off_dev, off_node)
    return (
        level_s(off_dev - off_node, bw[0])
        + level_s(off_node - off_dom, bw[1])
        + level_s(off_dom, bw[2])
    )


register_bound("static")(homes_only_layer_s)
register_bound("permute")(homes_only_layer_s)
