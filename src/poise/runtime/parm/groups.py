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

`ParallelGroups.build(mp)` creates every group once (collective over the world, in the same
order on every rank); `check_degrees` refuses degrees that do not fit (`ConfigError`).
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

    def node_of(self, rank: int) -> int:
        """The MP group (node) of global rank `rank`."""
        return rank // self.mp

    def local_of(self, rank: int) -> int:
        """Rank `rank`'s index inside its MP group (= its ESP shard, = its EP group)."""
        return rank % self.mp

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
    """Validate MP / ESP degrees for `world` ranks (and the model's heads, expert width and
    expert count when given; `esp` defaults to `mp`). `ConfigError` naming the field: `mp` must
    divide the world and the heads; `esp` must equal `mp` and divide `d_expert`; `num_experts`
    must split evenly over the `EP = world / mp` nodes."""
    world = _positive_int(world, "world_size", source)
    mp = _positive_int(mp, "mp", source)
    esp = mp if esp is None else _positive_int(esp, "esp", source)
    if world % mp:
        raise ConfigError(
            f"MP degree {mp} does not divide the world of {world} ranks", source=source, field="mp"
        )
    if world % esp:
        raise ConfigError(
            f"ESP degree {esp} does not divide the world of {world} ranks",
            source=source,
            field="esp",
        )
    if esp != mp:
        raise ConfigError(
            f"ESP degree {esp} differs from the MP degree {mp}: Parm (as DeepSpeed-MoE) shards "
            "each expert across the ranks of its MP group, so ESP = MP",
            source=source,
            field="esp",
        )
    if heads is not None and _positive_int(heads, "heads", source) % mp:
        raise ConfigError(
            f"MP degree {mp} does not divide the {heads} attention heads",
            source=source,
            field="mp",
        )
    if d_expert is not None and _positive_int(d_expert, "d_expert", source) % esp:
        raise ConfigError(
            f"ESP degree {esp} does not divide the expert width d_expert={d_expert}",
            source=source,
            field="esp",
        )
    ep = world // mp
    if num_experts is not None and _positive_int(num_experts, "num_experts", source) % ep:
        raise ConfigError(
            f"{num_experts} experts do not split evenly over EP = {world} / {mp} = {ep} "
            "expert-parallel ranks",
            source=source,
            field="num_experts",
        )
    return ParallelDegrees(world=world, mp=mp, esp=esp, ep=ep)


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's groups. `mp_group` (= ESP group), `ep_group` (= data-parallel group of the
    non-expert parameters), `world_group` (None: the default group)."""

    degrees: ParallelDegrees
    rank: int
    mp_group: Any
    ep_group: Any
    world_group: Any = None

    @property
    def mp(self) -> int:
        return self.degrees.mp

    @property
    def esp(self) -> int:
        return self.degrees.esp

    @property
    def ep(self) -> int:
        return self.degrees.ep

    @property
    def world(self) -> int:
        return self.degrees.world

    @property
    def node(self) -> int:
        """This rank's MP group, also its rank inside its EP group."""
        return self.degrees.node_of(self.rank)

    @property
    def local(self) -> int:
        """This rank's index in its MP group: its heads, its ESP shard and its EP group."""
        return self.degrees.local_of(self.rank)

    @classmethod
    def build(
        cls,
        mp: int,
        esp: int | None = None,
        *,
        heads: int | None = None,
        d_expert: int | None = None,
        num_experts: int | None = None,
    ) -> ParallelGroups:
        """Create the MP and EP groups of the default process group (every rank, same
        arguments); degrees are checked before any group exists."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "MP + EP + ESP needs an initialised torch.distributed process group",
                field="world_size",
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        degrees = check_degrees(
            world, mp, esp, heads=heads, d_expert=d_expert, num_experts=num_experts
        )
        mp_group, _ = dist.new_subgroups_by_enumeration(
            [degrees.mp_ranks(n) for n in range(degrees.ep)]
        )
        ep_group, _ = dist.new_subgroups_by_enumeration(
            [degrees.ep_ranks(m) for m in range(degrees.mp)]
        )
        return cls(degrees=degrees, rank=rank, mp_group=mp_group, ep_group=ep_group)

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


__all__ = ["ParallelDegrees", "ParallelGroups", "check_degrees"]
