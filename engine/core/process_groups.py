"""Create every SMP process group from the pure topology, in one order on every rank.

``torch.distributed.new_group`` is collective over the whole world: every rank must call it for
every group, in the same order, even for groups it is not in. The order is fixed by
``GROUP_KINDS`` and by ``Topology.groups(kind)``, which lists groups identically everywhere.
Groups spanning the whole world reuse the world group instead of creating a duplicate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from smp2ds.engine.core import comm
from smp2ds.translator.topology import GROUP_KINDS, Coords, Topology


@dataclass
class ProcessGroups:
    """This rank's coordinates, its group of each kind (rank lists and torch groups)."""

    topology: Topology
    rank: int
    coords: Coords
    ranks: dict[str, list[int]] = field(default_factory=dict)
    """kind -> global ranks of this rank's group, in in-group rank order."""
    handles: dict[str, Any] = field(default_factory=dict)
    """kind -> torch ProcessGroup containing this rank."""
    all_handles: dict[tuple[str, tuple[int, ...]], Any] = field(default_factory=dict)
    """(kind, ranks) -> ProcessGroup for every group created (members and non-members alike)."""

    def group(self, kind: str) -> Any:
        return self.handles[kind]

    def group_of(self, kind: str, ranks: list[int]) -> Any:
        """The handle of a specific group (e.g. another stage's dp group), or None if this rank is not in it."""
        return self.all_handles.get((kind, tuple(ranks)))


def own_group(groups: Sequence[Sequence[int]], rank: int, reuse_world: bool = False) -> Any:
    """Create every group in ``groups`` (collective: all ranks, same order) and return the one
    holding ``rank`` (None if none does). The only place the engine creates process groups.

    ``reuse_world``: a group spanning the whole world is the world group, not a duplicate.
    """
    world = list(range(comm.get_world_size()))
    mine = None
    for ranks in groups:
        ranks = list(ranks)
        handle = comm.world_group() if reuse_world and ranks == world else comm.new_group(ranks)
        if rank in ranks:
            mine = handle
    return mine


def create_groups(topology: Topology, rank: int) -> ProcessGroups:
    """Create the world/pp/tp/rdp/dp/mp groups for ``topology`` (collective over all ranks)."""
    out = ProcessGroups(topology=topology, rank=rank, coords=topology.coords(rank))
    world = list(range(topology.world_size))
    for kind in GROUP_KINDS:
        for ranks in topology.groups(kind):
            handle = comm.world_group() if ranks == world else comm.new_group(ranks)
            out.all_handles[(kind, tuple(ranks))] = handle
            if rank in ranks:
                out.ranks[kind] = ranks
                out.handles[kind] = handle
    return out
