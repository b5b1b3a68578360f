"""The MoE layer: router, dispatcher and this rank's expert slots.

    moe = MoE(d_model=512, d_expert=1024, num_experts=8, top_k=2)
    y = moe(x)                      # x [B, S, D] (or [T, D]) -> y of the same shape
    loss = task_loss(y) + moe.aux_loss

Without a process group (or with one rank) the layer holds every expert. With a process group of
W ranks it runs expert parallelism: W must divide E (each rank holds E / W experts), or E must
divide W (expert-data parallelism: each expert on W / E ranks). Each rank feeds its own tokens;
expert weights live in `experts` (`[S, ...]` stacked over this rank's slots) and their gradients
are for those slots. The router is replicated: after `backward`, sum its gradients over the ranks
with `sync_router_grads(model)` (or include it in your data-parallel all-reduce with SUM) to get
the gradient of the sum of the ranks' losses.

Layouts. By default experts sit in contiguous blocks (static EP, `Layout.static`). The runtime
changes where experts live and where tokens go with `set_layout(placement, assignment,
slot_map)`, which takes effect at the next forward; it moves no weights (the runtime's Trans and
migration fill the slots). `last_counts [E]` holds the assignments this rank's router produced in
the last forward (before dispatch and drops), for the balancer to gather; nothing else in
`forward` has balancing side effects. Each expert weight's gradient is accumulated once per
backward (its post-accumulate-grad hooks fire once), also with `overlap_degree > 1`, where
each token chunk runs the experts (autograd sums the chunks' gradients before accumulating).

Checks: the layer's configuration (and router weights) are compared across ranks at the first
forward (`ConfigError` instead of a hang in a collective); inputs with NaN or infinity raise
`NonFiniteInputError` on every rank (`check_finite=False` skips the check); ranks whose layouts
differ raise `LayoutMismatchError`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Assignment, Placement
from poise.nn.dispatch import Dispatcher, Layout, world_and_rank
from poise.nn.experts import Activation, Experts, ExpertsImpl
from poise.nn.router import Router, Score
from poise.nn.slots import SlotMap


def default_slots(num_experts: int, world: int) -> int:
    """Slots per rank of the static layout: `E / W`, or 1 with more ranks than experts."""
    return max(num_experts // world, 1)


def check_world(num_experts: int, world: int) -> None:
    """Refuse worlds that do not fit the experts (W divides E, or E divides W)."""
    if (world <= num_experts and num_experts % world) or (
        world > num_experts and world % num_experts
    ):
        raise ConfigError(
            f"{world} ranks do not fit {num_experts} experts: the world size must divide the "
            f"number of experts, or be a multiple of it",
            field="world_size",
        )


class MoE(nn.Module):
    """A Mixture-of-Experts FFN layer with expert parallelism over `group`.

    `forward(x [..., D]) -> y [..., D]`; after it, `aux_loss` (router's weighted balance + z
    losses), `balance_loss`, `z_loss`, `last_counts [E]`, `last_seconds` (per phase: gate,
    dispatch, experts, combine).

    Arguments: `activation` ("swiglu" | "gelu"), router options (`score`, `renormalize`,
    `balance_coef`, `z_loss_coef`, `expert_bias`, `capacity_factor`; or a ready `router`, e.g. a
    `ReplayRouter`), `num_slots` (expert slots per rank; more than `E / W` leaves room for
    replicas), `overlap_degree` (token all-to-all chunks pipelined with expert compute),
    `experts_impl` ("auto" | "grouped" | "loop"), `check_finite`, `group`, `init_seed` (expert e
    is drawn from a generator seeded by (init_seed, e), so its weights do not depend on the
    layout; default: one draw from torch's global generator)."""

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        num_experts: int,
        top_k: int = 2,
        *,
        activation: Activation = "swiglu",
        score: Score = "softmax",
        renormalize: bool | None = None,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        expert_bias: bool = False,
        capacity_factor: float | None = None,
        router: Router | None = None,
        num_slots: int | None = None,
        overlap_degree: int = 1,
        experts_impl: ExpertsImpl = "auto",
        check_finite: bool = True,
        group: Any = None,
        init_seed: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.world, self.rank = world_and_rank(group)
        check_world(num_experts, self.world)
        need = default_slots(num_experts, self.world)
        slots = need if num_slots is None else int(num_slots)
        if slots < need:
            raise ConfigError(
                f"{num_experts} experts on {self.world} ranks need >= {need} slots, got {slots}",
                field="num_slots",
            )
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.router = router or Router(
            d_model,
            num_experts,
            top_k,
            score=score,
            renormalize=renormalize,
            balance_coef=balance_coef,
            z_loss_coef=z_loss_coef,
            expert_bias=expert_bias,
            capacity_factor=capacity_factor,
            device=device,
            dtype=dtype,
        )
        _check_router(self.router, d_model, num_experts, top_k)
        self.experts = Experts(
            slots, d_model, d_expert, activation, impl=experts_impl, device=device, dtype=dtype
        )
        self.dispatcher = Dispatcher(num_experts, top_k, group, overlap_degree)
        self.check_finite = check_finite
        self.layout = Layout.static(num_experts, self.world, self.rank, slots)
        self.init_seed = _draw_seed() if init_seed is None else int(init_seed)
        self.reset_experts()
        self.last_counts = torch.zeros(num_experts, dtype=torch.long)
        self.bias_counts = torch.zeros(num_experts, dtype=torch.long)
        self.aux_loss = self.balance_loss = self.z_loss = torch.zeros(())
        self.last_seconds: dict[str, float] = {}
        self._checked = self.world == 1

    # ------------------------------------------------------------------ properties
    @property
    def d_model(self) -> int:
        return self.experts.d_model

    @property
    def num_slots(self) -> int:
        return self.experts.num_slots

    @property
    def overlap_degree(self) -> int:
        return self.dispatcher.overlap_degree

    @overlap_degree.setter
    def overlap_degree(self, n: int) -> None:
        if int(n) < 1:
            raise ConfigError(f"must be >= 1, got {n}", field="overlap_degree")
        self.dispatcher.overlap_degree = int(n)

    # ------------------------------------------------------------------ weights and layout
    def reset_experts(self) -> None:
        """Draw every held slot's weights from its expert's own generator; empty slots zero."""
        for slot, e in enumerate(self.layout.slots.expert.tolist()):
            if e < 0:
                with torch.no_grad():
                    for w in self.experts.weights():
                        w[slot].zero_()
                continue
            gen = expert_generator(self.init_seed, e)
            self.experts.init_slot(slot, gen)

    @torch.no_grad()
    def load_expert_weights(self, full: Mapping[str, torch.Tensor]) -> None:
        """Fill every held slot from stacked per-expert weights `full[name] [E, ...]` (names
        `w_in`, `w_gate`, `w_out`, as in `experts`); empty slots are zeroed."""
        for name in ("w_in", "w_gate", "w_out"):
            w = getattr(self.experts, name)
            if w is None:
                continue
            src = full[name]
            if src.shape != (self.num_experts, *w.shape[1:]):
                raise ConfigError(
                    f"{name} must be [{self.num_experts}, {', '.join(map(str, w.shape[1:]))}], "
                    f"got {list(src.shape)}",
                    field=name,
                )
            for slot, e in enumerate(self.layout.slots.expert.tolist()):
                if e >= 0:
                    w[slot].copy_(src[e])
                else:
                    w[slot].zero_()

    def set_layout(
        self,
        placement: Placement,
        assignment: Assignment,
        slot_map: SlotMap,
        layer: int = 0,
    ) -> None:
        """From the next forward on, route by layer `layer` of `placement` (home `[E]`, copies
        `[W, E]`) and `assignment` (weights `[E, W]`), with `slot_map` this rank's slots.

        Routing only: the slots' weights must be put in place by the caller (the runtime's
        Trans and migration, or `load_expert_weights`). Raises `PlanError` when the plan does
        not fit this layer (experts, ranks, slots)."""
        if placement.experts != self.num_experts or placement.devices != self.world:
            raise PlanError(
                f"placement has {placement.experts} experts on {placement.devices} ranks; this "
                f"layer has {self.num_experts} on {self.world}",
                field="placement",
            )
        if slot_map.slots != self.num_slots:
            raise PlanError(
                f"slot map has {slot_map.slots} slots, the layer {self.num_slots}",
                field="placement.slots",
            )
        self.layout = Layout.from_plan(placement, assignment, slot_map, self.rank, layer)

    def reset_layout(self) -> None:
        """Back to the static layout (routing only, as `set_layout`)."""
        self.layout = Layout.static(self.num_experts, self.world, self.rank, self.num_slots)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., D]` (e.g. `[B, S, D]`) -> `y` of the same shape."""
        if x.shape[-1] != self.d_model:
            raise ConfigError(
                f"input's last dimension is {x.shape[-1]}, the layer's d_model {self.d_model}",
                field="moe.input",
            )
        if not self._checked:
            self._check_ranks_agree()
        t0 = time.perf_counter()
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        counts = routing.counts.detach()
        self.last_counts = counts
        if self.training and self.router.expert_bias is not None:
            self.bias_counts = self.bias_counts.to(counts.device) + counts
        self.aux_loss, self.balance_loss, self.z_loss = (
            routing.aux_loss,
            routing.balance_loss,
            routing.z_loss,
        )
        nonfinite = self.check_finite and not bool(torch.isfinite(routing.logits).all())
        t_gate = time.perf_counter() - t0
        y = self.dispatcher(
            tokens,
            routing.experts,
            routing.weights,
            routing.keep,
            self.layout,
            self.experts,
            nonfinite,
        )
        self.last_seconds = {"gate": t_gate, **self.dispatcher.seconds}
        return y.view(x.shape)

    def _check_ranks_agree(self) -> None:
        """Compare a digest of the configuration and one of the router weights across ranks."""
        mine = torch.tensor([self.config_digest(), _tensor_digest(self.router.weight)])
        mine = mine.to(_comm_device(self.group, self.router.weight.device))
        got = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine, group=self.group)
        table = torch.stack(got).cpu()
        for col, what in ((0, "configuration"), (1, "router weights")):
            other = (table[:, col] != table[self.rank, col]).nonzero().flatten().tolist()
            if other:
                hint = "seed every rank alike" if col else "build the layer alike on every rank"
                raise ConfigError(
                    f"MoE {what} on rank {self.rank} differs from rank(s) {other} ({hint})",
                    field="moe",
                )
        self._checked = True

    def config_digest(self) -> int:
        """A digest of what every rank must agree on (shapes, options, slots, dtype)."""
        r, e = self.router, self.experts
        parts = (
            e.d_model, e.d_expert, self.num_experts, self.top_k, e.num_slots, e.activation,
            r.score, r.renormalize, r.capacity_factor, r.expert_bias is not None,
            self.overlap_degree, str(e.w_in.dtype), type(r).__name__,
        )  # fmt: skip
        h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") >> 2

    # ------------------------------------------------------------------ balancing helpers
    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's bias update from the counts since the last update, summed over the
        ranks (a collective when there are several): call it on every rank, outside forward."""
        counts = self.bias_counts.to(self.router.weight.device)
        if self.world > 1:
            counts = counts.to(_comm_device(self.group, counts.device))
            dist.all_reduce(counts, group=self.group)
        self.router.update_bias(counts, rate)
        self.bias_counts = torch.zeros_like(self.bias_counts)

    def extra_repr(self) -> str:
        return f"world={self.world}, rank={self.rank}, overlap_degree={self.overlap_degree}"


def _check_router(router: Router, d_model: int, num_experts: int, top_k: int) -> None:
    got = (router.d_model, router.num_experts, router.top_k)
    if got != (d_model, num_experts, top_k):
        raise ConfigError(
            f"router is (d_model, experts, top_k) = {got}, the layer "
            f"{(d_model, num_experts, top_k)}",
            field="router",
        )


def _draw_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _tensor_digest(t: torch.Tensor) -> int:
    data = t.detach().float().cpu().contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """Where collective buffers must live: CUDA for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return device if device.type == "cuda" else torch.device("cuda")
    return torch.device("cpu")


def expert_generator(init_seed: int, expert: int) -> torch.Generator:
    """The generator expert `expert`'s weights are drawn from: seeded by (init_seed, expert)
    alone, so an expert's weights do not depend on which rank or slot holds it (every layer
    that draws experts, sharded or not, goes through here)."""
    return torch.Generator().manual_seed(init_seed * 1_000_003 + expert)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The `MoE` layers of `model` in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def sync_router_grads(model: nn.Module, group: Any = None) -> None:
    """Sum the routers' gradients of every `MoE` in `model` over `group` (one all-reduce).

    Each rank's router sees only its own tokens; after this, every rank holds the gradient of
    the sum of all ranks' losses (what one process computing every rank's tokens would get).
    A no-op without a process group."""
    if world_and_rank(group)[0] == 1:
        return
    params = [p for m in moe_layers(model) for p in m.router.parameters() if p.grad is not None]
    _all_reduce_grads(params, group)


def _all_reduce_grads(params: Iterable[nn.Parameter], group: Any) -> None:
    params = list(params)
    if not params:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    device = _comm_device(group, flat.device)
    buf = flat.to(device)
    dist.all_reduce(buf, group=group)
    flat = buf.to(flat.device)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def install_bias_update(
    optimizer: torch.optim.Optimizer, model: nn.Module, rate: float
) -> torch.utils.hooks.RemovableHandle:
    """Run `MoE.update_bias(rate)` on every `MoE` of `model` with an expert bias before each
    `optimizer.step()` (a step pre-hook; remove it with the returned handle)."""
    layers = [m for m in moe_layers(model) if m.router.expert_bias is not None]
    if not layers:
        raise ConfigError("no MoE layer of the model has an expert bias", field="expert_bias")

    def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        for m in layers:
            m.update_bias(rate)

    return optimizer.register_step_pre_hook(hook)


__all__ = [
    "MoE",
    "check_world",
    "default_slots",
    "install_bias_update",
    "moe_layers",
    "sync_router_grads",
]
