"""Process groups of MP + EP + ESP (Parm, Pan et al., INFOCOM 2024, arXiv 2407.00599).

`D` ranks form `D / M` model-parallel (MP) groups of `M` consecutive ranks, one node each (as
DeepSpeed-MoE's tensor-parallel groups): `rank r = node * M + local`, `node = r // M`.

- MP group of node n: ranks `[n M, (n + 1) M)`; attention heads are split across it, so
  tokens leave attention duplicated on its M ranks.
- ESP group = the MP group: each expert's hidden dimension is split across it (DeepSpeed-MoE's
  expert tensor parallelism, Parm's expert-sharding parallelism), so ESP degree = MP degree.
- EP groups: `M` groups of `EP = D / M` ranks `{local, local + M, ...}`. Expert e lives on node
  `e // (E / EP)`, sharded over its M ranks; node n is EP rank n of every EP group. They are
  also the data-parallel groups of every non-expert parameter (each node runs its own batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from poise.core.errors import ConfigError


@dataclass(frozen=True)
class ParallelDegrees:
    """`world = ep * mp` ranks; `esp == mp` (experts sharded over the MP group)."""

    world: int
    mp: int
    esp: int
    ep: int

    def mp_ranks(self, node: int) -> list[int]:
        return list(range(node * self.mp, (node + 1) * self.mp))

    def ep_ranks(self, local: int) -> list[int]:
        return list(range(local, self.world, self.mp))


def _positive_int(value: object, field: str, source: str | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"must be an integer >= 1, got {value!r}", source=source, field=field)
    return value


def check_degrees(
    world: int,
    mp: int,
    esp: int | None = None,
    *,
    heads: int | None = None,
    d_expert: int | None = None,
    num_experts: int | None = None,
    source: str | None = None,
) -> ParallelDegrees:
    """Validate MP / ESP degrees for `world` ranks and, when given, the model's heads, expert
    width and expert count (`esp` defaults to `mp`); `ConfigError` names the field."""
    world = _positive_int(world, "world_size", source)
    mp = _positive_int(mp, "mp", source)
    esp = mp if esp is None else _positive_int(esp, "esp", source)
    ep = world // mp

    def need(ok: bool, field: str, message: str) -> None:
        if not ok:
            raise ConfigError(message, source=source, field=field)

    need(world % mp == 0, "mp", f"MP degree {mp} does not divide the world of {world} ranks")
    need(world % esp == 0, "esp", f"ESP degree {esp} does not divide the world of {world} ranks")
    need(
        esp == mp,
        "esp",
        f"ESP degree {esp} differs from the MP degree {mp}: Parm (as DeepSpeed-MoE) shards each "
        "expert across the ranks of its MP group, so ESP = MP",
    )
    if heads is not None:
        heads = _positive_int(heads, "heads", source)
        need(heads % mp == 0, "mp", f"MP degree {mp} does not divide the {heads} attention heads")
    if d_expert is not None:
        d_expert = _positive_int(d_expert, "d_expert", source)
        msg = f"ESP degree {esp} does not divide the expert width d_expert={d_expert}"
        need(d_expert % esp == 0, "esp", msg)
    if num_experts is not None:
        num_experts = _positive_int(num_experts, "num_experts", source)
        msg = f"{num_experts} experts do not split evenly over EP = {world} / {mp} = {ep}"
        need(num_experts % ep == 0, "num_experts", f"{msg} expert-parallel ranks")
    return ParallelDegrees(world=world, mp=mp, esp=esp, ep=ep)


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's degrees (as `ParallelDegrees`) and groups: `mp_group` (= ESP group),
    `ep_group` (= data-parallel group of the non-expert parameters), `world_group` (None: the
    default group)."""

    world: int
    mp: int
    esp: int
    ep: int
    rank: int
    mp_group: Any
    ep_group: Any
    world_group: Any = None

    @property
    def node(self) -> int:
        """This rank's MP group, also its rank inside its EP group."""
        return self.rank // self.mp

    @property
    def local(self) -> int:
        """This rank's index in its MP group: its heads, its ESP shard and its EP group."""
        return self.rank % self.mp

    @classmethod
    def build(cls, mp: int) -> ParallelGroups:
        """Create every MP and EP group once: a collective over the default process group, in
        the same order on every rank (same `mp`); degrees are checked before any group exists."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "MP + EP + ESP needs an initialised torch.distributed process group",
                field="world_size",
            )
        rank, d = dist.get_rank(), check_degrees(dist.get_world_size(), mp)
        mp_group, _ = dist.new_subgroups_by_enumeration([d.mp_ranks(n) for n in range(d.ep)])
        ep_group, _ = dist.new_subgroups_by_enumeration([d.ep_ranks(m) for m in range(d.mp)])
        return cls(d.world, d.mp, d.esp, d.ep, rank, mp_group, ep_group)

    def check_model(
        self,
        *,
        heads: int | None = None,
        d_expert: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        """Check a model's shapes against these groups (`ConfigError` naming the field)."""
        check_degrees(
            self.world, self.mp, self.esp, heads=heads, d_expert=d_expert, num_experts=num_experts
        )
