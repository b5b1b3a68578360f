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
  more), with the cluster's per-call floor on top (`cost.model.expert_call_floor`, monotone in
  a device's seconds, so the floor of the bound bounds the floored device);
- all-to-all: a device holds at most `slots` experts (a node `dpn * slots`, a domain `dpd *
  slots`), so each source sends at least its tokens beyond its largest counts out of its node
  and domain, through its NIC and uplink (`_all_to_all_s`); the phase takes at least its most
  loaded link's bytes / capacity (`poise.cost.network.link_seconds`), latencies counted as
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

from poise.cost.model import expert_call_floor, expert_seconds
from poise.cost.network import MIN_TRAFFIC_BYTES, group_sizes
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
    fec = expert_call_floor(cluster, spec, expert_seconds(cluster, spec, expert_total.max(axis=1)))
    a2a = _all_to_all_s(loads, expert_total, ctx)
    fnec, bnec = ctx.cost.non_moe_s
    zero = np.zeros(L)
    phases = PhaseTimes.from_parts(a2a, fec, np.full(L, fnec), zero, zero.copy(), np.full(L, bnec))
    return ctx.cost.schedule.layer_time(phases)


def _all_to_all_s(loads: np.ndarray, expert_total: np.ndarray, ctx: PlanContext) -> np.ndarray:
    """`[L]` lower bound on the dispatch all-to-all seconds of a one-copy-per-expert plan on the
    links as capacities (`poise.cost.network.link_seconds`, latencies counted as zero).

    A device holds at most `slots` experts, a node `dpn * slots`, a domain `dpd * slots`, so at
    least all but source d's largest `dpn * slots` counts leave its node and all but its largest
    `dpd * slots` leave its domain. A NIC carries what its devices send out of their node and
    an uplink what its devices send out of their domain, so the most loaded NIC (uplink) carries
    at least the largest sum of those minima over the devices behind one NIC (uplink). On the
    receiving side, the home of e takes e's tokens from outside its node (domain) through its
    NIC (uplink): at least all but the largest node's (domain's) share of them."""
    L, D, E = loads.shape
    cluster, tb = ctx.cluster, ctx.spec.token_bytes
    links = cluster.links()
    sizes = group_sizes(cluster)
    slots = ctx.slots_per_device
    ascending = np.sort(loads, axis=2)  # [L, D, E]
    tokens = loads.sum(axis=2)  # [L, D]

    def leaving(holders: int) -> np.ndarray:
        """`[L, D]` tokens that must leave a run of `holders` devices: all but the source's
        largest `holders * slots` counts (at most E)."""
        kept = min(holders * slots, E)
        return np.maximum(tokens - ascending[:, :, E - kept :].sum(axis=2), 0.0)

    def arriving(group: int) -> np.ndarray:
        """`[L]` the most tokens of one expert from outside its home's run of `group` devices:
        at least all but the largest such run's."""
        runs = loads.reshape(L, D // group, group, E).sum(axis=2)
        return (expert_total - runs.max(axis=1)).max(axis=1)

    def seconds(tokens: np.ndarray, level: int) -> np.ndarray:
        busy = tokens * tb
        return np.where(busy >= MIN_TRAFFIC_BYTES, busy, 0.0) / links[level].bw_Bps

    bound = np.zeros(L)
    for level, group in ((1, cluster.devices_per_node), (2, cluster.devices_per_domain)):
        if group == D:
            continue  # nothing must cross this level
        size = sizes[level]
        sent = leaving(group).reshape(L, D // size, size).sum(axis=2).max(axis=1)
        bound = np.maximum(bound, np.maximum(seconds(sent, level), seconds(arriving(group), level)))
    return bound


register_bound("static")(homes_only_layer_s)
register_bound("permute")(homes_only_layer_s)
