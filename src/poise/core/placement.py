"""Placements, assignments and plans: where experts live and where tokens go.

- `Placement`: `home[L, E]` (owner device of each expert) and `copies[L, D, E]` (how many copies of
  expert e device d holds: its home copy plus replicas). A device's copies never exceed
  `slots_per_device`.
- `Assignment`: `weights[L, E, D]`: how the tokens of a source that holds *no* copy of expert e are
  split among e's holders. A source that holds a copy keeps its own tokens (no transfer). Weights
  are zero off the holders and sum to one per (layer, expert): tokens are conserved. Optionally
  (HybridEP's domain-local routing; the static baseline's DeepSpeed-MoE expert-parallel groups,
  `poise.core.static_ep`) `group_weights[L, E, D]` with `group_size`: a source in a
  group (a contiguous run of `group_size` devices) whose group weights for e sum to one splits its
  tokens inside its group by them instead; elsewhere the global `weights` apply. With
  `by_counts` (per-step splitting, `poise.core.token_split`) the weights are where each step
  starts: the executors split the tokens of every replicated expert by that step's actual
  counts (`resolve`), where a holder may also shed some of its own tokens to the other holders
  (`shed[L, D, E]`, the share of its own tokens a holder sends away; only a step's resolved
  assignment has it).
- `Transfers`: what a plan costs to set up and to keep each step, in bytes: Trans (weights to
  replicas, every step), Agg (replica gradients back, every step), migrations (home changes, once,
  with optimizer state).
- `Plan`: all of the above plus the policy's name, the predicted cost and notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poise.core.errors import PlanError
from poise.core.spec import ModelSpec
from poise.core.token_split import split_routes, split_weights
from poise.core.water_fill import balanced_weights
from poise.util.digest import digest

_TOL = 1e-9


@dataclass
class Placement:
    """`home[l, e]`: device owning expert e in layer l. `copies[l, d, e]`: copies of e on d."""

    home: np.ndarray
    copies: np.ndarray
    slots_per_device: int

    @property
    def layers(self) -> int:
        return int(self.home.shape[0])

    @property
    def experts(self) -> int:
        return int(self.home.shape[1])

    @property
    def devices(self) -> int:
        return int(self.copies.shape[1])

    @classmethod
    def from_homes(cls, home: np.ndarray, devices: int, slots_per_device: int) -> Placement:
        """Only home copies: `home[L, E]` int."""
        home = np.asarray(home, dtype=np.int64)
        L, E = home.shape
        copies = np.zeros((L, devices, E), dtype=np.int32)
        copies[np.arange(L)[:, None], home, np.arange(E)[None, :]] = 1  # one home per (l, e)
        return cls(home=home, copies=copies, slots_per_device=slots_per_device)

    def holders(self) -> np.ndarray:
        """`[L, D, E]` bool: device d holds at least one copy of expert e."""
        return self.copies > 0

    def replicas(self) -> np.ndarray:
        """`[L, D, E]` bool: device d holds e and is not its home."""
        rep = self.copies > 0
        L, E = self.home.shape
        rep[np.arange(L)[:, None], self.home, np.arange(E)[None, :]] = False
        return rep

    def slots_used(self) -> np.ndarray:
        """`[L, D]` copies held per device."""
        return self.copies.sum(axis=2)

    def copy(self) -> Placement:
        return Placement(self.home.copy(), self.copies.copy(), self.slots_per_device)

    def take_layers(self, layers: np.ndarray | list[int]) -> Placement:
        idx = np.asarray(layers)
        return Placement(self.home[idx], self.copies[idx], self.slots_per_device)

    def validate(self) -> None:
        """Every expert has a holder (its home), slots are respected, shapes agree."""
        if self.home.ndim != 2 or self.copies.ndim != 3:
            raise PlanError("home must be [L, E] and copies [L, D, E]", field="placement")
        L, E = self.home.shape
        if self.copies.shape[0] != L or self.copies.shape[2] != E:
            raise PlanError(
                f"copies shape {self.copies.shape} disagrees with home {self.home.shape}",
                field="placement.copies",
            )
        D = self.devices
        if self.home.size and (self.home.min() < 0 or self.home.max() >= D):
            raise PlanError(f"home device out of range [0, {D})", field="placement.home")
        if self.copies.size and self.copies.min() < 0:
            raise PlanError("negative copy count", field="placement.copies")
        homes_held = np.take_along_axis(self.copies, self.home[:, None, :], axis=1)[:, 0, :]
        if np.any(homes_held < 1):
            layer, expert = np.argwhere(homes_held < 1)[0]
            raise PlanError(
                f"layer {layer} expert {expert}: home device holds no copy", field="placement.home"
            )
        used = self.slots_used()
        if used.size and used.max() > self.slots_per_device:
            layer, device = np.unravel_index(int(used.argmax()), used.shape)
            raise PlanError(
                f"layer {layer} device {device} holds {int(used.max())} copies, more "
                f"than {self.slots_per_device} slots",
                field="placement.slots",
            )


def _check_only_holders(w: np.ndarray, placement: Placement, what: str, field: str) -> None:
    """Refuse shares `w[L, E, D]` that send tokens to a device holding no copy of the expert."""
    off = (w > _TOL) & (placement.copies.transpose(0, 2, 1) == 0)
    if off.any():
        layer, expert, device = np.argwhere(off)[0]
        raise PlanError(
            f"layer {layer} expert {expert}: {what} sent to device {device}, which holds no copy",
            field=field,
        )


@dataclass
class Assignment:
    """`weights[l, e, d]`: share of a non-holding source's tokens for expert e sent to device d.

    Group-local routing (optional: HybridEP's domains; DeepSpeed-MoE's expert-parallel groups of
    the static baseline with more devices than experts, `poise.core.static_ep`): `group_size`
    G > 0 cuts the devices into contiguous groups `g(d) = d // G` (a domain, a node, or an EP
    group of E devices; the cost model needs a group to lie in one node, or to be whole nodes
    of one domain, or whole domains, `cost.traffic`); `group_weights[l, e, d]` is zero off the
    holders and, per (layer, expert, group), sums to one (the group routes e's tokens locally)
    or to zero (it does not). A non-holding source s whose group routes e locally sends its
    tokens to the holders inside g(s) in proportion to `group_weights`; every other source uses
    `weights`:

        share(s -> d) = gw[e, d] * [g(d) = g(s)]   if sum_{d' in g(s)} gw[e, d'] = 1
                      = w[e, d]                     otherwise

    Without groups (the default) this is the plain per-expert `weights` rule. Consumers should go
    through `received`, `split` or `traffic.level_traffic`, which apply both rules.

    `by_counts` (per-step splitting; experts no group routes locally): each step's tokens of a
    replicated expert are split among its holders by that step's counts to level the device
    loads (`poise.core.token_split`), starting from `weights`; `resolve(placement, counts)` is
    the plain assignment a step runs under. It may carry `shed[L, D, E]`: holder d sends that
    share of its own tokens of e away, split by `weights` like a non-holder's (a shedding
    holder's own weight is zero); None (every plan's assignment): holders keep their own.
    `received` and `split` apply it; the cost model's `PlanPricer` resolves it per priced step;
    the runtime's dispatcher computes the same integer routes on every rank from the gathered
    counts."""

    weights: np.ndarray
    group_weights: np.ndarray | None = None
    group_size: int = 0
    by_counts: bool = False
    shed: np.ndarray | None = None

    @property
    def grouped(self) -> bool:
        return self.group_weights is not None and self.group_size > 0

    def with_split(self, on: bool = True) -> Assignment:
        """This assignment with per-step splitting on (or off)."""
        if on == self.by_counts:
            return self
        return Assignment(self.weights, self.group_weights, self.group_size, by_counts=on)

    def global_only(self) -> np.ndarray:
        """`[L, E]` bool: experts that no group routes locally (all, without groups): those
        that split by counts under `by_counts`; group-local routing keeps its locality."""
        return ~self.local_mask().any(axis=2)

    def resolve(self, placement: Placement, counts: np.ndarray) -> Assignment:
        """The assignment a step with `counts[L, D, E]` runs under: with `by_counts`, `weights`
        of the experts in `global_only` split by the counts (`token_split.split_weights`),
        started from the plan's own split; else this one. Real shares: the runtime's integer
        routes (`split`) differ by rounding only."""
        if not self.by_counts:
            return self
        fixed = self.with_split(False)
        held = placement.holders()
        start = np.where(held, fixed.received(placement, counts) - np.where(held, counts, 0), 0.0)
        weights, shed = split_weights(
            placement.copies, self.weights, counts, start, self.global_only()
        )
        return Assignment(
            weights, self.group_weights, self.group_size, shed=shed if shed.any() else None
        )

    def remote(self, held: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """`[L, D, E]` float tokens that leave their source: all of a non-holder's, the shed
        share of a holder's (none without `shed`), for the holder mask `held[L, D, E]`."""
        if self.shed is None:
            return np.where(held, 0.0, counts)
        return np.where(held, np.asarray(counts, dtype=np.float64) * self.shed, counts)

    def _group_sums(self) -> np.ndarray:
        """`[L, E, n_groups]` sum of `group_weights` over each group's devices."""
        assert self.group_weights is not None
        L, E, D = self.group_weights.shape
        # einsum: several times faster than .sum over a short last axis.
        by_group = self.group_weights.reshape(L, E, D // self.group_size, self.group_size)
        return np.einsum("legi->leg", by_group)

    def local_mask(self) -> np.ndarray:
        """`[L, E, D]` bool: source d routes expert e inside its group (False without groups)."""
        if not self.grouped:
            return np.zeros(self.weights.shape, dtype=bool)
        return np.repeat(self._group_sums() > 0.5, self.group_size, axis=2)

    def source_local(self) -> np.ndarray:
        """`local_mask` as `[L, D, E]` (per source device), C-contiguous."""
        if not self.grouped:
            return np.zeros(self.weights.shape, dtype=bool).transpose(0, 2, 1)
        return np.repeat((self._group_sums() > 0.5).transpose(0, 2, 1), self.group_size, axis=1)

    def source_weights(self) -> np.ndarray:
        """Per-source weights `[L, D, E, D]` (layer, source device, expert, destination
        device): `source_weights()[l, s]` is the `[E, D]` weights source s applies to its remote
        tokens, with both rules applied (`weights` where s routes globally, `group_weights` inside
        its group where it routes locally). The last two axes keep the `[E, D]` order of
        `weights`. Memory L*D*E*D: for the live runtime's handful of ranks."""
        L, E, D = self.weights.shape
        w = np.broadcast_to(self.weights[:, None, :, :], (L, D, E, D))
        if not self.grouped:
            return np.array(w)
        assert self.group_weights is not None
        group = np.arange(D) // self.group_size
        same = (group[:, None] == group[None, :])[None, :, None, :]  # [1, Ds, 1, Dd]
        local = self.local_mask().transpose(0, 2, 1)[..., None]  # [L, Ds, E, 1]
        gw = self.group_weights[:, None, :, :] * same
        return np.where(local, gw, w)

    @classmethod
    def group_local(
        cls, placement: Placement, group_size: int, base: Assignment | None = None
    ) -> Assignment:
        """Every group holding a copy of e routes its sources' tokens for e to those copies (split
        by copies); sources in groups without a copy follow `base` (default: `to_home`)."""
        base = base if base is not None else cls.to_home(placement)
        L, D, E = placement.copies.shape
        if group_size < 1 or D % group_size:
            raise PlanError(
                f"group size {group_size} does not divide {D} devices",
                field="assignment.group_size",
            )
        copies = placement.copies
        per_group = copies.reshape(L, D // group_size, group_size, E).sum(axis=2)  # [L, G, E]
        # Holder d of e gets copies[d, e] / (copies of e in its group); zero elsewhere.
        flat = np.flatnonzero(copies != 0)  # (a bool mask: np.flatnonzero of ints is slow)
        layer, device, expert = flat // (D * E), flat // E % D, flat % E
        gw = np.zeros((L, E, D))
        gw[layer, expert, device] = copies.ravel()[flat].astype(np.float64) / per_group[
            layer, device // group_size, expert
        ].astype(np.float64)
        return cls(base.weights, gw, group_size)

    @classmethod
    def even(cls, placement: Placement) -> Assignment:
        """Remote tokens split over holders in proportion to their copies."""
        c = placement.copies.transpose(0, 2, 1).astype(np.float64)
        return cls(c / c.sum(axis=2, keepdims=True))

    @classmethod
    def to_home(cls, placement: Placement) -> Assignment:
        """Remote tokens all go to the home (Pro-Prophet, FasterMoE: replicas serve only their
        own device's tokens)."""
        L, E = placement.home.shape
        w = np.zeros((L, E, placement.devices))
        w[np.arange(L)[:, None], np.arange(E)[None, :], placement.home] = 1.0
        return cls(w)

    @classmethod
    def balanced(cls, placement: Placement, loads: np.ndarray) -> Assignment:
        """Remote tokens split to level the expected per-copy load of each expert.

        Holder d of expert e first keeps its own tokens `loads[l, d, e]`; the remote total is then
        water-filled onto the holders with the least tokens of e, so the most loaded copy of e
        carries as little as possible. `loads`: `[L, D, E]`."""
        copies = placement.copies
        L, D, E = copies.shape
        held = copies > 0  # [L, D, E]
        if L == 1 or D == 1:  # the memory order `balanced_weights` gives these shapes
            weights = np.zeros((L, D, E)).transpose(0, 2, 1).reshape(-1, D).reshape(L, E, D)
        else:
            weights = np.zeros((L, E, D))
        flat = np.flatnonzero(held)
        weights[flat // (D * E), flat % E, flat // E % D] = 1.0  # one holder: all to it
        # Only experts with several holders are water-filled (`balanced_weights` on their rows
        # alone gives the rows it gives them among all experts).
        multi = np.flatnonzero((held.sum(axis=1) > 1).ravel())
        if multi.size:
            layer, expert = np.divmod(multi, E)
            remote = np.where(held, 0.0, loads).sum(axis=1)[layer, expert]
            by_device = np.asarray(loads).transpose(1, 0, 2)[:, layer, expert]  # [D, M]
            held_m = copies.transpose(1, 0, 2)[:, layer, expert] > 0
            local = np.ascontiguousarray(np.where(held_m, by_device, 0.0).T)  # [M, D]
            copies_m = np.ascontiguousarray(
                copies.transpose(1, 0, 2)[:, layer, expert].T.astype(np.float64)
            )
            weights[layer, expert] = balanced_weights(local, remote, copies_m)
        return cls(weights)

    def copy(self) -> Assignment:
        """This assignment with copies of its arrays, each in the same memory layout."""

        def own(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a.copy(order="K")

        return Assignment(
            own(self.weights), own(self.group_weights), self.group_size, self.by_counts,
            own(self.shed),
        )  # fmt: skip

    def take_layers(self, layers: np.ndarray | list[int]) -> Assignment:
        idx = np.asarray(layers)
        gw = None if self.group_weights is None else self.group_weights[idx]
        shed = None if self.shed is None else self.shed[idx]
        return Assignment(self.weights[idx], gw, self.group_size, self.by_counts, shed)

    @classmethod
    def from_layers(cls, picks: list[tuple[Assignment, int]]) -> Assignment:
        """Stack layer `l` of each `(assignment, l)` into one assignment (e.g. `auto` choosing
        per layer). Group-local routing is kept; layers picked from ungrouped assignments get zero
        group weights (global routing). All grouped picks must share one group size. The
        result splits by counts (`by_counts`) when every pick does, and sheds where a pick does."""
        weights = np.stack([a.weights[layer] for a, layer in picks])
        sizes = {a.group_size for a, _ in picks if a.grouped}
        by_counts = all(a.by_counts for a, _ in picks)
        shed = None
        if any(a.shed is not None for a, _ in picks):
            shed = np.stack(
                [
                    a.shed[layer] if a.shed is not None else np.zeros(a.weights[layer].shape[::-1])
                    for a, layer in picks
                ]
            )
        if not sizes:
            return cls(weights, by_counts=by_counts, shed=shed)
        if len(sizes) > 1:
            raise PlanError(
                f"cannot stack group sizes {sorted(sizes)}", field="assignment.group_size"
            )
        gw = np.stack(
            [
                a.group_weights[layer]
                if a.grouped and a.group_weights is not None
                else np.zeros_like(a.weights[layer])
                for a, layer in picks
            ]
        )
        return cls(weights, gw, sizes.pop(), by_counts, shed)

    def validate(self, placement: Placement) -> None:
        w = self.weights
        L, E = placement.home.shape
        if w.shape != (L, E, placement.devices):
            raise PlanError(
                f"weights shape {w.shape} != {(L, E, placement.devices)}",
                field="assignment.weights",
            )
        if not _finite_non_negative(w):
            raise PlanError("weights must be finite and non-negative", field="assignment.weights")
        _check_only_holders(w, placement, "tokens", "assignment.weights")
        sums = np.einsum("led->le", w)  # a tolerance check: einsum beats .sum on short rows
        if np.any(np.abs(sums - 1.0) > 1e-6):
            layer, expert = np.argwhere(np.abs(sums - 1.0) > 1e-6)[0]
            raise PlanError(
                f"layer {layer} expert {expert}: shares sum to {sums[layer, expert]}, "
                f"not 1 (tokens not conserved)",
                field="assignment.weights",
            )
        if self.shed is not None:
            self._validate_shed(placement)
        if self.group_weights is None:
            return
        gw = self.group_weights
        D = placement.devices
        if self.group_size < 1 or D % self.group_size:
            raise PlanError(
                f"group size {self.group_size} does not divide {D} devices",
                field="assignment.group_size",
            )
        if gw.shape != w.shape:
            raise PlanError(
                f"group_weights shape {gw.shape} != {w.shape}", field="assignment.group_weights"
            )
        if not _finite_non_negative(gw):
            raise PlanError(
                "group weights must be finite and non-negative", field="assignment.group_weights"
            )
        _check_only_holders(gw, placement, "group tokens", "assignment.group_weights")
        gsum = self._group_sums()
        bad = np.minimum(np.abs(gsum), np.abs(gsum - 1.0)) > 1e-6
        if np.any(bad):
            layer, expert, group = np.argwhere(bad)[0]
            raise PlanError(
                f"layer {layer} expert {expert} group {group}: group shares sum to "
                f"{gsum[layer, expert, group]}, not 0 or 1",
                field="assignment.group_weights",
            )

    def _validate_shed(self, placement: Placement) -> None:
        assert self.shed is not None
        shape = placement.copies.shape
        if self.shed.shape != shape:
            raise PlanError(f"shed shape {self.shed.shape} != {shape}", field="assignment.shed")
        if not _finite_non_negative(self.shed) or self.shed.max(initial=0.0) > 1.0 + _TOL:
            raise PlanError("shed shares must lie in [0, 1]", field="assignment.shed")
        if np.any((self.shed > _TOL) & ~placement.holders()):
            raise PlanError("a device that holds no copy cannot shed", field="assignment.shed")

    def received(self, placement: Placement, counts: np.ndarray) -> np.ndarray:
        """`[L, D, E]` tokens each device computes for each expert, from `counts[L, D, E]`
        (split by the counts themselves with `by_counts`)."""
        if self.by_counts:
            return self.resolve(placement, counts).received(placement, counts)
        held = placement.holders()
        counts = np.asarray(counts, dtype=np.float64)
        remote = self.remote(held, counts)  # [L, D, E]
        if not self.grouped:
            remote_total = remote.sum(axis=1)  # [L, E]
            out = np.subtract(counts, remote)  # the kept tokens (np.where(held, counts, 0.0))
            out += (self.weights * remote_total[:, :, None]).transpose(0, 2, 1)
            return out
        return self.received_grouped(held, counts, remote, self.source_local())

    def received_grouped(
        self, held: np.ndarray, counts: np.ndarray, remote: np.ndarray, local: np.ndarray
    ) -> np.ndarray:
        """`received` with group-local routing, from the holder mask `held[L, D, E]`, float
        `counts[L, D, E]`, `remote[L, D, E]` (counts of non-holders) and `local[L, D, E]`
        (`source_local`):

            R[d, e] = c[d, e] h[d, e] + w[e, d] * sum_{s not local} remote[s, e]
                      + gw[e, d] * sum_{s in g(d)} remote[s, e]"""
        assert self.group_weights is not None
        L, D, E = remote.shape
        G = self.group_size
        global_total = np.where(local, 0.0, remote).sum(axis=1)  # [L, E]
        group_remote = remote.reshape(L, D // G, G, E).sum(axis=2)  # [L, D / G, E]
        by_group = (
            self.group_weights.reshape(L, E, D // G, G) * group_remote.transpose(0, 2, 1)[..., None]
        )  # [L, E, D / G, G]
        out = np.subtract(counts, remote)  # = np.where(held, counts, 0.0), bit for bit
        out += (self.weights * global_total[:, :, None]).transpose(0, 2, 1)
        out += by_group.reshape(L, E, D).transpose(0, 2, 1)
        return out

    def split(self, placement: Placement, counts: np.ndarray) -> np.ndarray:
        """Integer routes `[L, D_src, E, D_dst]` for integer `counts[L, D, E]`: each source keeps
        what it holds locally and splits the rest by the weights, rounding by largest remainder so
        that every (layer, source, expert) count is conserved exactly. With `by_counts`, those
        routes are where the per-step integer split starts (`token_split.split_routes`). Memory
        is L*D*E*D: meant for the live runtime's handful of ranks, not for cluster-scale
        simulation."""
        routes = self._fixed_split(placement, counts)
        if not self.by_counts:
            return routes
        return split_routes(placement.copies, routes, counts, self.global_only())

    def _fixed_split(self, placement: Placement, counts: np.ndarray) -> np.ndarray:
        """`split` by the fixed weights alone."""
        counts = np.asarray(counts, dtype=np.int64)
        L, D, E = counts.shape
        held = placement.holders()
        routes = np.zeros((L, D, E, D), dtype=np.int64)
        shed = 0 if self.shed is None else np.rint(counts * self.shed).astype(np.int64)
        kept = np.where(held, counts - shed, 0)
        local_idx = np.nonzero(held)
        routes[local_idx[0], local_idx[1], local_idx[2], local_idx[1]] = kept[held]
        remote = counts - kept  # [L, D, E]
        ideal = remote[..., None] * self.source_weights()  # [L, D, E, D]
        base = np.floor(ideal + 1e-9).astype(np.int64)
        short = remote - base.sum(axis=3)
        frac = ideal - base
        # Hand the leftover tokens to the largest remainders (stable: lower device first on ties).
        order = np.argsort(-frac, axis=3, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(np.arange(D), order.shape), axis=3)
        base += (rank < short[..., None]).astype(np.int64)
        return routes + base


def _finite_non_negative(x: np.ndarray) -> bool:
    """Every entry finite and >= -_TOL (NaN and inf show in the minimum or the maximum)."""
    if not x.size:
        return True
    lo, hi = x.min(), x.max()
    return bool(np.isfinite(lo) and np.isfinite(hi) and lo >= -_TOL)


@dataclass
class Transfers:
    """Bytes a plan moves. Trans and Agg recur every step; migrations happen once.

    `trans_bytes[l]`: weights sent from homes to replicas per step; `agg_bytes[l]`: replica
    gradients returned per step; `migrate_bytes[l]`: weights plus optimizer state of experts whose
    home changed; `migrations`: rows (layer, expert, old home, new home)."""

    trans_bytes: np.ndarray
    agg_bytes: np.ndarray
    migrate_bytes: np.ndarray
    migrations: np.ndarray

    @property
    def total_step_bytes(self) -> float:
        return float(self.trans_bytes.sum() + self.agg_bytes.sum())

    @property
    def total_bytes(self) -> float:
        return float(self.trans_bytes.sum() + self.agg_bytes.sum() + self.migrate_bytes.sum())


def transfers_between(previous: Placement | None, new: Placement, spec: ModelSpec) -> Transfers:
    """What `new` costs given the placement before it (None: the start of training, no moves)."""
    replicas = new.replicas().sum(axis=(1, 2)).astype(np.float64)  # [L]
    trans = replicas * spec.expert_bytes
    if previous is None or previous.home.shape != new.home.shape:
        moved = np.zeros((0, 4), dtype=np.int64)
    else:
        layer, expert = np.nonzero(previous.home != new.home)
        moved = np.stack(
            [layer, expert, previous.home[layer, expert], new.home[layer, expert]], axis=1
        ).astype(np.int64)
    migrate = (
        np.bincount(moved[:, 0], minlength=new.layers).astype(np.float64) * spec.migration_bytes
    )
    return Transfers(
        trans_bytes=trans, agg_bytes=trans.copy(), migrate_bytes=migrate, migrations=moved
    )


@dataclass
class Plan:
    """A policy's decision for every MoE layer.

    `trails` (`auto` only): for each candidate policy that builds on the placement in force
    (`policies.base.BUILDS_ON`), that policy's own latest plan, made from its own previous
    one: the plan it would have in force had it run alone. The next `auto` call continues each
    from there, so any rival's own placement stays among its candidates (`policies.auto`)."""

    policy: str
    placement: Placement
    assignment: Assignment
    transfers: Transfers
    cost: Any = None  # cost.PlanCost, filled by the policy runner
    notes: dict[str, Any] = field(default_factory=dict)
    trails: dict[str, Plan] = field(default_factory=dict)

    def validate(self) -> None:
        self.placement.validate()
        self.assignment.validate(self.placement)

    def digest(self) -> int:
        """A 62-bit digest (`poise.util.digest`) of what ranks running the plan must agree on:
        the placement (home, copies) and the assignment (weights, group weights and size)."""
        p, a = self.placement, self.assignment
        parts = [p.home, p.copies, a.weights, a.group_weights, a.group_size]
        if a.shed is not None:  # a step's resolved assignment (plans hold none)
            parts.append(a.shed)
        return digest(*parts, "by_counts") if a.by_counts else digest(*parts)
