"""A live window whose steps ran plans that route inside groups of different sizes (a domain of
4 devices on one step, an expert-parallel group of 2 on the next) is priced step by step as each
step's plan alone prices it: `cost.per_step` splits the window by group size
(`group_size_parts`) because one pricer holds one group size."""

from __future__ import annotations

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.cost.model import CostModel
from poise.cost.per_step import device_compute, group_size_parts, live_parts, step_phases

from .helpers import toy_cluster, toy_spec

L, E, D = 2, 4, 8


def grouped_plan(group_size: int, seed: int) -> Plan:
    """Every expert on two devices (its home and one replica), routed inside groups of
    `group_size` devices that hold a copy."""
    rng = np.random.default_rng(seed)
    home = np.stack([rng.permutation(D)[:E] for _ in range(L)])  # [L, E]
    placement = Placement.from_homes(home, D, 2)
    copies = placement.copies.copy()
    for layer in range(L):
        for e in range(E):
            free = [d for d in range(D) if copies[layer, d].sum() < 2 and copies[layer, d, e] == 0]
            copies[layer, free[0], e] = 1
    placement = Placement(home, copies, 2)
    spec = toy_spec(experts=E, layers=L)
    return Plan(
        f"g{group_size}",
        placement,
        Assignment.group_local(placement, group_size),
        transfers_between(None, placement, spec),
    )


def test_a_window_of_two_group_sizes_prices_each_step_as_its_own_plan() -> None:
    cost = CostModel(toy_cluster(devices_per_node=4, nodes=1, domains=2, lat=1e-5), toy_spec(E, L))
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(3, L, D, E)).astype(np.int64)  # [S, L, D, E]
    plans = [grouped_plan(4, 1), grouped_plan(2, 2), grouped_plan(4, 3)]
    assert [list(p) for p in group_size_parts(plans)] == [[1], [0, 2]]
    assert [list(p) for p in group_size_parts(plans[0])] == [[0]]

    window = live_parts(cost, plans, counts)  # [S, 2]
    alone = np.concatenate([live_parts(cost, p, counts[s : s + 1]) for s, p in enumerate(plans)])
    np.testing.assert_allclose(window, alone, rtol=1e-12)
    assert (alone[:, 0] > 0).all()

    phases, device_load, loads = step_phases(cost, plans, counts)
    for s, p in enumerate(plans):
        one, one_load, one_loads = step_phases(cost, p, counts[s : s + 1])
        rows = slice(s * L, (s + 1) * L)
        np.testing.assert_allclose(phases.dispatch_s[rows], one.dispatch_s, rtol=1e-12)
        np.testing.assert_allclose(phases.expert_fwd_s[rows], one.expert_fwd_s, rtol=1e-12)
        np.testing.assert_array_equal(device_load[rows], one_load)
        np.testing.assert_array_equal(loads[rows], one_loads)

    compute = device_compute(cost, plans, counts)  # [S, D]
    for s, p in enumerate(plans):
        np.testing.assert_allclose(compute[s], device_compute(cost, p, counts[s : s + 1])[0])
