"""Pure MiCS rank arithmetic: shard/replica groups and the hierarchical all-gather sub-groups.

No torch here, so every layout can be tested exhaustively without processes. ``shard_groups.py``
turns a ``MicsLayout`` into torch process groups.

Terms (docs/smp-semantics.md#sharded-data-parallelism):

* shard group: S consecutive data-parallel ranks; model states are ZeRO-3-partitioned inside it;
* replica group: the R = dp / S ranks (one per shard group) that hold the same shard;
* a node is ``global_rank // ranks_per_node`` (launchers number ranks node by node);
* hierarchical all-gather (``sdp_hierarchical_allgather``): when a shard group spans k > 1 nodes
  with n ranks on each, gather across nodes first inside each *inter* group (the k ranks of the
  shard group that share a position within their node), then inside each *intra* group (the n
  ranks of the shard group on one node). It is switched off, with a reason, when the group fits
  in one node, when ranks per node is unknown, or when the nodes hold unequal, non-contiguous
  parts of the group.
"""

from __future__ import annotations

from dataclasses import dataclass

from smp2ds.translator.topology import Topology


@dataclass(frozen=True)
class HierarchicalPlan:
    """Sub-groups of one shard group for the two-stage all-gather (empty when off)."""

    enabled: bool
    reason: str
    nodes: int = 1
    per_node: int = 0
    inter_groups: tuple[tuple[int, ...], ...] = ()
    intra_groups: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class MicsLayout:
    """Everything about the MiCS groups of one rank, computed identically on every rank."""

    rank: int
    world_size: int
    shard_size: int
    replicas: int
    shard_groups: tuple[tuple[int, ...], ...]
    replica_groups: tuple[tuple[int, ...], ...]
    ranks_per_node: int | None
    hierarchical: tuple[HierarchicalPlan, ...]
    """One plan per shard group, in ``shard_groups`` order."""

    @property
    def shard_index(self) -> int:
        """Which shard group this rank belongs to (without tensor parallelism also its index inside
        its replica group; see :attr:`replica_rank`)."""
        return _index_of(self.shard_groups, self.rank)

    @property
    def replica_index(self) -> int:
        """Which replica group this rank belongs to (without tensor parallelism also its rank inside
        its shard group; see :attr:`shard_rank`)."""
        return _index_of(self.replica_groups, self.rank)

    @property
    def shard_rank(self) -> int:
        """This rank's position inside its shard group (SMP's ``param_shard_rank``), at any tp."""
        return self.shard_ranks.index(self.rank)

    @property
    def replica_rank(self) -> int:
        """This rank's position inside its replica group, at any tp."""
        return self.replica_ranks.index(self.rank)

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        return self.shard_groups[self.shard_index]

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        return self.replica_groups[self.replica_index]

    @property
    def my_hierarchical(self) -> HierarchicalPlan:
        return self.hierarchical[self.shard_index]

    @classmethod
    def build(cls, topology: Topology, shard_size: int, rank: int, ranks_per_node: int | None = None,
              hierarchical: bool = True) -> MicsLayout:
        """Layout for ``rank``; raises ValueError naming the numbers when S does not fit."""
        if topology.pp != 1:
            raise ValueError(
                f"sharded data parallelism here needs pipeline_parallel_degree(1); got pp={topology.pp}. Hint: "
                "drop it and use shard_optimizer_state with pipelines.")
        # With tensor parallelism the shard groups lie inside the rdp group (rdp = dp when tp is 1).
        rdp = topology.rdp
        if not isinstance(shard_size, int) or shard_size < 1 or shard_size > rdp or rdp % shard_size:
            raise ValueError(
                f"sharded_data_parallel_degree({shard_size!r}) must be an int in 1..rdp({rdp}) that divides "
                f"rdp (= dp / tensor_parallel_degree); allowed: {[s for s in range(1, rdp + 1) if rdp % s == 0]}")
        if not 0 <= rank < topology.world_size:
            raise ValueError(f"rank {rank} out of range 0..{topology.world_size - 1}")
        shard_groups = tuple(tuple(g) for g in topology.shard_groups(shard_size))
        replica_groups = tuple(tuple(g) for g in topology.replica_groups(shard_size))
        plans = tuple(plan_hierarchical(g, ranks_per_node) if hierarchical
                      else HierarchicalPlan(False, "sdp_hierarchical_allgather is false") for g in shard_groups)
        return cls(rank=rank, world_size=topology.world_size, shard_size=shard_size,
                   replicas=rdp // shard_size, shard_groups=shard_groups, replica_groups=replica_groups,
                   ranks_per_node=ranks_per_node, hierarchical=plans)


def plan_hierarchical(group: tuple[int, ...] | list[int], ranks_per_node: int | None) -> HierarchicalPlan:
    """Split ``group`` (in group-rank order) into inter-node and intra-node sub-groups."""
    group = tuple(group)
    if not ranks_per_node or ranks_per_node < 1:
        return HierarchicalPlan(False, "ranks per node unknown (LOCAL_WORLD_SIZE not set)")
    nodes: list[int] = []
    for r in group:
        node = r // ranks_per_node
        if not nodes or nodes[-1] != node:
            nodes.append(node)
    if len(nodes) == 1:
        return HierarchicalPlan(False, f"shard group {list(group)} fits in one node of {ranks_per_node} ranks")
    k = len(nodes)
    if len(set(nodes)) != k or len(group) % k:
        return HierarchicalPlan(False, f"shard group {list(group)} is not split evenly and contiguously over nodes")
    n = len(group) // k
    blocks = [group[j * n:(j + 1) * n] for j in range(k)]
    if any(len({r // ranks_per_node for r in b}) != 1 for b in blocks):
        return HierarchicalPlan(False, f"shard group {list(group)} is not split evenly and contiguously over nodes")
    inter = tuple(tuple(blocks[j][pos] for j in range(k)) for pos in range(n))
    return HierarchicalPlan(True, f"shard group spans {k} nodes x {n} ranks", nodes=k, per_node=n,
                            inter_groups=inter, intra_groups=tuple(blocks))


def _index_of(groups: tuple[tuple[int, ...], ...], rank: int) -> int:
    for i, g in enumerate(groups):
        if rank in g:
            return i
    raise ValueError(f"rank {rank} is in none of the groups {groups}")
