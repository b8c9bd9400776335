"""The one module that talks to ``torch.distributed`` (CONTRIBUTING.md, convention 9).

Everything else in the engine calls these thin functions, so the set of collectives we use is
visible in one place and a grep check can keep it that way. Global ranks are used at this
interface; groups are opaque handles from :func:`new_group`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from smp2ds.engine.core.launch_env import Rendezvous

Store = dist.Store
ProcessGroup = dist.ProcessGroup
ReduceOp = dist.ReduceOp


def create_store(rdv: Rendezvous, rank: int, world_size: int, timeout_s: float, *, side: bool = False) -> Store:
    """Open the rendezvous key-value store.

    ``side=True`` opens an extra client (or a sibling file) for the heartbeat watchdog, so its
    traffic never queues behind a blocking call of the main thread on the primary client.
    """
    timeout = timedelta(seconds=timeout_s)
    if rdv.kind == "file":
        path = rdv.path + (".watchdog" if side else "")
        return dist.FileStore(path, -1 if side else world_size)
    is_master = rank == 0 and not rdv.agent_store and not side
    store: Store = dist.TCPStore(rdv.host, rdv.port, None if not is_master else world_size, is_master,
                                 timeout, wait_for_workers=False)
    if rdv.prefix:
        store = dist.PrefixStore(rdv.prefix, store)
    return store


def init(backend: str, store: Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Create the default (world) process group on ``store``."""
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def init_deepspeed(backend: str) -> None:
    """Let DeepSpeed adopt the existing world group (it must not create its own)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


def new_group(ranks: Sequence[int]) -> ProcessGroup:
    """Create a subgroup; every rank must call this for every group, in the same order."""
    return dist.new_group(ranks=list(ranks))


def world_group() -> ProcessGroup:
    return dist.group.WORLD


def default_group() -> ProcessGroup:
    """The current default (world) process group object; changes identity after a re-init."""
    return dist.distributed_c10d._get_default_group()


def get_process_group_ranks(group: ProcessGroup) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group)


def get_backend(group: ProcessGroup | None = None) -> str:
    return str(dist.get_backend(group))


def get_rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def barrier(group: ProcessGroup | None = None) -> None:
    dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """Reduce ``tensor`` in place; returns it, or the work handle (``.wait()``) when ``async_op``."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else tensor


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Broadcast ``tensor`` in place from global rank ``src``; returns it, or the work handle when ``async_op``."""
    work = dist.broadcast(tensor, src, group=group, async_op=async_op)
    return work if async_op else tensor


def tensor_device(group: ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device for NCCL, else the CPU."""
    if get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group: ProcessGroup | None = None,
                           async_op: bool = False) -> Any:
    """Concatenate every member's ``input_`` into ``output``; returns the work handle when ``async_op``."""
    return dist.all_gather_into_tensor(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input_: torch.Tensor,
                          group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``input_`` over ``group`` and keep this member's chunk of dim 0 in ``output``; returns ``output``."""
    dist.reduce_scatter_tensor(output, input_, group=group)
    return output


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every member's ``tensor`` (same shape everywhere), indexed by rank within ``group``."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every member's ``obj``, indexed by rank within ``group``."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, dst: int, group: ProcessGroup | None = None) -> list[Any] | None:
    """Gather to global rank ``dst``; returns the list there and None elsewhere."""
    me = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size(group) if me == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def broadcast_object(obj: Any, src: int, group: ProcessGroup | None = None) -> Any:
    """Broadcast ``obj`` from global rank ``src`` to the members of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def send_object(obj: Any, dst: int) -> None:
    """Point-to-point send of a picklable object to global rank ``dst``."""
    dist.send_object_list([obj], dst=dst)


def recv_object(src: int) -> Any:
    """Receive an object sent by global rank ``src`` with :func:`send_object`."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    return box[0]
