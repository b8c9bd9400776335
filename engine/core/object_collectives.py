"""SMP's Python-object collectives: ``broadcast send recv_from allgather gather barrier``.

SMP numbers members by their rank *within* the group in SMP order (e.g. dp_rank), while torch
numbers a subgroup's members by sorted global rank; results are reordered to SMP's order.
``broadcast`` is SMP's asymmetric form: the sender calls ``broadcast`` and each receiver calls
``recv_from(src, rank_type)``.
"""

from __future__ import annotations

from typing import Any

from smp2ds.engine.core import comm
from smp2ds.engine.core.ranks import KIND_OF, CommGroup, RankType
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import InvalidCommGroupError


def _kind(group: Any) -> str:
    try:
        return KIND_OF[CommGroup(group)]
    except (ValueError, TypeError) as exc:
        allowed = ", ".join(f"smp.CommGroup.{g.name}" for g in CommGroup)
        raise InvalidCommGroupError(f"{group!r} is not a communication group; allowed: {allowed}") from exc


def _members(group: Any) -> tuple[list[int], Any]:
    state.require()
    kind = _kind(group)
    return state.groups.ranks[kind], state.groups.handles[kind]


def _to_smp_order(values: list[Any], members: list[int]) -> list[Any]:
    by_global = dict(zip(sorted(members), values))
    return [by_global[r] for r in members]


def _global(peer: int, rank_type: Any) -> int:
    kind = KIND_OF[RankType(rank_type).get_comm_group()]
    members = state.groups.ranks[kind]
    if not 0 <= peer < len(members):
        raise InvalidCommGroupError(f"rank {peer} does not exist in the {kind} group of size {len(members)}")
    return members[peer]


def broadcast(obj: Any, group: Any) -> Any:
    """Send ``obj`` to every other member of ``group``; they receive it with ``recv_from``."""
    members, _ = _members(group)
    me = state.groups.rank
    for peer in members:
        if peer != me:
            comm.send_object(obj, peer)
    return obj


def send(obj: Any, dest_rank: int, rank_type: Any) -> None:
    """Send ``obj`` to the member ``dest_rank`` of the group ``rank_type`` implies."""
    state.require()
    comm.send_object(obj, _global(dest_rank, rank_type))


def recv_from(src_rank: int, rank_type: Any) -> Any:
    """Receive what ``src_rank`` (in the group ``rank_type`` implies) sent or broadcast."""
    state.require()
    return comm.recv_object(_global(src_rank, rank_type))


def allgather(obj: Any, group: Any) -> list[Any]:
    """Everyone's ``obj``, indexed by rank within ``group``."""
    members, handle = _members(group)
    if len(members) == 1:
        return [obj]
    return _to_smp_order(comm.all_gather_object(obj, handle), members)


def gather(obj: Any, group: Any, rank: int = 0) -> list[Any] | None:
    """Gather to the member ``rank`` of ``group``; others get None."""
    members, handle = _members(group)
    if len(members) == 1:
        return [obj]
    out = comm.gather_object(obj, members[rank], handle)
    return None if out is None else _to_smp_order(out, members)


def barrier(group: Any = CommGroup.WORLD) -> None:
    """Wait for every member of ``group``."""
    members, handle = _members(group)
    if len(members) > 1:
        comm.barrier(handle)


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)
