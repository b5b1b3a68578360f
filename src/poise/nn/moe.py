"""The MoE layer: router, dispatcher and expert slots; compute only.

    cfg = MoEConfig(d_model=512, d_expert=1024, num_experts=8, top_k=2)
    moe = MoE(cfg)                  # all E experts, one device, no process group
    y = moe(x)                      # x [B, T, M] (or [T, M]) -> y of the same shape
    loss = task_loss(y) + moe.last_forward.aux_loss

Built alone, the layer holds every expert (`experts` stacked `[E, ...]`) and runs on one device.
Expert parallelism is attached from outside: `apply_expert_parallel(model, group, num_slots=...)`
(`poise.nn.expert_parallel`) keeps this rank's slots (`[P, ...]`, taken from the full layer),
installs a `Dispatcher` over the group and checks that every rank agrees on the configuration.
The same model thus runs on one device, under EP, or under the Balancer, unedited. Under EP each
rank feeds its own tokens; the router is replicated: after `backward`, sum its gradients over
the ranks with `sync_router_grads(model)` (or include it in your data-parallel all-reduce with
SUM) to get the gradient of the sum of the ranks' losses.

Routing. By default experts sit in contiguous blocks (static EP, `RankRouting.static`). The
runtime changes where experts live and where tokens go with `set_routing(placement, assignment,
slot_map)`, which takes effect at the next forward; it moves no weights (the runtime's Trans and
migration fill the slots). Each expert weight's gradient is accumulated once per backward (its
post-accumulate-grad hooks fire once), also with `overlap_degree > 1`.

State after a forward, all declared in `__init__`:
- buffers (not saved in the state dict, moved by `.to()`): `last_counts [E]`, the assignments
  this rank's router produced in the last forward (before dispatch and drops), for the Balancer;
  `bias_counts [E]`, the training forwards' counts since the last `update_bias`;
- `last_forward` (a `ForwardRecord`): the router's `aux_loss` (weighted balance + z losses),
  `balance_loss`, `z_loss`, `dropped` (assignments dropped for capacity), and `seconds` per
  phase (gate, dispatch, experts, combine).

Host waits: on one device a dropless forward and backward make none (checked on an H100 with
CUDA's sync debug mode, `benchmarks/cuda_syncs.py`; counts are taken with `nn.counts`, not
`torch.bincount`); under EP the forward waits once per layer, for the counts the all-to-all's
sizes need (`poise.nn.host.read_sizes`; every index is built on the device, counted on 2 gloo
ranks by `tests/test_nn_host_waits.py`, measured on CUDA by `benchmarks/cuda_syncs.py --ep`);
on one device a capacity factor adds one wait (the kept count sizes the buffer).

torch.compile: `torch.compile(model, fullgraph=True)` traces a model of these layers forward and
backward on one process with no graph break (`tests/test_nn_compile.py` counts them with
`torch._dynamo.explain`): no host clock while compiling (`last_forward.seconds` is `{}`), the
slots read from the `slot_of [E]` buffer (written in place by `set_routing`: a plan change
keeps the compiled graph; only a switch between the identity slot map and another recompiles,
once), the CPU experts' loop as one custom op (`poise::slot_loop_ffn`), and a capacity on
static shapes (dropped rows ride along and give 0; `rows_computed` then counts them). Under
EP each layer breaks the graph once, at `Dispatcher._send_plan` (never traced): the count
exchange and the host read of the sizes the token all-to-all takes as host ints; the token
exchange after it is a functional collective (`comm.all_to_all_single_traced`). New split
sizes recompile the frames resumed after the break once (dynamo then makes them symbolic);
layers of one config share their frames; `last_forward.rows` is then a `LastRows`, read at the
size read. Under the Balancer a plan's first steps recompile a few frames, then none.

Checks: forward does not synchronise with the host to look for NaN or infinity: it ORs an
on-device flag (`nonfinite_seen`) that the step boundary reads with the loss. The Balancer
gathers the flags with the step's counts (`Balancer.reduce_replicas`) and raises
`NonFiniteInputError` on every rank; without a Balancer call `raise_if_nonfinite(model)` where
the loss is read (`check_finite=False` sets no flag). Ranks whose routings differ raise
`RoutingMismatchError` in forward (the dispatcher's count exchange carries the digest).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from poise.core.errors import ConfigError, PlanError
from poise.core.placement import Assignment, Placement
from poise.nn import comm
from poise.nn.comm import comm_device
from poise.nn.config import MoEConfig
from poise.nn.dispatch import Dispatcher, NonFiniteInputError, RankRouting, world_and_rank
from poise.nn.experts import Experts
from poise.nn.router import Router
from poise.nn.slots import SlotMap
from poise.util.digest import digest

EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")


def default_slots(num_experts: int, world: int) -> int:
    """Slots per rank of the static layout: `E / D`, or 1 with more ranks than experts."""
    return max(num_experts // world, 1)


def check_world(num_experts: int, world: int) -> None:
    """Refuse worlds that do not fit the experts (D divides E, or E divides D)."""
    if (world <= num_experts and num_experts % world) or (
        world > num_experts and world % num_experts
    ):
        raise ConfigError(
            f"{world} ranks do not fit {num_experts} experts: the world size must divide the "
            f"number of experts, or be a multiple of it",
            field="world_size",
        )


class LastRows:
    """`int(LastRows(dispatcher))`: the token-expert rows the dispatcher's latest forward
    computed (`Dispatcher.rows_computed`, set at the size read), read when asked: what a
    compiled layer under EP leaves in `ForwardRecord.rows` (read it before the layer's next
    forward, as the Balancer's forward hook does)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def __int__(self) -> int:
        return int(self.dispatcher.rows_computed)

    def __index__(self) -> int:
        return int(self)


@dataclass
class ForwardRecord:
    """What an `MoE` forward leaves besides its output: the router's losses (scalars, with
    their autograd graph: add `aux_loss` to the loss), `dropped` (`[]` long, on the layer's
    device: assignments this rank's router dropped for capacity, 0 when dropless), `choices`
    (`[T, k]` long: the experts each token chose, before drops; no copy) and the wall seconds
    per phase."""

    aux_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    balance_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    z_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    dropped: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    choices: torch.Tensor | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    # token-expert rows this rank's slots computed (its measured device load); `int()` it
    rows: int | LastRows = 0


class MoE(nn.Module):
    """A Mixture-of-Experts FFN layer: `forward(x [..., M]) -> y [..., M]`.

    `config`: the layer (`MoEConfig`); `router`: a ready router instead of the config's (e.g. a
    `ReplayRouter`; its shapes must match). Holds all `E` experts (`experts`, `[E, ...]`) until
    `apply_expert_parallel` keeps this rank's `P` slots. After forward: the buffers
    `last_counts [E]`, `bias_counts [E]` and `nonfinite_seen []` (bool, since the last
    `take_nonfinite`), and `last_forward` (losses, seconds)."""

    last_counts: torch.Tensor
    bias_counts: torch.Tensor
    nonfinite_seen: torch.Tensor
    slot_of: torch.Tensor

    def __init__(
        self,
        config: MoEConfig,
        *,
        router: Router | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise ConfigError(f"must be a MoEConfig, got {type(config).__name__}", field="config")
        c = self.config = config
        self.router = router or Router(
            c.d_model, c.num_experts, c.top_k, score=c.score, renormalize=c.renormalize,
            balance_coef=c.balance_coef, z_loss_coef=c.z_loss_coef, expert_bias=c.expert_bias,
            capacity_factor=c.capacity_factor, device=device, dtype=dtype,
        )  # fmt: skip
        _check_router(self.router, c)
        E = c.num_experts
        self.experts = Experts(
            E, c.d_model, c.d_expert, c.activation, impl=c.experts_impl, device=device, dtype=dtype
        )
        # Expert parallelism (set by `apply_expert_parallel`): none, one process.
        self.group: Any = None
        self.world, self.rank = 1, 0
        self.expert_parallel = False
        self.dispatcher = Dispatcher(E, c.top_k, None, c.overlap_degree)
        self.register_buffer("slot_of", torch.arange(E, device=device), persistent=False)
        self.routing = RankRouting.static(E, 1, 0, E)
        self.init_seed = _draw_seed() if c.init_seed is None else int(c.init_seed)
        self.reset_experts()
        self.register_buffer("last_counts", torch.zeros(E, dtype=torch.long, device=device),
                             persistent=False)  # fmt: skip
        self.register_buffer("bias_counts", torch.zeros(E, dtype=torch.long, device=device),
                             persistent=False)  # fmt: skip
        self.register_buffer("nonfinite_seen", torch.zeros((), dtype=torch.bool, device=device),
                             persistent=False)  # fmt: skip
        self.last_forward = ForwardRecord()

    # ------------------------------------------------------------------ properties
    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def num_slots(self) -> int:
        return self.experts.num_slots

    @property
    def overlap_degree(self) -> int:
        return self.dispatcher.overlap_degree

    # ------------------------------------------------------------------ weights and routing
    @property
    def routing(self) -> RankRouting:
        """The routing in force (`RankRouting`); setting it also fills the `slot_of [E]`
        buffer (in place: a compiled forward reads the new slots without recompiling)."""
        return self._routing

    @routing.setter
    def routing(self, value: RankRouting) -> None:
        self._static_slots = value.identity_slots
        with torch.no_grad():
            self.slot_of.copy_(torch.from_numpy(value.slot_of))
        self._routing = value

    def reset_experts(self) -> None:
        """Draw every held slot's weights from its expert's own generator; empty slots zero."""
        for slot, e in enumerate(self.routing.slots.expert.tolist()):
            if e < 0:
                with torch.no_grad():
                    for w in self.experts.weights():
                        w[slot].zero_()
                continue
            self.experts.init_slot(slot, expert_generator(self.init_seed, e))

    @torch.no_grad()
    def load_expert_weights(self, full: Mapping[str, torch.Tensor]) -> None:
        """Fill every held slot from stacked per-expert weights `full[name] [E, ...]` (names
        `w_in`, `w_gate`, `w_out`, as in `experts`); empty slots are zeroed."""
        for name in EXPERT_WEIGHTS:
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
            for slot, e in enumerate(self.routing.slots.expert.tolist()):
                if e >= 0:
                    w[slot].copy_(src[e])
                else:
                    w[slot].zero_()

    def set_routing(
        self,
        placement: Placement,
        assignment: Assignment,
        slot_map: SlotMap,
        layer: int = 0,
    ) -> None:
        """From the next forward on, route by layer `layer` of `placement` (home `[E]`, copies
        `[D, E]`) and `assignment` (weights `[E, D]`), with `slot_map` this rank's slots.

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
        self.routing = RankRouting.from_plan(placement, assignment, slot_map, self.rank, layer)

    def reset_routing(self) -> None:
        """Back to static EP's routing (routing only, as `set_routing`)."""
        self.routing = RankRouting.static(self.num_experts, self.world, self.rank, self.num_slots)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., M]` (e.g. `[B, T, M]`) -> `y` of the same shape."""
        if x.shape[-1] != self.d_model:
            raise ConfigError(
                f"input's last dimension is {x.shape[-1]}, the layer's d_model {self.d_model}",
                field="moe.input",
            )
        timed = not torch.compiler.is_compiling()  # host clocks break a traced graph
        t0 = time.perf_counter() if timed else 0.0
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        counts = routing.counts.detach()
        self.last_counts.copy_(counts)
        if self.training and self.router.expert_bias is not None:
            self.bias_counts.add_(counts.to(self.bias_counts.device))
        if self.config.check_finite:  # on the device: read at the step boundary
            self.nonfinite_seen |= ~torch.isfinite(routing.logits.detach()).all()
        t_gate = time.perf_counter() - t0 if timed else 0.0
        y = self.dispatcher(
            tokens, routing.experts, routing.weights, routing.keep, self.routing, self.experts,
            slot_of=None if self._static_slots else self.slot_of,
        )  # fmt: skip
        # Under EP the rows are known at the size read only: compiled, the record reads them
        # there when asked (a host int here would be a guard that every step's loads fail).
        rows: int | LastRows = (
            LastRows(self.dispatcher)
            if self.world > 1 and not timed
            else self.dispatcher.rows_computed
        )
        self.last_forward = ForwardRecord(
            aux_loss=routing.aux_loss,
            balance_loss=routing.balance_loss,
            z_loss=routing.z_loss,
            dropped=(
                (~routing.keep).sum()
                if routing.keep is not None
                else torch.zeros((), dtype=torch.long, device=counts.device)
            ),
            choices=routing.experts.detach(),
            seconds={"gate": t_gate, **self.dispatcher.seconds} if timed else {},
            rows=rows,
        )
        return y.view(x.shape)

    def take_nonfinite(self) -> torch.Tensor:
        """The flag `[]` (bool, on the layer's device) of NaN or infinity in the router's logits
        since the last call, and reset it. No host synchronisation."""
        seen = self.nonfinite_seen.clone()
        self.nonfinite_seen.zero_()
        return seen

    def config_digest(self) -> int:
        """A digest of what every rank of an EP group must agree on: the config, the slots,
        the weights' dtype and the router's kind and options."""
        r = self.router
        return digest(
            self.config.digest(), self.num_slots, str(self.experts.w_in.dtype), type(r).__name__,
            r.score, r.renormalize, r.capacity_factor, r.expert_bias is not None,
        )  # fmt: skip

    # ------------------------------------------------------------------ balancing helpers
    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's bias update from the counts since the last update, summed over the
        ranks (a collective under EP): call it on every rank, outside forward."""
        counts = self.bias_counts.clone()
        if self.world > 1:
            counts = counts.to(comm_device(self.group, counts.device))
            comm.all_reduce(counts, group=self.group)
        self.router.update_bias(counts.to(self.router.weight.device), rate)
        self.bias_counts.zero_()

    def extra_repr(self) -> str:
        return f"world={self.world}, rank={self.rank}, overlap_degree={self.overlap_degree}"


def _check_router(router: Router, config: MoEConfig) -> None:
    got = (router.d_model, router.num_experts, router.top_k)
    want = (config.d_model, config.num_experts, config.top_k)
    if got != want:
        raise ConfigError(
            f"router is (d_model, experts, top_k) = {got}, the layer {want}", field="router"
        )


def _draw_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def expert_generator(init_seed: int, expert: int) -> torch.Generator:
    """The generator expert `expert`'s weights are drawn from: seeded by (init_seed, expert)
    alone, so an expert's weights do not depend on which rank or slot holds it (every layer
    that draws experts, sharded or not, goes through here)."""
    return torch.Generator().manual_seed(init_seed * 1_000_003 + expert)


def find_moe_layers(model: nn.Module) -> list[MoE]:
    """The `MoE` layers of `model` in module order (`model` may itself be one)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def sync_router_grads(model: nn.Module, group: Any = None) -> None:
    """Sum the routers' gradients of every `MoE` in `model` over `group` (None: the default
    group; one all-reduce).

    Each rank's router sees only its own tokens; after this, every rank holds the gradient of
    the sum of all ranks' losses (what one process computing every rank's tokens would get).
    A no-op without an initialised process group."""
    if world_and_rank(group)[0] == 1:
        return
    params = [
        p for m in find_moe_layers(model) for p in m.router.parameters() if p.grad is not None
    ]
    _all_reduce_grads(params, group)


def nonfinite_error(ranks: list[int], step: int | None = None) -> NonFiniteInputError:
    """The error for NaN or infinity seen in MoE inputs on `ranks` (during step `step`)."""
    when = f" during step {step}" if step is not None else ""
    return NonFiniteInputError(
        f"NaN or infinity in the MoE layer's input on rank(s) {ranks}{when}", field="moe.input"
    )


def raise_if_nonfinite(model: nn.Module, group: Any = None, step: int | None = None) -> None:
    """Raise `NonFiniteInputError` on every rank of `group` if any `MoE` of `model` on any
    rank saw NaN or infinity since the last check (one all-reduce of `[D]` flags; a host
    synchronisation: call it at the step boundary, where the loss is read). Resets the flags."""
    layers = find_moe_layers(model)
    if not layers:
        return
    seen = torch.stack([m.take_nonfinite() for m in layers]).any()
    world, rank = world_and_rank(group)
    flags = torch.zeros(world, dtype=torch.long, device=seen.device)
    flags[rank] = seen.long()
    if world > 1:
        flags = flags.to(comm_device(group, flags.device))
        comm.all_reduce(flags, group=group)
    bad = torch.nonzero(flags.cpu()).flatten().tolist()
    if bad:
        raise nonfinite_error(bad, step)


def _all_reduce_grads(params: Iterable[nn.Parameter], group: Any) -> None:
    params = list(params)
    if not params:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    buf = flat.to(comm_device(group, flat.device))
    comm.all_reduce(buf, group=group)
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
    layers = [m for m in find_moe_layers(model) if m.router.expert_bias is not None]
    if not layers:
        raise ConfigError("no MoE layer of the model has an expert bias", field="expert_bias")

    def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        for m in layers:
            m.update_bias(rate)

    return optimizer.register_step_pre_hook(hook)


__all__ = [
    "EXPERT_WEIGHTS",
    "ForwardRecord",
    "MoE",
    "check_world",
    "default_slots",
    "expert_generator",
    "find_moe_layers",
    "install_bias_update",
    "nonfinite_error",
    "raise_if_nonfinite",
    "sync_router_grads",
]
