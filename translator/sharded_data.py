"""Sharded data parallelism (MiCS): SMP ``sharded_data_parallel_degree`` and ``sdp_hierarchical_allgather``.

The Plan's ``/engine/mics``: shard groups of S ranks inside the reduced-data-parallel group run
ZeRO-3 among themselves and are replicated R = rdp / S times. The engine creates those groups at
``smp.init`` and gathers hierarchically only where this section says so. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .topology import Topology

Groups = tuple[tuple[int, ...], ...]

GRADIENT_SYNC = (
    "reduce-scatter inside the shard group every micro-batch; all-reduce of each rank's gradient partition "
    "across its replica group once per optimizer step"
)


def _groups(groups: Sequence[Sequence[int]] | None) -> Groups | None:
    return None if groups is None else tuple(tuple(int(rank) for rank in group) for group in groups)


@dataclass(frozen=True, kw_only=True)
class MicsSettings:
    """The engine's sharded-data-parallel settings (the Plan's ``/engine/mics``). The defaults here
    are the only ones (no sharding); the engine reads them through ``Plan.engine_settings.mics``."""

    enabled: bool = False
    shard_size: int = 1
    """S: ranks in one shard group (1 = no sharded data parallelism)."""
    replicas: int = 1
    """R = rdp / S: copies of each shard group."""
    hierarchical_allgather: bool = False
    """What the engine does: gather within nodes, then across them (only when a group spans nodes)."""
    hierarchical_allgather_requested: bool = True
    """What the config asked for (SMP's ``sdp_hierarchical_allgather``, default on)."""
    nodes_per_shard_group: int = 1
    shard_groups: Groups | None = None
    """Ranks of every shard group; None when not sharding or the world is too large to list."""
    replica_groups: Groups | None = None
    shard_group_count: int = 1
    replica_group_count: int = 1
    gradient_sync: str = GRADIENT_SYNC

    def __post_init__(self) -> None:
        # Lists (JSON, the topology's groups) become tuples: a frozen section stays unchanged.
        object.__setattr__(self, "shard_groups", _groups(self.shard_groups))
        object.__setattr__(self, "replica_groups", _groups(self.replica_groups))


def engine_mics(
    params: Mapping[str, Any], topo: Topology, ranks_per_node: int, *, list_groups: bool, remarks: list[str]
) -> MicsSettings:
    """The ``/engine/mics`` section for ``topo`` (``list_groups``: write the groups rank by rank).

    Appends to ``remarks`` when a requested hierarchical all-gather is switched off.
    """
    shard = params["sharded_data_parallel_degree"]
    requested = bool(params["sdp_hierarchical_allgather"])
    counts: dict[str, Any] = {
        "enabled": shard > 1,
        "shard_size": shard,
        "replicas": topo.rdp // shard,
        "hierarchical_allgather_requested": requested,
        "shard_group_count": topo.pp * topo.tp * (topo.rdp // shard),
        "replica_group_count": topo.pp * topo.tp * shard,
    }
    if shard <= 1:
        return MicsSettings(**counts)
    shard_groups = topo.shard_groups(shard)
    span = max(len({rank // ranks_per_node for rank in group}) for group in shard_groups)
    if requested and span == 1:
        remarks.append(
            "sdp_hierarchical_allgather is on but every shard group fits in one node: switched off, as SMP did"
        )
    return MicsSettings(
        **counts,
        # SMP (and DeepSpeed's MiCS) gathered hierarchically only when a shard group spans nodes.
        hierarchical_allgather=requested and span > 1,
        nodes_per_shard_group=span,
        shard_groups=tuple(tuple(g) for g in shard_groups) if list_groups else None,
        replica_groups=tuple(tuple(g) for g in topo.replica_groups(shard)) if list_groups else None,
    )
