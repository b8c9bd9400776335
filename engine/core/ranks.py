"""Rank and size helpers, group rank lists and process groups (SMP signatures and semantics).

Before ``smp.init`` the rank functions raise ``NotInitializedError`` while the size functions
return 1, as in SMP. Coordinates come from the pure ``Topology`` (placement-aware).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import NotInitializedError


class CommGroup(IntEnum):
    """Groups for the object collectives (``smp.CommGroup``)."""

    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5

    def get_rank_type(self) -> RankType:
        return RankType(int(self))


class RankType(IntEnum):
    """Which rank ``send``/``recv_from`` interpret their peer index in (``smp.RankType``)."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5

    def get_comm_group(self) -> CommGroup:
        return CommGroup(int(self))


KIND_OF: dict[CommGroup, str] = {
    CommGroup.WORLD: "world", CommGroup.PP_GROUP: "pp", CommGroup.TP_GROUP: "tp",
    CommGroup.RDP_GROUP: "rdp", CommGroup.DP_GROUP: "dp", CommGroup.MP_GROUP: "mp",
}


def _coords() -> Any:
    if not state.initialized:
        raise NotInitializedError("smp.init() must be called before asking for ranks")
    return state.groups.coords


def _topo_or_none() -> Any:
    return state.groups.topology if state.initialized else None


def rank() -> int:
    """Global rank."""
    return _coords().rank


def size() -> int:
    """World size (raises ``NotInitializedError`` before ``smp.init``, as SMP does)."""
    if not state.initialized:
        raise NotInitializedError("smp.init() must be called before smp.size()")
    return state.launch.world_size


def local_rank() -> int:
    """Rank on this node."""
    _coords()
    return state.launch.local_rank


def local_size() -> int:
    """Number of ranks on this node."""
    _coords()
    return state.launch.local_size


def pp_rank() -> int:
    return _coords().pp_rank


def tp_rank() -> int:
    return _coords().tp_rank


def rdp_rank() -> int:
    return _coords().rdp_rank


def dp_rank() -> int:
    return _coords().dp_rank


def mp_rank() -> int:
    return _coords().mp_rank


def pp_size() -> int:
    topo = _topo_or_none()
    return topo.pp if topo else 1


def tp_size() -> int:
    topo = _topo_or_none()
    return topo.tp if topo else 1


def rdp_size() -> int:
    topo = _topo_or_none()
    return topo.rdp if topo else 1


def dp_size() -> int:
    topo = _topo_or_none()
    return topo.dp if topo else 1


def mp_size() -> int:
    topo = _topo_or_none()
    return topo.mp if topo else 1


def num_microbatches() -> int:
    """The configured ``microbatches``."""
    state.require()
    return state.plan.engine_settings.microbatches


def _find(kind: str, **want: int | None) -> list[int]:
    me = _coords()
    topo = state.groups.topology
    target = {k: (getattr(me, k) if v is None else v) for k, v in want.items()}
    for group in topo.groups(kind):
        c = topo.coords(group[0])
        if all(getattr(c, k) == v for k, v in target.items()):
            return list(group)
    raise ValueError(f"no {kind} group with {target}")


def get_pp_group(dp_rank: int | None = None) -> list[int]:
    """Global ranks of the pipeline group of ``dp_rank`` (default: this rank's)."""
    return _find("pp", dp_rank=dp_rank)


def get_tp_group(pp_rank: int | None = None, rdp_rank: int | None = None) -> list[int]:
    return _find("tp", pp_rank=pp_rank, rdp_rank=rdp_rank)


def get_rdp_group(pp_rank: int | None = None, tp_rank: int | None = None) -> list[int]:
    return _find("rdp", pp_rank=pp_rank, tp_rank=tp_rank)


def get_dp_group(pp_rank: int | None = None) -> list[int]:
    return _find("dp", pp_rank=pp_rank)


def get_mp_group(rdp_rank: int | None = None) -> list[int]:
    return _find("mp", rdp_rank=rdp_rank)


def get_world_process_group() -> Any:
    return state.world_process_group


def get_dp_process_group() -> Any:
    return state.dp_process_group


def get_mp_process_group() -> Any:
    return state.mp_process_group


def get_pp_process_group() -> Any:
    return state.pp_process_group


def get_tp_process_group() -> Any:
    return state.tp_process_group


def get_rdp_process_group() -> Any:
    return state.rdp_process_group


def param_shard_rank() -> int:
    """Rank inside the sharded-data-parallel shard group (0 when SDP is off)."""
    backend = state.model.backend if state.model is not None else None
    return backend.param_shard_rank() if backend is not None else 0


def param_shard_size() -> int:
    """Size of the sharded-data-parallel shard group (1 when SDP is off)."""
    backend = state.model.backend if state.model is not None else None
    return backend.param_shard_size() if backend is not None else 1
