"""`ParallelMoE`: the MoE layer under MP + EP + ESP, with Parm's two dedicated schedules.

Parm (Pan et al., "Parm: Efficient Training of Large Sparsely-Activated Models with Dedicated
Schedules", INFOCOM 2024, arXiv 2407.00599) re-places the collectives of DeepSpeed-MoE's
MP + EP + ESP. Groups are `poise.runtime.parm.groups`'s (MP group = a node of M ranks = the ESP
group; EP groups across nodes). One MoE layer, `T` tokens per node (duplicated on its M ranks
after model-parallel attention), each collective's group in brackets (Order: sort tokens by
expert; I-Order: back to token order, weighted by the router):

    "baseline": Gate(T) - Order - AlltoAll[EP] - ESP-AllGather[MP] - Expert
                - ESP-ReduceScatter[MP] - AlltoAll[EP] - I-Order
    "s1":       MP-Split - Gate(T/M) - Order - AlltoAll[EP] - ESP-AllGather[MP] - Expert
                - ESP-ReduceScatter[MP] - AlltoAll[EP] - I-Order - MP-AllGather[MP]
    "s2":       MP-Split - Gate(T/M) - Order - AlltoAll[EP x ESP] - Expert
                - AlltoAll[EP x ESP] - I-Order (sums the M shards) - MP-AllGather[MP]

"baseline" (DeepSpeed-MoE) gates, sends and computes each duplicated token on all M ranks. The
Parm schedules pause MP (rank `local` keeps `T / M` tokens), so no duplicate is gated, sent or
computed. "s1" runs the inter-node EP all-to-all and the intra-node ESP collectives in turn
(`overlap_degree` n > 1: chunk c+1's all-to-all in flight during chunk c's ESP and experts);
"s2" replaces both by one world all-to-all to the expert's M shards, summed in the combine.
"auto" asks `chooser(ParmShape)` (default `ParmChooser()`) at the first forward, for the
largest token count of any node, and keeps the answer until `rechoose()`; every rank must
choose alike (checked).

S1 and S2 are read as `poise.layouts.parm`'s cost model reads them (from the paper's abstract
and third-party summaries), so the runtime runs what the model prices. Every schedule computes
the single-process `poise.nn.MoE`'s function (dropless; a capacity applies to the tokens each
rank gates, so Parm's schedules drop differently). `aux_loss` is that of this rank's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import ConfigError
from poise.layouts.parm import SCHEDULES, Schedule
from poise.nn import comm
from poise.nn.dispatch import Dispatcher, RankRouting
from poise.nn.experts import Activation, Experts, ExpertsImpl
from poise.nn.moe import expert_generator
from poise.nn.router import Router, Score
from poise.runtime.parm.choice import ParmChooser, ParmShape, ScheduleChooser
from poise.runtime.parm.expert_shard import (
    EXPERT_KEYS,
    EspExpertFn,
    check_full_experts,
    gather_experts,
    hidden_dim,
    shard_experts,
    virtual_experts,
)
from poise.runtime.parm.groups import ParallelGroups
from poise.runtime.parm.tensor_parallel import even_sizes, gather_rows, split_rows, value_or_grad
from poise.util.digest import digest

ScheduleChoice = Literal["baseline", "s1", "s2", "auto"]
PAUSE_MP: frozenset[str] = frozenset({"s1", "s2"})


def check_schedule(name: str, *, allow_auto: bool = True) -> None:
    """Refuse a schedule name other than "baseline", "s1", "s2" (and "auto" when allowed)."""
    allowed = (*SCHEDULES, "auto") if allow_auto else SCHEDULES
    if name not in allowed:
        raise ConfigError(f"must be one of {', '.join(allowed)}, got {name!r}", field="schedule")


class ParallelMoE(nn.Module):
    """The MoE layer under MP + EP + ESP: `forward(x [..., D]) -> [..., D]`, input and output
    duplicated on the MP group.

    Parameters: `router.weight [E, D]` (replicated; drawn from torch's global generator, so
    seed every rank alike) and this rank's expert shards `w_in [E_loc, D, H / M]` (`w_gate`
    likewise for SwiGLU), `w_out [E_loc, H / M, D]`, `E_loc = E / EP`, each expert drawn as
    `poise.nn.MoE` draws it (seeded by `(init_seed, e)`). After forward: `last_schedule`,
    `last_counts [E]` (this rank's gate), `aux_loss`, `balance_loss`, `z_loss`."""

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        num_experts: int,
        top_k: int = 2,
        *,
        groups: ParallelGroups,
        schedule: ScheduleChoice = "auto",
        chooser: ScheduleChooser | None = None,
        activation: Activation = "swiglu",
        score: Score = "softmax",
        renormalize: bool | None = None,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        capacity_factor: float | None = None,
        overlap_degree: int = 1,
        experts_impl: ExpertsImpl = "auto",
        check_finite: bool = True,
        init_seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        groups.check_model(d_expert=d_expert, num_experts=num_experts)
        check_schedule(schedule)
        self.groups = groups
        self.schedule: ScheduleChoice = schedule
        self.chooser = chooser
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.d_expert = int(d_expert)
        self.experts_per_node = self.num_experts // groups.ep
        self.check_finite = check_finite
        self.init_seed = int(init_seed)
        self.router = Router(
            d_model,
            num_experts,
            top_k,
            score=score,
            renormalize=renormalize,
            balance_coef=balance_coef,
            z_loss_coef=z_loss_coef,
            capacity_factor=capacity_factor,
            device=device,
            dtype=dtype,
        )
        E_loc, M = self.experts_per_node, groups.mp
        self.experts = Experts(
            E_loc, d_model, d_expert // M, activation, impl=experts_impl, device=device, dtype=dtype
        )
        # baseline and s1: EP all-to-all inside the EP group (node n is EP rank n)
        self.ep_dispatcher = Dispatcher(num_experts, top_k, groups.ep_group, overlap_degree)
        self.ep_routing = RankRouting.static(num_experts, groups.ep, groups.node, E_loc)
        # s2: one all-to-all over the world to the E * M virtual experts (shards)
        world_group = dist.group.WORLD if groups.world_group is None else groups.world_group
        self.world_dispatcher = Dispatcher(num_experts * M, top_k * M, world_group, overlap_degree)
        self.world_routing = RankRouting.static(num_experts * M, groups.world, groups.rank, E_loc)
        self._esp = {dup: EspExpertFn(self.experts, groups, dup) for dup in (False, True)}
        self._choice: Schedule | None = None
        self.last_schedule: Schedule | None = None
        self.last_counts = torch.zeros(num_experts, dtype=torch.long)
        self.aux_loss = self.balance_loss = self.z_loss = torch.zeros(())
        self.reset_experts()

    @property
    def d_model(self) -> int:
        return self.experts.d_model

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def reset_experts(self) -> None:
        """Draw each held expert whole (as `poise.nn.MoE` does) and keep this rank's shard."""
        full = Experts(1, self.d_model, self.d_expert, self.experts.activation)
        first = self.groups.node * self.experts_per_node
        width = self.d_expert // self.groups.esp
        lo = self.groups.local * width
        for slot in range(self.experts_per_node):
            full.init_slot(0, expert_generator(self.init_seed, first + slot))
            for name in EXPERT_KEYS:
                w = getattr(full, name)
                if w is not None:
                    part = w[0].narrow(hidden_dim(name) - 1, lo, width)
                    getattr(self.experts, name)[slot].copy_(part)

    @torch.no_grad()
    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Shard the state dict of a single-process `poise.nn.MoE` (static layout, all `E`
        experts in its slots): `router.weight [E, D]`, `experts.w_in [E, D, H]`, ..."""
        self.router.weight.copy_(sd["router.weight"])
        if self.router.expert_bias is not None and "router.expert_bias" in sd:
            self.router.expert_bias.copy_(sd["router.expert_bias"])
        names = [n for n in EXPERT_KEYS if getattr(self.experts, n) is not None]
        full = {n: sd[f"experts.{n}"] for n in names if f"experts.{n}" in sd}
        check_full_experts(full, self.num_experts, self.d_model, self.d_expert, "w_gate" in names)
        for name, w in shard_experts(full, self.groups).items():
            getattr(self.experts, name).copy_(w)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The single-process layer's state dict (or gradients) in full shape: a collective
        over the MP and EP groups."""
        out = {"router.weight": value_or_grad(self.router.weight, grads).clone()}
        for name, t in gather_experts(self.experts, self.groups, grads).items():
            out[f"experts.{name}"] = t
        return out

    # ------------------------------------------------------------------ schedule
    def shape(self, tokens: int, dtype: torch.dtype) -> ParmShape:
        """What the chooser sees for a step of `tokens` tokens per node in `dtype`."""
        g = self.groups
        return ParmShape(
            tokens=int(tokens),
            d_model=self.d_model,
            d_expert=self.d_expert,
            num_experts=self.num_experts,
            top_k=self.top_k,
            capacity_factor=self.router.capacity_factor,
            mp=g.mp,
            esp=g.esp,
            ep=g.ep,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        )

    def resolve_schedule(self, tokens: int, dtype: torch.dtype) -> Schedule:
        """The schedule of this step (`tokens` tokens per node in `dtype`): the fixed one, or
        the chooser's under "auto". At the first forward after construction or `rechoose`, a
        collective: all ranks must agree on the layer and router weights and, under "auto", on
        the choice for the largest token count of any node (`ConfigError` otherwise)."""
        if self._choice is None:
            group = self.groups.world_group
            what = "MoE configuration or router weights"
            largest = _check_same(self.config_digest(), what, group, int(tokens))
            if self.schedule == "auto":
                choice = (self.chooser or ParmChooser())(self.shape(largest, dtype))
                check_schedule(choice, allow_auto=False)
                _check_same(SCHEDULES.index(choice), "schedule choice", group)
                self._choice = choice  # type: ignore[assignment]
            else:
                self._choice = self.schedule  # type: ignore[assignment]
        return self._choice  # type: ignore[return-value]

    def rechoose(self) -> None:
        """Check the ranks and choose again at the next forward (on every rank, e.g. when the
        batch shape changes)."""
        self._choice = None

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., D]` (duplicated on the MP group) -> `y` of the same shape (duplicated)."""
        if x.shape[-1] != self.d_model:
            raise ConfigError(
                f"input's last dimension is {x.shape[-1]}, the layer's d_model {self.d_model}",
                field="moe.input",
            )
        tokens = x.reshape(-1, x.shape[-1])
        schedule = self.resolve_schedule(tokens.shape[0], tokens.dtype)
        # checked on the node's duplicated tokens, so every rank's dispatcher raises alike
        nonfinite = self.check_finite and not bool(torch.isfinite(tokens).all())
        if schedule == "baseline":
            y = self._ep(tokens, nonfinite, dup=True)
        else:
            sizes = even_sizes(tokens.shape[0], self.groups.mp)
            mine = split_rows(tokens, sizes, self.groups.mp_group)  # MP-Split
            y = (
                self._ep(mine, nonfinite, dup=False)
                if schedule == "s1"
                else self._s2(mine, nonfinite)
            )
            y = gather_rows(y, sizes, self.groups.mp_group)  # MP-AllGather
        self.last_schedule = schedule
        return y.view(x.shape)

    def _gate(self, tokens: torch.Tensor) -> Any:
        routing = self.router(tokens)
        self.last_counts = routing.counts.detach()
        self.aux_loss = routing.aux_loss
        self.balance_loss = routing.balance_loss
        self.z_loss = routing.z_loss
        return routing

    def _ep(self, tokens: torch.Tensor, nonfinite: bool, dup: bool) -> torch.Tensor:
        """Schedules baseline and s1 from the gate on (ESP collectives in `self._esp[dup]`)."""
        r = self._gate(tokens)
        return self.ep_dispatcher(
            tokens, r.experts, r.weights, r.keep, self.ep_routing, self._esp[dup], nonfinite
        )

    def _s2(self, tokens: torch.Tensor, nonfinite: bool) -> torch.Tensor:
        """Schedule s2 from the gate on: each choice's router weight repeated over its M shards."""
        r = self._gate(tokens)
        M = self.groups.mp
        experts = virtual_experts(r.experts, self.experts_per_node, M)
        weights = r.weights.repeat_interleave(M, dim=1)
        keep = None if r.keep is None else r.keep.repeat_interleave(M, dim=1)
        return self.world_dispatcher(
            tokens, experts, weights, keep, self.world_routing, self.experts, nonfinite
        )

    def config_digest(self) -> int:
        """A digest of what every rank must agree on: options, shapes, the router's weights."""
        r, e = self.router, self.experts
        return digest(
            e.d_model, self.d_expert, self.num_experts, self.top_k, e.activation, r.score,
            r.renormalize, r.capacity_factor, self.schedule, self.ep_dispatcher.overlap_degree,
            str(e.w_in.dtype), self.groups.mp, self.groups.ep, r.weight,
        )  # fmt: skip

    def extra_repr(self) -> str:
        g = self.groups
        return f"schedule={self.schedule!r}, mp={g.mp}, esp={g.esp}, ep={g.ep}"


def _check_same(value: int, what: str, group: Any, tokens: int = 0) -> int:
    """Raise `ConfigError` on every rank when ranks of `group` hold different `value`s; else
    the largest `tokens` of any rank (the same all-reduce)."""
    t = torch.tensor([value, -value, tokens], dtype=torch.int64)
    comm.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != value or int(-t[1]) != value:
        raise ConfigError(
            f"ranks disagree on the {what} (build and seed every rank alike)", field="moe"
        )
    return int(t[2])
