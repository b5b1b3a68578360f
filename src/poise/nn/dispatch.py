"""Dispatch and combine: tokens to the ranks and slots holding their experts, and back.

One rank's view of one MoE layer's forward, `T` tokens, `k` choices each, `D` ranks, `P` slots:

1. Sort the `T * k` assignments by expert (stable, so token order is kept inside an expert).
2. Route: `RankRouting.routes(counts)` gives the integer routes `[E, D]` of this rank's counts (the
   `Assignment.split` rule: a rank holding a copy of e keeps its tokens for e; other ranks split
   theirs by the assignment's weights, largest remainder). Inside an expert's run, the first
   `routes[e, 0]` assignments go to rank 0, the next `routes[e, 1]` to rank 1, and so on.
3. Exchange counts: one `all_to_all_single` of `[D, E + 2]` int64 (per destination: the counts
   per expert, a non-finite-input flag and the routing's digest), so every rank knows what it
   receives and every rank raises the same error on bad input or disagreeing routings. Steps 2
   and 3 run on the device (`routes_t`, equal to `RankRouting.routes` element for element);
   then the routes and the received counts are read to the host in one copy
   (`poise.nn.host.read_sizes`): the forward's one host wait, for the split sizes the token
   all-to-all takes as host ints.
   Under a routing that splits by counts (`RankRouting.by_counts`, `Assignment.by_counts`),
   steps 2 and 3 swap: one `all_gather` of every rank's `[E + 2]` (its counts, the flag, the
   digest), then every rank computes all ranks' routes `[D, E, D]` from the same counts with
   the same code (`Assignment.split`: the step's split among the holders, where a holder may
   shed some of its own tokens to the others, `poise.core.token_split`), its own row to send
   and its own column to receive. The gathered counts are the one host read here; the routes
   go back to the device without a wait (`poise.nn.host.upload`).
4. Exchange tokens: `all_to_all_single` with split sizes, rows ordered by (destination, expert).
   With `overlap_degree` n, every (destination, expert) block is cut into n near-equal parts and
   part c of every block travels in chunk c: n token all-to-alls, launched asynchronously, each
   chunk's expert compute starting as soon as it has landed and its results sent back at once.
5. On the receiver, rows are regrouped from (source, expert) to (slot, source) order, the
   experts run, rows go back to (source, expert) order and return by the reverse all-to-all.
6. Combine: each token's `k` outputs are gathered back to token order and summed with the
   router's weights in one batched GEMM (`[T, 1, k] @ [T, k, M]`).

Every permutation is a gather (`index_select`) forward and backward: the permutations and
their inverses are built once per forward on the device with torch ops (`gather_index_t`,
`inverse_t`; the host decides from the sizes alone whether one is the identity and skips it),
so no `index_add`/scatter runs on activations and no index crosses from the host. With one
rank (no process group) steps 2-5 collapse to one sort by slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from poise.core.errors import ConfigError, PlanError, PoiseError
from poise.core.placement import Assignment, Placement
from poise.core.static_ep import static_assignment, static_placement
from poise.nn import comm, host
from poise.nn.async_all_to_all import start_all_to_all, wait_all_to_all
from poise.nn.counts import count_values
from poise.nn.slots import SlotMap, slot_maps
from poise.util.digest import digest

ExpertFn = Callable[[torch.Tensor, torch.Tensor | list[int]], torch.Tensor]


class NonFiniteInputError(PoiseError):
    """NaN or infinity in an MoE layer's input (found in the router's logits)."""


class RoutingMismatchError(PlanError):
    """Ranks run one MoE layer under different routings."""


# ----------------------------------------------------------------------------- routing
@dataclass(frozen=True)
class DeviceTables:
    """A `RankRouting`'s arrays on the layer's device, for building indices there: `held [E]`
    bool, `weights [E, D]` float64, `slot_expert [H]` int64 (the expert of each held slot, in
    slot order), `slot_of [E]` int64 (`RankRouting.slot_of`)."""

    held: torch.Tensor
    weights: torch.Tensor
    slot_expert: torch.Tensor
    slot_of: torch.Tensor


@dataclass(frozen=True, eq=False)
class RankRouting:
    """One MoE layer's expert routing as rank `rank` sees it.

    - `home [E]`: the owner rank of each expert; `copies [D, E]`: copies per rank;
    - `weights [E, D]`: the share of this rank's tokens for expert e that go to each rank when
      this rank holds no copy of e (`Assignment.source_weights()[layer, rank]`: the plain
      per-expert weights, or the group-local ones where they apply);
    - `slots`: this rank's `SlotMap` (which expert each of its P slots holds);
    - `digest`: what every rank must agree on (home, copies, the assignment's global and group
      weights), compared at every forward; computed from home, copies and weights if 0;
    - `split`: the layer's placement and assignment (one layer each) when the assignment
      splits by counts (`Assignment.by_counts`): routes then come from every rank's counts
      (`routes_all`); None: this rank's routes follow `weights` alone."""

    rank: int
    home: np.ndarray
    copies: np.ndarray
    weights: np.ndarray
    slots: SlotMap
    digest: int = 0
    split: tuple[Placement, Assignment] | None = None
    _tables: dict[str, DeviceTables] = field(default_factory=dict, repr=False)
    # Slot e holds expert e (a host bool, set once: a compiled forward reads it as a constant).
    identity_slots: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()
        identity = np.array_equal(self.slot_of, np.arange(self.num_experts))
        object.__setattr__(self, "identity_slots", bool(identity))
        if not self.digest:
            object.__setattr__(self, "digest", digest(self.home, self.copies, self.weights))

    @property
    def world(self) -> int:
        return int(self.copies.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.home.shape[0])

    @property
    def by_counts(self) -> bool:
        """Routes are split by every rank's counts of the step (`routes_all`)."""
        return self.split is not None

    @property
    def held(self) -> np.ndarray:
        """`[E]` bool: this rank holds a copy of the expert."""
        return self.copies[self.rank] > 0

    @property
    def slot_of(self) -> np.ndarray:
        """`[E]` the slot holding each expert on this rank, -1 where none does."""
        return self.slots.slot_of(self.num_experts)

    def tables(self, device: torch.device) -> DeviceTables:
        """This routing's tables on `device` (uploaded once per routing and device, without a
        host wait; every forward after reads them there)."""
        key = str(device)
        if key not in self._tables:
            held_slots = np.flatnonzero(self.slots.expert >= 0)
            self._tables[key] = DeviceTables(
                held=host.upload(self.held, device),
                weights=host.upload(self.weights, device),
                slot_expert=host.upload(self.slots.expert[held_slots], device),
                slot_of=host.upload(self.slot_of, device),
            )
        return self._tables[key]

    @classmethod
    def from_plan(
        cls,
        placement: Placement,
        assignment: Assignment,
        slots: SlotMap,
        rank: int,
        layer: int = 0,
    ) -> RankRouting:
        """Layer `layer` of a plan's placement and assignment, for rank `rank`."""
        weights = assignment.source_weights()[layer, rank]  # [E, D]
        home = np.asarray(placement.home[layer], dtype=np.int64)
        copies = np.asarray(placement.copies[layer], dtype=np.int64)
        shared = [home, copies, np.asarray(assignment.weights[layer], dtype=np.float64)]
        if assignment.grouped and assignment.group_weights is not None:
            shared += [assignment.group_weights[layer], np.array([assignment.group_size])]
        split = None
        # Splitting needs an expert held twice (its holders may shed their own tokens to each
        # other even when every rank holds it): otherwise every route is fixed anyway (a lone
        # holder takes all), and the fixed routes spare the counts' all_gather and the
        # per-step routes.
        holders = (copies > 0).sum(axis=0)  # [E]
        if assignment.by_counts and bool((holders > 1).any()):
            split = (placement.take_layers([layer]), assignment.take_layers([layer]))
            shared.append("by_counts")
        return cls(
            rank=int(rank),
            home=home,
            copies=copies,
            weights=np.asarray(weights, dtype=np.float64),
            slots=slots,
            digest=digest(*shared),
            split=split,
        )

    @classmethod
    def static(cls, num_experts: int, world: int, rank: int, num_slots: int) -> RankRouting:
        """Static EP (`poise.core.static_ep`): experts in contiguous blocks (`e // (E / D)`);
        with more ranks than experts (E dividing D, `poise.nn.moe.check_world`), DeepSpeed-MoE's
        expert-parallel groups (deepspeed/utils/groups.py, `_get_expert_parallel_ranks`): rank
        r holds expert `r mod E` (rank e is the home, the other ranks of its expert-data-parallel
        group replicas) and sends each expert's tokens only to the copy inside its own group of
        E consecutive ranks, rank `(r // E) * E + e`."""
        placement = static_placement(1, num_experts, world, num_slots)
        maps = slot_maps(placement, 0, num_slots)
        return cls.from_plan(placement, static_assignment(placement), maps[rank], rank)

    def validate(self) -> None:
        E, D = self.num_experts, self.world
        if self.copies.shape != (D, E) or self.weights.shape != (E, D):
            raise PlanError(
                f"copies {self.copies.shape} / weights {self.weights.shape} do not fit "
                f"{E} experts on {D} ranks",
                field="routing",
            )
        if not 0 <= self.rank < D:
            raise PlanError(f"rank {self.rank} outside {D} ranks", field="routing.rank")
        slot_of = self.slot_of
        held = self.held
        if np.any(held != (slot_of >= 0)):
            e = int(np.flatnonzero(held != (slot_of >= 0))[0])
            raise PlanError(
                f"rank {self.rank}: expert {e} is {'held' if held[e] else 'not held'} by the "
                f"placement but {'not ' if held[e] else ''}in the slot map",
                field="routing.slots",
            )
        if np.any((self.weights > 1e-9) & (self.copies.T == 0)):
            raise PlanError("assignment sends tokens to a rank without a copy", field="routing")

    def routes(self, counts: np.ndarray) -> np.ndarray:
        """Integer routes `[E, D]` of this rank's `counts [E]`: held experts stay here, the
        rest split by `weights` with largest-remainder rounding (lower rank first on ties),
        exactly as `Assignment.split` does for this source."""
        counts = np.asarray(counts, dtype=np.int64)
        held = self.held
        remote = np.where(held, 0, counts)
        ideal = remote[:, None] * self.weights
        base = np.floor(ideal + 1e-9).astype(np.int64)
        short = remote - base.sum(axis=1)
        order = np.argsort(-(ideal - base), axis=1, kind="stable")
        rank_of = np.empty_like(order)
        np.put_along_axis(rank_of, order, np.arange(self.world)[None, :].repeat(len(counts), 0), 1)
        base += (rank_of < short[:, None]).astype(np.int64)
        base[held, self.rank] += counts[held]
        return base

    def routes_all(self, counts: np.ndarray) -> np.ndarray:
        """Integer routes `[D_src, E, D_dst]` of every rank's `counts [D, E]`: with `by_counts`
        the step's split (`Assignment.split` of the layer), else each rank's `weights` rule
        (valid for this rank's own row only under group-local routing)."""
        counts = np.asarray(counts, dtype=np.int64)
        if self.split is None:
            raise PlanError("this routing does not split by counts", field="routing")
        placement, assignment = self.split
        return assignment.split(placement, counts[None])[0]


# ----------------------------------------------------------------------------- index helpers
def gather_index(sizes: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Row indices that read the blocks `blocks` (flat block ids, in the wanted order) out of a
    buffer of consecutive blocks of lengths `sizes` (flat, in buffer order)."""
    sizes = np.asarray(sizes, dtype=np.int64).ravel()
    starts = np.cumsum(sizes) - sizes
    lens = sizes[blocks]
    offsets = np.cumsum(lens) - lens
    return np.repeat(starts[blocks] - offsets, lens) + np.arange(int(lens.sum()))


def split_parts(sizes: np.ndarray, parts: int) -> np.ndarray:
    """`[parts, *sizes.shape]`: each size cut into `parts` near-equal parts (earlier parts take
    the remainder)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    c = np.arange(parts).reshape(-1, *([1] * sizes.ndim))
    return sizes // parts + (c < sizes % parts)


def inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.shape[0])
    return inv


def is_identity_gather(sizes: np.ndarray, blocks: np.ndarray) -> bool:
    """Whether `gather_index(sizes, blocks)` is `arange`: the non-empty blocks, in the wanted
    order, come in buffer order (decided on the host from the sizes alone)."""
    sizes = np.asarray(sizes, dtype=np.int64).ravel()
    kept = blocks[sizes[blocks] > 0]
    return bool(np.all(np.diff(kept) > 0))


def gather_index_t(sizes: torch.Tensor, blocks: torch.Tensor, total: int) -> torch.Tensor:
    """`gather_index` on the device: `sizes [B]` int64, `blocks [K]` int64 on one device,
    `total` (host int) the rows the blocks hold, so `repeat_interleave` needs no host wait."""
    starts = torch.cumsum(sizes, 0) - sizes
    lens = sizes.index_select(0, blocks)
    offsets = torch.cumsum(lens, 0) - lens
    first = starts.index_select(0, blocks) - offsets
    rows = torch.arange(total, device=sizes.device)
    return torch.repeat_interleave(first, lens, output_size=total) + rows


def split_parts_t(sizes: torch.Tensor, parts: int) -> torch.Tensor:
    """`split_parts` on the device: `[parts, *sizes.shape]` int64."""
    c = torch.arange(parts, device=sizes.device).view(-1, *([1] * sizes.dim()))
    return sizes // parts + (c < sizes % parts).long()


def inverse_t(perm: torch.Tensor) -> torch.Tensor:
    """`inverse` on the device."""
    inv = torch.empty_like(perm)
    return inv.index_put_((perm,), torch.arange(perm.shape[0], device=perm.device))


def routes_t(counts: torch.Tensor, tables: DeviceTables, rank: int) -> torch.Tensor:
    """`RankRouting.routes` on the device: `counts [E]` int64 -> routes `[E, D]` int64, equal
    to the host's element for element (the same float64 products and floors; largest
    remainders first, ties to the lower rank, by a stable descending sort as NumPy's stable
    argsort of the negated remainders; no remainder is -0.0, so the GPU's radix sort orders
    them as comparisons do)."""
    held, weights = tables.held, tables.weights
    E, D = weights.shape
    remote = torch.where(held, 0, counts)
    ideal = remote[:, None].to(torch.float64) * weights
    base = torch.floor(ideal + 1e-9).long()
    short = remote - base.sum(dim=1)
    frac = ideal - base  # [E, D] float64
    order = torch.sort(frac, dim=1, descending=True, stable=True).indices
    ranks = torch.arange(D, device=counts.device).expand(E, D)
    place = torch.empty_like(order).scatter_(1, order, ranks)  # d's place in that order
    base = base + (place < short[:, None]).long()
    base[:, rank] += torch.where(held, counts, 0)
    return base


# ----------------------------------------------------------------------------- autograd ops
@dataclass
class TokenIndex:
    """Where each of the `T * k` assignments sits among the `N` rows sent (send order).

    - `send_idx [N]`: the flat assignment (`t * k + j`) of each row; `rows [N]`: its token;
    - `by_choice [k, T]`: the row of assignment (t, j), or `N` where it was dropped.
    Built once per forward from the one sort; every permutation below is a gather with it."""

    send_idx: torch.Tensor
    rows: torch.Tensor
    by_choice: torch.Tensor
    tokens: int
    top_k: int

    @classmethod
    def build(cls, send_idx: torch.Tensor, tokens: int, top_k: int) -> TokenIndex:
        n = send_idx.shape[0]
        inv = torch.full((tokens * top_k,), n, dtype=torch.long, device=send_idx.device)
        inv[send_idx] = torch.arange(n, device=send_idx.device)
        rows = send_idx // top_k if top_k > 1 else send_idx
        return cls(send_idx, rows, inv.view(tokens, top_k).t().contiguous(), tokens, top_k)

    @property
    def dropped(self) -> bool:
        """Some assignments were not sent (capacity)."""
        return self.send_idx.shape[0] != self.tokens * self.top_k


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


def _sum_by_token(
    rows: torch.Tensor, index: TokenIndex, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """`[T, M]`: for each token, the sum over its k choices j of `rows[by_choice[j, t]]`
    (times `weights[t, j]` when given); dropped choices read zero. k gathers, no scatter."""
    if index.dropped:
        rows = _with_zero_row(rows)
    out = rows.index_select(0, index.by_choice[0])
    if weights is not None:
        out.mul_(weights[:, 0:1])
    for j in range(1, index.top_k):
        part = rows.index_select(0, index.by_choice[j])
        if weights is None:
            out.add_(part)
        else:
            out.addcmul_(part, weights[:, j : j + 1])
    return out


class _GatherTokens(torch.autograd.Function):
    """`x [T, M]` -> `x[index.rows] [N, M]`; backward sums each token's rows (`_sum_by_token`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: TokenIndex) -> torch.Tensor:
        ctx.index = index
        return x.index_select(0, index.rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sum_by_token(grad.contiguous(), ctx.index), None


class PermuteRows(torch.autograd.Function):
    """`x[perm]`; backward `grad[inv_perm]` (a bijection both ways)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inv_perm)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inv_perm,) = ctx.saved_tensors
        return grad.index_select(0, inv_perm), None, None


class _Combine(torch.autograd.Function):
    """`out [N, M]` (rows in send order), router weights `w [T, k]` ->
    `y [T, M] = sum_j w[t, j] * out[row of (t, j)]` (dropped assignments add nothing).

    Backward, in send order: `grad_out[i] = w_i * gy[token_i]` and `grad_w_i = out[i] . gy[token_i]`
    from one gather of `gy`."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, w: torch.Tensor, index: TokenIndex) -> torch.Tensor:
        wc = w.to(out.dtype)
        ctx.save_for_backward(out, wc)
        ctx.index = index
        ctx.w_dtype = w.dtype
        return _sum_by_token(out, index, wc)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        out, wc = ctx.saved_tensors
        index: TokenIndex = ctx.index
        gyg = gy.contiguous().index_select(0, index.rows)  # [N, M]
        gw_rows = torch.linalg.vecdot(out, gyg)  # [N]
        if index.dropped:
            gw_rows = torch.cat([gw_rows, gw_rows.new_zeros(1)])
        gw = gw_rows[index.by_choice].t().contiguous().to(ctx.w_dtype)  # [T, k]
        w_rows = wc.view(-1).index_select(0, index.send_idx)
        return gyg.mul_(w_rows.unsqueeze(1)), gw, None


# ----------------------------------------------------------------------------- dispatcher
@dataclass
class _ChunkPlan:
    """Host-side index plan of one token chunk on the receiver."""

    in_splits: list[int]  # rows sent to each rank
    out_splits: list[int]  # rows received from each rank
    regroup: torch.Tensor | None  # (source, expert) -> (slot, source) order; None: identity
    ungroup: torch.Tensor | None
    tokens_per_slot: list[int]
    tokens_t: torch.Tensor  # tokens_per_slot [P] on the device (uploaded without a wait)


@dataclass
class _SendPlan:
    """One forward's send order (`index`) and its chunks' plans."""

    index: TokenIndex
    chunks: list[_ChunkPlan]


class Dispatcher:
    """Moves tokens to the holders of their experts and back, for one layer on one rank.

    `group`: the process group of expert parallelism (None: this process alone, no
    collectives). `overlap_degree`: token chunks pipelined with expert compute (1: none).
    `seconds` holds the last forward's wall time per phase (`dispatch`, `experts`, `combine`)."""

    def __init__(
        self, num_experts: int, top_k: int, group: Any = None, overlap_degree: int = 1
    ) -> None:
        if overlap_degree < 1:
            raise ConfigError(f"must be >= 1, got {overlap_degree}", field="overlap_degree")
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.group = group
        self.world, self.rank = (1, 0) if group is None else world_and_rank(group)
        self.overlap_degree = int(overlap_degree)
        self.seconds: dict[str, float] = {}
        self.rows_computed = 0  # token-expert rows this rank's slots computed in the last call

    def __call__(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None,
        routing: RankRouting,
        expert_fn: ExpertFn,
        nonfinite: bool = False,
        slot_of: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x [T, M]`, `experts [T, k]`, `weights [T, k]`, `keep [T, k] | None` -> `y [T, M]`.

        `expert_fn(rows [R, M], tokens_per_slot [P]) -> [R, M]` runs this rank's slots.
        `slot_of [E]` (int64, on x's device): `routing.slot_of` (the layer's buffer), used by
        the one-process path; None: slot e holds expert e.
        `nonfinite`: this rank's input had NaN/inf; with several ranks every rank raises
        `NonFiniteInputError` after the count exchange (no rank is left waiting)."""
        self.seconds = {}
        if self.world == 1:
            if nonfinite:
                raise NonFiniteInputError(
                    "NaN or infinity in the MoE layer's input", field="moe.input"
                )
            return self._local(x, experts, weights, keep, routing, expert_fn, slot_of)
        return self._distributed(x, experts, weights, keep, routing, expert_fn, nonfinite)

    # ------------------------------------------------------------------ one process
    def _local(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None,
        routing: RankRouting,
        expert_fn: ExpertFn,
        slot_of: torch.Tensor | None,
    ) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        t0 = 0.0 if compiling else time.perf_counter()
        T, k = experts.shape
        P = routing.slots.slots
        if slot_of is None and not routing.identity_slots:
            slot_of = routing.tables(experts.device).slot_of  # a caller without a buffer
        key = experts.reshape(-1) if slot_of is None else slot_of[experts.reshape(-1)]
        if keep is not None:
            key = torch.where(keep.reshape(-1), key, P)
        order = torch.argsort(key, stable=True)
        tokens_per_slot = count_values(key, P + 1)[:P]
        if keep is not None and not compiling:
            order = order[: int(keep.sum())]  # the kept count sizes the buffer: one host wait
        # Compiled with a capacity: every row is sent, the dropped ones last, past the slots'
        # rows (the experts give them 0 and the combine reads 0 for them): static shapes.
        index = TokenIndex.build(order, T, k)
        self.rows_computed = int(order.numel())  # a shape: no host synchronisation
        xs = _GatherTokens.apply(x, index)
        if compiling:
            if keep is None:
                return _Combine.apply(expert_fn(xs, tokens_per_slot), weights, index)
            kept = keep.reshape(-1).index_select(0, order).unsqueeze(1)  # [T k, 1]
            xs = torch.where(kept, xs, 0.0)
            out = torch.where(kept, expert_fn(xs, tokens_per_slot), 0.0)
            return _Combine.apply(out, weights, index)
        t1 = time.perf_counter()
        out = expert_fn(xs, tokens_per_slot)
        t2 = time.perf_counter()
        y = _Combine.apply(out, weights, index)
        t3 = time.perf_counter()
        self.seconds = {"dispatch": t1 - t0, "experts": t2 - t1, "combine": t3 - t2}
        return y

    # ------------------------------------------------------------------ several ranks
    def _distributed(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None,
        routing: RankRouting,
        expert_fn: ExpertFn,
        nonfinite: bool,
    ) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        t0 = 0.0 if compiling else time.perf_counter()
        plan = self._send_plan(experts, keep, routing, nonfinite, x.device)
        send = _GatherTokens.apply(x, plan.index)
        sends = send.split([sum(c.in_splits) for c in plan.chunks])
        if compiling:
            return self._exchange_traced(sends, plan, weights, expert_fn)
        started = [
            start_all_to_all(s, c.out_splits, c.in_splits, self.group)
            for s, c in zip(sends, plan.chunks, strict=True)
        ]
        t_dispatch, t_experts = time.perf_counter() - t0, 0.0
        back = []
        for chunk, st in zip(plan.chunks, started, strict=True):
            t1 = time.perf_counter()
            rows = wait_all_to_all(st)
            if chunk.regroup is not None:
                rows = PermuteRows.apply(rows, chunk.regroup, chunk.ungroup)
            t2 = time.perf_counter()
            out = expert_fn(rows, chunk.tokens_per_slot)
            t3 = time.perf_counter()
            if chunk.regroup is not None:
                out = PermuteRows.apply(out, chunk.ungroup, chunk.regroup)
            back.append(start_all_to_all(out, chunk.in_splits, chunk.out_splits, self.group))
            t_dispatch += t2 - t1
            t_experts += t3 - t2
        t4 = time.perf_counter()
        outs = [wait_all_to_all(b) for b in back]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        y = _Combine.apply(out, weights, plan.index)
        self.seconds = {
            "dispatch": t_dispatch,
            "experts": t_experts,
            "combine": time.perf_counter() - t4,
        }
        return y

    def _exchange_traced(
        self,
        sends: Sequence[torch.Tensor],
        plan: _SendPlan,
        weights: torch.Tensor,
        expert_fn: ExpertFn,
    ) -> torch.Tensor:
        """The token exchange, experts and combine as `torch.compile` traces them: functional
        all-to-alls (`comm.all_to_all_single_traced`, differentiable; the compiler places the
        waits), the slot sizes as device tensors, no host clock."""
        outs = []
        for s, chunk in zip(sends, plan.chunks, strict=True):
            rows = comm.all_to_all_single_traced(s, chunk.out_splits, chunk.in_splits, self.group)
            if chunk.regroup is not None:
                rows = PermuteRows.apply(rows, chunk.regroup, chunk.ungroup)
            out = expert_fn(rows, chunk.tokens_t)
            if chunk.regroup is not None:
                out = PermuteRows.apply(out, chunk.ungroup, chunk.regroup)
            outs.append(
                comm.all_to_all_single_traced(out, chunk.in_splits, chunk.out_splits, self.group)
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return _Combine.apply(out, weights, plan.index)

    @torch.compiler.disable
    def _send_plan(
        self,
        experts: torch.Tensor,
        keep: torch.Tensor | None,
        routing: RankRouting,
        nonfinite: bool,
        device: torch.device,
    ) -> _SendPlan:
        """Steps 1-3 and the index plans: the sort, the count exchange, the forward's one host
        read (`host.read_sizes`) and every index built on the device from it -> `_SendPlan`.

        Never traced (`torch.compiler.disable`): the split sizes it returns are host ints,
        which a traced graph would either break on (`.tolist()`) or carry as data-dependent
        sizes; under `torch.compile` this call is the layer's one graph break (dynamo
        resumes after it with the sizes as plain ints)."""
        E, D, n = self.num_experts, self.world, self.overlap_degree
        T, k = experts.shape
        flat = experts.reshape(-1)
        if keep is not None:
            flat = torch.where(keep.reshape(-1), flat, E)
        order = torch.argsort(flat, stable=True)
        counts = count_values(flat, E + 1)[:E]  # [E] on the device
        if routing.by_counts:
            routes_h, recv_h = self._gather_counts(counts, routing, nonfinite)
            routes = host.upload(routes_h, device)  # no wait: pinned, non-blocking
            recv = host.upload(recv_h, device)
        else:
            routes, recv, routes_h, recv_h = self._exchange_counts(
                counts, routing, nonfinite, device
            )
        # From here on the host knows every size (routes_h [E, D], recv_h [D, E]) and the device
        # holds the same numbers (routes, recv): indices are built there, nothing is read back.
        N = int(routes_h.sum())
        self.rows_computed = int(recv_h.sum())
        parts_h = split_parts(routes_h, n)  # [n, E, D]
        # Sorted buffer: blocks (expert, destination, part); wanted: (part, destination, expert).
        blocks_h = np.arange(E * D * n).reshape(E, D, n).transpose(2, 1, 0).ravel()
        send_idx = order[:N]
        if not is_identity_gather(parts_h.transpose(1, 2, 0), blocks_h):
            sizes = split_parts_t(routes, n).permute(1, 2, 0).reshape(-1)
            blocks = torch.arange(E * D * n, device=device).view(E, D, n).permute(2, 1, 0)
            send_idx = send_idx.index_select(0, gather_index_t(sizes, blocks.reshape(-1), N))
        recv_parts = split_parts_t(recv, n)  # [n, D, E] on the device
        chunks = [
            self._chunk_plan(parts_h[c], p, recv_parts[c], routing, device)
            for c, p in enumerate(split_parts(recv_h, n))
        ]
        return _SendPlan(TokenIndex.build(send_idx, T, k), chunks)

    def _gather_counts(
        self, counts: torch.Tensor, routing: RankRouting, nonfinite: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's counts (one `all_gather` of `[E + 2]` int64 built on the device:
        counts, the non-finite flag, the routing digest; one host read of the `[D, E + 2]`
        gathered), checked as `_exchange_counts` checks -> this rank's routes `[E, D]` and the
        counts it receives `[D, E]`, on the host (`routes_all`: the step's split)."""
        E = self.num_experts
        msg = counts.new_empty(E + 2)
        msg[:E] = counts
        msg[E].fill_(int(nonfinite))  # scalars: no upload
        msg[E + 1].fill_(routing.digest)
        parts = [torch.empty_like(msg) for _ in range(self.world)]
        comm.all_gather(parts, msg, group=self.group)
        every = self._check_received(host.read_sizes(torch.stack(parts)), routing)  # the wait
        all_routes = routing.routes_all(every)  # [D_src, E, D_dst]
        return all_routes[self.rank], all_routes[:, :, self.rank]

    def _exchange_counts(
        self, counts: torch.Tensor, routing: RankRouting, nonfinite: bool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
        """This rank's routes of `counts [E]` (on the device, `routes_t`) and one
        `all_to_all_single` of `[D, E + 2]` int64 built there (per destination: the counts per
        expert, the non-finite flag, the routing digest); then the one host read of both.
        Returns routes `[E, D]` and received counts `[D, E]`, on the device and on the host.
        Raises the same error on every rank on bad input."""
        E, D = self.num_experts, self.world
        routes = routes_t(counts.long(), routing.tables(device), self.rank)  # [E, D]
        msg = routes.new_empty(D, E + 2)
        msg[:, :E] = routes.t()
        msg[:, E].fill_(int(nonfinite))  # scalars: no upload
        msg[:, E + 1].fill_(routing.digest)
        recv = torch.empty_like(msg)
        comm.all_to_all_single(recv, msg, group=self.group)
        both = host.read_sizes(torch.cat([routes.reshape(-1), recv.reshape(-1)]))  # the wait
        routes_h = both[: E * D].reshape(E, D)
        recv_h = self._check_received(both[E * D :].reshape(D, E + 2), routing)
        return routes, recv[:, :E], routes_h, recv_h

    def _check_received(self, got: np.ndarray, routing: RankRouting) -> np.ndarray:
        """`got [D, E + 2]` from the ranks -> their `[D, E]` counts; raises the same error on
        every rank when one had non-finite input or runs another routing."""
        E = self.num_experts
        bad = np.flatnonzero(got[:, E])
        if bad.size:
            raise NonFiniteInputError(
                f"NaN or infinity in the MoE layer's input on rank(s) {bad.tolist()}",
                field="moe.input",
            )
        if np.any(got[:, E + 1] != routing.digest):
            other = np.flatnonzero(got[:, E + 1] != routing.digest).tolist()
            raise RoutingMismatchError(
                f"rank {self.rank}'s routing differs from that of rank(s) {other} "
                "(set_routing must get the same plan on every rank)",
                field="moe.routing",
            )
        return got[:, :E]

    def _chunk_plan(
        self,
        send_parts: np.ndarray,
        recv_parts: np.ndarray,
        recv_parts_t: torch.Tensor,
        routing: RankRouting,
        device: torch.device,
    ) -> _ChunkPlan:
        """`send_parts [E, D]` this rank sends in a chunk, `recv_parts [D, E]` it receives (on
        the host; `recv_parts_t` the same on the device, where the regrouping is built)."""
        E, D = self.num_experts, self.world
        unheld = ~routing.held
        if recv_parts[:, unheld].any():
            e = int(np.flatnonzero(recv_parts[:, unheld].any(axis=0))[0])
            raise RoutingMismatchError(
                f"rank {self.rank} received tokens for expert {np.flatnonzero(unheld)[e]}, "
                "which it does not hold",
                field="moe.routing",
            )
        slot_expert = routing.slots.expert
        held_slots = np.flatnonzero(slot_expert >= 0)
        tokens = np.zeros(routing.slots.slots, dtype=np.int64)
        tokens[held_slots] = recv_parts[:, slot_expert[held_slots]].sum(axis=0)
        # Received buffer: blocks (source, expert); wanted: (slot, source).
        blocks_h = (np.arange(D)[None, :] * E + slot_expert[held_slots][:, None]).ravel()
        regroup = ungroup = None
        if not is_identity_gather(recv_parts, blocks_h):
            experts = routing.tables(device).slot_expert  # [H]
            sources = torch.arange(D, device=device)
            blocks = (sources[None, :] * E + experts[:, None]).reshape(-1)
            regroup = gather_index_t(recv_parts_t.reshape(-1), blocks, int(recv_parts.sum()))
            ungroup = inverse_t(regroup)
        return _ChunkPlan(
            in_splits=send_parts.sum(axis=0).tolist(),
            out_splits=recv_parts.sum(axis=1).tolist(),
            regroup=regroup,
            ungroup=ungroup,
            tokens_per_slot=tokens.tolist(),
            tokens_t=host.upload(tokens, device),
        )


def world_and_rank(group: Any = None) -> tuple[int, int]:
    """`(world size, rank)` of `group`; `(1, 0)` without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


__all__ = [
    "Dispatcher",
    "NonFiniteInputError",
    "PermuteRows",
    "RankRouting",
    "RoutingMismatchError",
    "gather_index",
    "inverse",
    "split_parts",
    "world_and_rank",
]
