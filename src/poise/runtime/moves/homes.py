"""Which copy of an expert is its home, in a live run.

A placement's compute balance depends on which devices hold copies of each expert and how tokens
are split among them (`copies`, the assignment), not on which holder is the home. In training
the home matters twice: it carries the master weights and the optimizer state, so a home that
changes device costs a migration of weights and moments, and a device with more homes than
another does more optimizer and gradient-clipping work every step (the slowest device sets the
step). Policies made for inference or for the simulator choose homes their own way (EPLB's is
the device of an expert's first physical copy, so a re-plan reshuffles homes wholesale); the
live Balancer re-chooses them among the same holders before pricing a plan:

1. an expert with one holder has its home there;
2. an expert whose home in force still holds a copy keeps it (nothing migrates);
3. any other goes to its holder with the fewest homes so far (ties: the lowest device), the
   experts with fewer holders first.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from poise.core.placement import Assignment, Placement, Plan, transfers_between
from poise.core.spec import ModelSpec


def choose_homes(copies: np.ndarray, previous_home: np.ndarray) -> np.ndarray:
    """`[E]` home device per expert for one layer's `copies[D, E]` (every expert held
    somewhere), given the homes in force `previous_home[E]` (module docstring)."""
    holders = copies > 0  # [D, E]
    D, E = holders.shape
    home = np.full(E, -1, dtype=np.int64)
    count = holders.sum(axis=0)
    single = count == 1
    home[single] = np.argmax(holders[:, single], axis=0)
    keep = ~single & holders[previous_home, np.arange(E)]
    home[keep] = previous_home[keep]
    homes_on = np.bincount(home[home >= 0], minlength=D)
    for e in sorted(np.flatnonzero(home < 0), key=lambda x: (int(count[x]), int(x))):
        candidates = np.flatnonzero(holders[:, e])
        d = int(candidates[np.argmin(homes_on[candidates])])
        home[e] = d
        homes_on[d] += 1
    return home


def keep_homes(plan: Plan, previous: Placement, spec: ModelSpec) -> Plan:
    """`plan` with every layer's homes re-chosen by `choose_homes` against `previous` (the
    placement in force); its copies and assignment unchanged, its transfers recomputed (its
    `cost` is dropped: the caller prices it). The same plan if no home changes."""
    p = plan.placement
    home = np.stack([choose_homes(p.copies[i], previous.home[i]) for i in range(p.layers)])
    if np.array_equal(home, p.home):
        return plan
    placement = Placement(home=home, copies=p.copies.copy(), slots_per_device=p.slots_per_device)
    transfers = transfers_between(previous, placement, spec)
    return dataclasses.replace(plan, placement=placement, transfers=transfers, cost=None)


def homes_alone(current: Plan, spec: ModelSpec) -> Plan:
    """`current`'s homes without its replicas, every token routed to its expert's home (the
    first exit of `guard.exit_plans`, and a probe step's layout); the assignment splits by counts
    when `current`'s does. Its transfers: the replicas dropped (no migration)."""
    p = current.placement
    homes = Placement.from_homes(p.home, p.devices, p.slots_per_device)
    assignment = Assignment.to_home(homes).with_split(current.assignment.by_counts)
    return Plan("homes", homes, assignment, transfers_between(p, homes, spec))


__all__ = ["choose_homes", "homes_alone", "keep_homes"]
