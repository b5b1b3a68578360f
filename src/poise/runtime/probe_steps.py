"""Probe steps for the paired clock (`control.clock`): now and then, while plans with replicas
are in force (an *episode*), the step after a boundary routes every token to its expert's home
(`moves.homes.homes_alone`) on the cadence of `control.evidence.probe_due`. Nothing moves, so
the mathematics is the plan's; every rank takes the same probe steps.
"""

from __future__ import annotations

from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.nn.slots import SlotMap, slot_maps
from poise.runtime.control.evidence import Evidence, probe_due
from poise.runtime.moves.homes import homes_alone
from poise.runtime.moves.layer_moves import LayerMoves
from poise.runtime.moves.layer_state import same_homes


class ProbeSteps:
    """The probe steps' cadence and state; `every` 0: none."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.episode = 0  # probe steps since plans with replicas took over
        self.settled = False  # the clock has decided in this episode
        self.probing: Plan | None = None  # the probe step now running: its homes-only plan
        self._maps_before: list[list[SlotMap]] = []

    def due(self, step: int, replicas_in_force: bool, plan_since: int) -> bool:
        """Whether the step after boundary `step` is a probe step."""
        return replicas_in_force and probe_due(
            step, plan_since, self.every, self.episode, self.settled
        )

    def note(self, evidence: Evidence | None) -> None:
        """Evidence shared by the leader: once the clock decided, no more probes this episode."""
        self.settled = self.settled or (evidence is not None and evidence.source == "clock")

    def new_episode(self) -> None:
        """A layout without replicas took over: the next plan with replicas starts afresh."""
        self.episode = 0
        self.settled = False

    def begin(self, plan: Plan, spec: ModelSpec, moves: LayerMoves) -> bool:
        """Route the next step on `plan`'s homes alone (waiting for Trans in flight first);
        False (nothing changed) where that would move a home."""
        probe = homes_alone(plan, spec)
        maps = [
            slot_maps(probe.placement, state.index, moves.slots, previous=state.maps)
            for state in moves.layers
        ]
        if not all(same_homes(st.maps, m) for st, m in zip(moves.layers, maps, strict=True)):
            return False
        moves.wait_all()
        self._maps_before = [state.maps for state in moves.layers]
        moves.route(probe, maps)
        self.probing = probe
        self.episode += 1
        return True

    def end(self, plan: Plan, moves: LayerMoves) -> None:
        """Back to `plan`'s routing and slot maps; the boundary then launches its Trans."""
        moves.route(plan, self._maps_before)
        self.probing = None
        self._maps_before = []
