"""Torch process groups for MiCS, created in one fixed order on every rank.

``torch.distributed.new_group`` must be called by every rank for every group, in the same order,
or ranks deadlock; so all groups of the layout are created here, walking the pure
``MicsLayout`` lists, and each rank keeps the handles of the groups it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smp2ds.engine.core import comm, launch_env
from smp2ds.engine.core.process_groups import own_group
from smp2ds.engine.mics.rank_arithmetic import MicsLayout
from smp2ds.translator.topology import Topology


@dataclass(frozen=True)
class MicsGroups:
    """Process groups of this rank: shard, replica, its own singleton, hierarchical sub-groups."""

    layout: MicsLayout
    shard_group: Any
    replica_group: Any
    self_group: Any
    """A one-rank group: what the mpu answers for model-parallel queries."""
    inter_group: Any = None
    """Inter-node sub-group of the shard group (hierarchical all-gather), or None when off."""
    intra_group: Any = None
    """Intra-node sub-group of the shard group (hierarchical all-gather), or None when off."""

    @property
    def shard_size(self) -> int:
        return self.layout.shard_size

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    @property
    def hierarchical(self) -> bool:
        """Whether the hierarchical all-gather applies to this rank's shard group."""
        return self.inter_group is not None

    @classmethod
    def create(cls, topology: Topology, shard_size: int, rank: int | None = None,
               ranks_per_node: int | None = None, hierarchical: bool = True) -> MicsGroups:
        """Create every MiCS group (collective: call on all ranks with the same arguments).

        ``ranks_per_node`` defaults to the launcher's ``LOCAL_WORLD_SIZE``; ``hierarchical`` is
        ``sdp_hierarchical_allgather`` and only takes effect when a shard group spans nodes.
        Idempotent within a process group's lifetime: the same arguments return the same object,
        so parameters created under ``mics_init_context`` and the engine built later share one
        shard group (DeepSpeed and the hierarchical all-gather match groups by identity).
        """
        if not comm.is_initialized():
            raise RuntimeError("MicsGroups.create needs torch.distributed initialised first (smp.init does it)")
        rank = comm.get_rank() if rank is None else rank
        if topology.world_size != comm.get_world_size():
            raise ValueError(f"topology world_size({topology.world_size}) != torch.distributed world size "
                             f"({comm.get_world_size()})")
        if ranks_per_node is None:
            ranks_per_node = launch_env.ranks_per_node()
        key = (topology, shard_size, rank, ranks_per_node, bool(hierarchical))
        world = comm.default_group()
        cached = _CACHE.get(key)
        if cached is not None and cached[0] is world:
            return cached[1]
        layout = MicsLayout.build(topology, shard_size, rank, ranks_per_node, hierarchical)
        mine: dict[str, Any] = {}
        kinds = [("shard", layout.shard_groups), ("replica", layout.replica_groups),
                 ("self", tuple((r,) for r in range(layout.world_size)))]
        for plan in layout.hierarchical:
            kinds += [("inter", plan.inter_groups), ("intra", plan.intra_groups)]
        for name, groups in kinds:
            handle = own_group(groups, rank)
            if handle is not None:
                mine[name] = handle
        groups = cls(layout=layout, shard_group=mine["shard"], replica_group=mine["replica"],
                     self_group=mine["self"], inter_group=mine.get("inter"), intra_group=mine.get("intra"))
        _CACHE[key] = (world, groups)
        return groups


# (topology, S, rank, ranks per node, hierarchical) -> (default process group, groups). The default
# group is kept so that groups made before a destroy/re-init of torch.distributed are not reused.
_CACHE: dict[tuple, tuple[Any, MicsGroups]] = {}
