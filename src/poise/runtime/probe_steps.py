"""Probe steps: now and then, a step on the plan's homes without its replicas, so that the
guard's wall clock can compare it with its neighbours (`poise.runtime.verdict`, `paired_clock`).

While a plan with replicas is in force (an *episode*), the step after boundary `s` is a probe
when `(s - plan_since) % every == every // 2`, counted from the boundary where the plan took
force (`plan_since`): a plan adopted at a re-plan boundary then gets `MIN_PROBES` probes (with
`every` 5 and `replan_every` 10: after boundaries 2, 7, 12 and 17 steps on) before the second
re-plan after it, whose verdict can settle the clock, and no probe falls on a re-plan boundary
(where the count from the run's start put the 4th probe after it: `skewed` adopted at 11,
probed after 17, 22, 27, 32 and 37, and settled at the re-plan of 41 on 5), the plan has run a
settled step (`s - plan_since >= 2`), fewer than
`max_probes` probes were taken in the episode, and no verdict shared in it was conclusive on
them (`verdict.clock_settled`: more probes would only confirm it, each at the price of the
replicas' saving once). A probe step routes every token to its expert's home
(`homes.homes_alone`): the homes keep their slots, the replica slots idle, no Trans before it
and no Agg in it; nothing moves, so the mathematics is the plan's. Every rank takes the same
probe steps (the same boundaries, plans and shared verdicts)."""

from __future__ import annotations

from poise.core.placement import Plan
from poise.core.spec import ModelSpec
from poise.nn.slots import SlotMap, slot_maps
from poise.runtime.moves.homes import homes_alone
from poise.runtime.moves.layer_moves import LayerMoves
from poise.runtime.moves.layer_state import same_homes
from poise.runtime.verdict import Verdict, clock_settled


class ProbeSteps:
    """The probe steps' cadence and state (module docstring); `every` 0: none."""

    def __init__(self, every: int, max_probes: int) -> None:
        self.every = every
        self.max_probes = max_probes
        self.episode = 0  # probe steps since plans with replicas took over
        self.settled = False  # a verdict shared in the episode was conclusive on its probes
        self.probing: Plan | None = None  # the probe step now running: its homes-only plan
        self._maps_before: list[list[SlotMap]] = []

    def due(self, step: int, replicas_in_force: bool, plan_since: int) -> bool:
        """Whether the step after boundary `step` is a probe step (module docstring)."""
        return (
            self.every > 0
            and replicas_in_force
            and step - plan_since >= 2
            and (step - plan_since) % self.every == self.every // 2
            and self.episode < self.max_probes
            and not self.settled
        )

    def note_verdict(self, verdict: Verdict | None) -> None:
        """A verdict shared by the leader: once one is conclusive, no more probes this
        episode."""
        self.settled = self.settled or clock_settled(verdict)

    def new_episode(self) -> None:
        """A layout without replicas took over: the next plan with replicas starts afresh."""
        self.episode = 0
        self.settled = False

    def begin(self, plan: Plan, spec: ModelSpec, moves: LayerMoves) -> bool:
        """Route the next step on `plan`'s homes alone (waiting for Trans in flight first);
        False (nothing changed) if that would move a home (`slot_maps` keeps homes in place,
        so never expected)."""
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
        """Back to `plan`'s routing and slot maps; the boundary then launches the replicas'
        Trans as every boundary does."""
        moves.route(plan, self._maps_before)
        self.probing = None
        self._maps_before = []


__all__ = ["ProbeSteps"]
