"""SMP rank arithmetic: coordinates and groups for pp x tp x rdp under a placement strategy.

Pure Python (no torch): the translator uses it to describe a layout and the engine uses it to
create process groups. SMP semantics (docs/smp-semantics.md#ranks-and-placement):

* three axes, ``P`` (pipeline, size pp), ``T`` (tensor, size tp) and ``D`` (reduced data
  parallel, size rdp); ``placement_strategy`` is a permutation of the letters whose right-most
  letter varies fastest over consecutive global ranks; ``cluster`` = ``DPT``, ``spread`` = ``TPD``;
* ``dp`` (SMP meaning) = tp x rdp ranks of one pipeline stage; ``mp`` = pp x tp ranks of one
  model replica; the in-group rank orders follow SMP's formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import permutations

PLACEMENT_ALIASES: dict[str, str] = {"cluster": "DPT", "spread": "TPD"}
PLACEMENT_ORDERS: tuple[str, ...] = tuple("".join(p) for p in permutations("DPT"))
GROUP_KINDS: tuple[str, ...] = ("world", "pp", "tp", "rdp", "dp", "mp")


def placement_order(strategy: str) -> str:
    """Return the three-letter order (e.g. ``"DPT"``) for a ``placement_strategy`` value."""
    order = PLACEMENT_ALIASES.get(strategy, strategy)
    if order not in PLACEMENT_ORDERS:
        allowed = ", ".join(list(PLACEMENT_ALIASES) + list(PLACEMENT_ORDERS))
        raise ValueError(f"placement_strategy {strategy!r} is not one of {allowed}")
    return order


@dataclass(frozen=True)
class Coords:
    """Every SMP coordinate of one global rank."""

    rank: int
    pp_rank: int
    tp_rank: int
    rdp_rank: int
    dp_rank: int
    mp_rank: int


@dataclass(frozen=True)
class Topology:
    """Rank layout of ``pp * tp * rdp`` processes ordered by ``placement`` (a strategy or letters)."""

    pp: int = 1
    tp: int = 1
    rdp: int = 1
    placement: str = "cluster"

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "rdp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        placement_order(self.placement)

    @classmethod
    def for_world(cls, world_size: int, pp: int = 1, tp: int = 1, placement: str = "cluster") -> Topology:
        """Layout for ``world_size`` ranks; raises ValueError when pp*tp does not divide it."""
        if world_size < 1 or world_size % (pp * tp):
            raise ValueError(
                f"world_size({world_size}) is not divisible by pipeline_parallel_degree({pp}) * "
                f"tensor_parallel_degree({tp}) = {pp * tp}"
            )
        return cls(pp=pp, tp=tp, rdp=world_size // (pp * tp), placement=placement)

    @property
    def order(self) -> str:
        return placement_order(self.placement)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.rdp

    @property
    def dp(self) -> int:
        """SMP data-parallel degree: ranks of one pipeline stage (tp x rdp)."""
        return self.tp * self.rdp

    @property
    def mp(self) -> int:
        """SMP model-parallel degree: ranks of one model replica (pp x tp)."""
        return self.pp * self.tp

    def _size(self, letter: str) -> int:
        return {"P": self.pp, "T": self.tp, "D": self.rdp}[letter]

    def rank_of(self, pp_rank: int, tp_rank: int, rdp_rank: int) -> int:
        """Global rank of the given axis coordinates (right-most letter varies fastest)."""
        digit = {"P": pp_rank, "T": tp_rank, "D": rdp_rank}
        rank = 0
        for letter in self.order:
            if not 0 <= digit[letter] < self._size(letter):
                raise ValueError(f"coordinate {letter}={digit[letter]} out of range 0..{self._size(letter) - 1}")
            rank = rank * self._size(letter) + digit[letter]
        return rank

    def _dp_rank(self, tp_rank: int, rdp_rank: int) -> int:
        if self.order.index("T") < self.order.index("D"):
            return rdp_rank + self.rdp * tp_rank
        return tp_rank + self.tp * rdp_rank

    def _mp_rank(self, pp_rank: int, tp_rank: int) -> int:
        if self.order.index("T") < self.order.index("P"):
            return pp_rank + self.pp * tp_rank
        return tp_rank + self.tp * pp_rank

    @cached_property
    def _all_coords(self) -> tuple[Coords, ...]:
        out: list[Coords | None] = [None] * self.world_size
        for p in range(self.pp):
            for t in range(self.tp):
                for d in range(self.rdp):
                    r = self.rank_of(p, t, d)
                    out[r] = Coords(r, p, t, d, self._dp_rank(t, d), self._mp_rank(p, t))
        return tuple(c for c in out if c is not None)

    def coords(self, rank: int) -> Coords:
        """All coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        return self._all_coords[rank]

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (one of GROUP_KINDS), each listed in in-group rank order.

        The list of groups is the same on every rank, so process groups can be created from it
        in one order everywhere.
        """
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")
        if kind == "world":
            return [list(range(self.world_size))]
        key, order = {
            "pp": (lambda c: (c.tp_rank, c.rdp_rank), lambda c: c.pp_rank),
            "tp": (lambda c: (c.pp_rank, c.rdp_rank), lambda c: c.tp_rank),
            "rdp": (lambda c: (c.pp_rank, c.tp_rank), lambda c: c.rdp_rank),
            "dp": (lambda c: (c.pp_rank,), lambda c: c.dp_rank),
            "mp": (lambda c: (c.rdp_rank,), lambda c: c.mp_rank),
        }[kind]
        buckets: dict[tuple[int, ...], list[Coords]] = {}
        for c in self._all_coords:
            buckets.setdefault(key(c), []).append(c)
        return [[c.rank for c in sorted(buckets[k], key=order)] for k in sorted(buckets)]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that contains ``rank``."""
        for group in self.groups(kind):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")

    def shard_groups(self, shard_size: int) -> list[list[int]]:
        """MiCS shard groups: ``shard_size`` consecutive ranks of each reduced-data-parallel group.

        Without tensor parallelism the rdp group is the stage's data-parallel group; with it, the
        ranks holding the same tensor-parallel shard (SMP 1.15's sharded data parallelism with
        tensor parallelism partitions each rank's shards over them)."""
        self._check_shard_size(shard_size)
        return [rdp[i : i + shard_size] for rdp in self.groups("rdp") for i in range(0, self.rdp, shard_size)]

    def replica_groups(self, shard_size: int) -> list[list[int]]:
        """MiCS replica groups: the strided ranks of each rdp group that hold the same shard."""
        self._check_shard_size(shard_size)
        return [rdp[j :: shard_size] for rdp in self.groups("rdp") for j in range(shard_size)]

    def _check_shard_size(self, shard_size: int) -> None:
        if shard_size < 1 or self.rdp % shard_size:
            what = "data-parallel degree" if self.tp == 1 else "reduced data-parallel degree (world / (pp x tp))"
            raise ValueError(f"sharded_data_parallel_degree({shard_size}) must divide the {what}({self.rdp})")


def tensor_parallel_spread(topo: Topology, ranks_per_node: int) -> str | None:
    """A warning when tensor-parallel groups leave a node (``placement_strategy`` with ``T`` not varying fastest,
    e.g. ``spread``): their collectives, several per layer in forward and backward, then cross the network.
    None when every group stays on one node."""
    if topo.tp == 1 or ranks_per_node < 1:
        return None
    groups = topo.groups("tp")
    spans = [len({rank // ranks_per_node for rank in group}) for group in groups]
    crossing = sum(1 for span in spans if span > 1)
    if not crossing:
        return None
    return (f"warning: placement_strategy {topo.placement!r} spreads {crossing} of the {len(groups)} tensor-parallel "
            f"groups over up to {max(spans)} nodes ({ranks_per_node} ranks per node): tensor parallelism's "
            "collectives, several per layer in forward and backward, then cross the network; use "
            "placement_strategy cluster (or any order ending in T) to keep each group inside a node")
