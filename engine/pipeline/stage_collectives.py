"""The pipeline's own collectives on the pipeline (stage) group, and tree helpers for them.

The only module of this package that touches ``torch.distributed`` directly (DeepSpeed's
pipeline engine does its own point-to-point and gradient communication).

Step results and losses exist only on the last stage; SMP makes them available on every rank
of the pipeline, so they are broadcast as Python objects (tensors moved to CPU first so the
pickled form does not depend on a device). Full state dicts gather every stage's part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.core import comm


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested lists/tuples/dicts/`ModelOutput`s; keep the structure."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        items = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(**items) if is_model_output(obj) else type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def is_model_output(obj: Any) -> bool:
    return is_model_output_class(type(obj))


def is_model_output_class(cls: type) -> bool:
    """A Hugging Face ``ModelOutput`` subclass (found by name: transformers is optional)."""
    return any(base.__name__ == "ModelOutput" for base in cls.__mro__)


def detach(obj: Any) -> Any:
    """Detached copy of the tensors in ``obj`` (SMP's ``detach_outputs=True``)."""
    return map_tensors(obj, lambda t: t.detach())


class Packed:
    """A tensor as raw bytes + dtype + shape: pickles far cheaper than torch's tensor reduction."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, t: torch.Tensor):
        self.data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.dtype, self.shape = t.dtype, tuple(t.shape)

    def __getstate__(self) -> tuple:
        return self.data, self.dtype, self.shape

    def __setstate__(self, state: tuple) -> None:
        self.data, self.dtype, self.shape = state

    def unpack(self) -> torch.Tensor:
        return torch.from_numpy(self.data.copy()).view(self.dtype).reshape(self.shape)


def _unpack(obj: Any) -> Any:
    if isinstance(obj, Packed):
        return obj.unpack()
    if isinstance(obj, dict):
        items = {k: _unpack(v) for k, v in obj.items()}
        return type(obj)(**items) if is_model_output(obj) else type(obj)(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_unpack(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v) for v in obj)
    return obj


def broadcast_object(obj: Any, src: int, group: Any) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (tensors arrive on CPU)."""
    packed = map_tensors(obj, Packed) if comm.get_rank() == src else None
    return _unpack(comm.broadcast_object(packed, src, group))


def broadcast_raw(obj: Any, src: int, group: Any) -> Any:
    """``obj`` (already free of device tensors, e.g. `Packed`) from global rank ``src`` on every rank of ``group``."""
    return comm.broadcast_object(obj if comm.get_rank() == src else None, src, group)


def broadcast_tensor_async(tensor: torch.Tensor, src: int, group: Any) -> Any:
    """Start broadcasting ``tensor`` in place from global rank ``src`` over ``group``; the work handle."""
    return comm.broadcast(tensor, src, group=group, async_op=True)


def tensor_device(group: Any) -> torch.device:
    """The device ``group``'s collectives take tensors on (CUDA for NCCL, else CPU)."""
    return comm.tensor_device(group)


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (tensors on CPU), ordered by rank within ``group``."""
    return comm.all_gather_object(map_tensors(obj, lambda t: t.detach().cpu()), group=group)


def process_info() -> tuple[bool, int, int, str]:
    """``(initialised, global rank, world size, backend)`` of the default process group."""
    if not comm.is_initialized():
        return False, 0, 1, ""
    return True, comm.get_rank(), comm.get_world_size(), comm.get_backend()
