"""The step's inputs come from the first stage: SMP's rule for pipelined ``@smp.step`` calls.

SMP scripts load batches on ``pp_rank 0`` only and pass dummies (often ``torch.empty(0)``) on the
other stages; SMP runs the step with the first stage's inputs. Here the first stage sends every
micro-batch's arguments to the other stages of its pipeline once per step, and they run the step
function (the last stage computes the loss from ``labels`` etc.) with those, never with their own.

What travels: tensors, plain values (``None``, numbers, strings, numpy arrays) and the structure
around them (tuples, lists, dicts, named tuples). Objects that do not travel (the model, an
optimizer, a tokenizer...) are marked `_Local` and taken from the receiving rank's own arguments
at the same position, so every stage must pass those itself, as SMP scripts do.

Two messages per step: the structure, pickled and small (each tensor is a `_Slot`: dtype, shape
and its place in the payload), then every tensor's bytes in one flat buffer. The second is
asynchronous: the receiving stages decode at once into views of a buffer still being filled and
wait on `InputsInFlight.wait` only where the data is first read (the last stage's first loss),
so the transfer overlaps the first stage's forward passes instead of preceding them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from smp2ds.engine.exceptions import SMPRuntimeError
from smp2ds.engine.pipeline import stage_collectives as collectives

MicroCall = tuple[tuple, dict]
_ALIGN = 16  # byte alignment of each tensor in the payload, so any dtype can view its slice
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.ndarray, torch.dtype, torch.device, torch.Size)
_MISSING = object()


class _Local:
    """Placeholder for an argument that is not sent: the receiver uses its own value."""

    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __getstate__(self) -> str:
        return self.kind

    def __setstate__(self, kind: str) -> None:
        self.kind = kind


def _is_named_tuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


class _Slot:
    """A tensor in the structure message: where its bytes sit in the payload, and how to view them."""

    __slots__ = ("dtype", "offset", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.dtype, self.shape, self.offset = dtype, shape, offset

    def __getstate__(self) -> tuple:
        return self.dtype, self.shape, self.offset

    def __setstate__(self, state: tuple) -> None:
        self.dtype, self.shape, self.offset = state

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, payload: torch.Tensor) -> torch.Tensor:
        return payload[self.offset:self.offset + self.nbytes].view(self.dtype).reshape(self.shape)


class _Packer:
    """Gives each distinct tensor a `_Slot` (a tensor passed twice, ``labels=input_ids``, gets one)."""

    def __init__(self) -> None:
        self.slots: dict[int, _Slot] = {}
        self.tensors: list[tuple[_Slot, torch.Tensor]] = []
        self.nbytes = 0

    def slot(self, t: torch.Tensor) -> _Slot:
        found = self.slots.get(id(t))
        if found is None:
            found = self.slots[id(t)] = _Slot(t.dtype, tuple(t.shape), self.nbytes)
            self.tensors.append((found, t))
            self.nbytes += -(-found.nbytes // _ALIGN) * _ALIGN
        return found

    def payload(self, device: torch.device) -> torch.Tensor:
        """Every tensor's bytes, at its slot's offset, in one uint8 buffer on ``device``."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for slot, t in self.tensors:
            flat[slot.offset:slot.offset + slot.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return flat


def encode(obj: Any, packer: _Packer) -> Any:
    """The first stage's argument as the structure message: tensors become `_Slot`s of ``packer``."""
    if isinstance(obj, torch.Tensor):
        return packer.slot(obj)
    if isinstance(obj, _PLAIN):
        return obj
    if type(obj) is dict:
        return {k: encode(v, packer) for k, v in obj.items()}
    if isinstance(obj, Mapping):  # ModelOutput, OrderedDict, a tokenizer's BatchEncoding...
        return _MappingParts(type(obj), {k: encode(v, packer) for k, v in obj.items()})
    if _is_named_tuple(obj):
        return _NamedTupleParts(type(obj), tuple(encode(v, packer) for v in obj))
    if type(obj) in (list, tuple):
        return type(obj)(encode(v, packer) for v in obj)
    return _Local(type(obj).__name__)


class _MappingParts:
    """A mapping other than a plain dict: its class and items (rebuilt as that class when possible)."""

    def __init__(self, cls: type, items: dict):
        self.cls, self.items = cls, items

    def rebuild(self, items: dict) -> Any:
        if collectives.is_model_output_class(self.cls):
            return self.cls(**items)
        try:
            return self.cls(items)
        except TypeError:
            return items


class _NamedTupleParts:
    def __init__(self, cls: type, values: tuple):
        self.cls, self.values = cls, values


def decode(enc: Any, local: Any, where: str, payload: torch.Tensor) -> Any:
    """Rebuild the first stage's value; `_Local` leaves take ``local`` (this rank's own value) and
    `_Slot` leaves become views of ``payload``."""
    if isinstance(enc, _Slot):
        return enc.view(payload)
    if isinstance(enc, _Local):
        if local is _MISSING:
            raise SMPRuntimeError(
                f"step argument {where} ({enc.kind} on the first pipeline stage) is missing on this stage: "
                "every stage must pass the step function the same non-tensor arguments (the model, optimizer "
                "...); only tensors and plain values are taken from the first stage")
        return local
    if isinstance(enc, dict):
        return {k: decode(v, _child(local, k), f"{where}[{k!r}]", payload) for k, v in enc.items()}
    if isinstance(enc, _MappingParts):
        return enc.rebuild({k: decode(v, _child(local, k), f"{where}[{k!r}]", payload)
                            for k, v in enc.items.items()})
    if isinstance(enc, _NamedTupleParts):
        return enc.cls(*(decode(v, _child(local, i), f"{where}[{i}]", payload) for i, v in enumerate(enc.values)))
    if type(enc) in (list, tuple):
        return type(enc)(decode(v, _child(local, i), f"{where}[{i}]", payload) for i, v in enumerate(enc))
    return enc


def _child(local: Any, key: Any) -> Any:
    """``local[key]`` when this rank's argument has that position, else a missing marker."""
    try:
        if isinstance(local, Mapping):
            return local[key] if key in local else _MISSING
        if isinstance(local, (list, tuple)) and isinstance(key, int):
            return local[key] if key < len(local) else _MISSING
    except (TypeError, KeyError, IndexError):
        return _MISSING
    return _MISSING


class EncodedCalls:
    """The structure message (picklable, small) and the payload size it describes."""

    def __init__(self, calls: list[tuple[tuple, dict]], nbytes: int):
        self.calls, self.nbytes = calls, nbytes


def encode_calls(calls: Sequence[MicroCall], device: torch.device | None = None) -> tuple[EncodedCalls, torch.Tensor]:
    """Every micro-batch's ``(args, kwargs)`` of the first stage: the structure and the payload."""
    packer = _Packer()
    structure = [(tuple(encode(a, packer) for a in args), {k: encode(v, packer) for k, v in kwargs.items()})
                 for args, kwargs in calls]
    return EncodedCalls(structure, packer.nbytes), packer.payload(device or torch.device("cpu"))


def decode_calls(encoded: EncodedCalls, payload: torch.Tensor, local_calls: Sequence[MicroCall]) -> list[MicroCall]:
    """The first stage's micro-batch calls, with this rank's own objects where nothing was sent.

    Tensors are views of ``payload`` (they hold its data once the payload has arrived).
    """
    out = []
    for i, (args, kwargs) in enumerate(encoded.calls):
        local_args, local_kwargs = local_calls[i] if i < len(local_calls) else ((), {})
        new_args = tuple(decode(a, local_args[j] if j < len(local_args) else _MISSING, f"#{j}", payload)
                         for j, a in enumerate(args))
        new_kwargs = {k: decode(v, local_kwargs.get(k, _MISSING), repr(k), payload) for k, v in kwargs.items()}
        out.append((new_args, new_kwargs))
    return out


class InputsInFlight:
    """The first stage's micro-batch calls on this rank, and the payload transfer still under way."""

    def __init__(self, calls: list[MicroCall], work: Any = None, payload: torch.Tensor | None = None):
        self.calls = calls
        self._work, self._payload = work, payload  # the buffer must live until the transfer ends

    def wait(self) -> None:
        """Block until the tensors in ``calls`` hold the first stage's data (idempotent)."""
        if self._work is not None:
            self._work.wait()
        self._work = self._payload = None


def from_first_stage(calls: Sequence[MicroCall], *, is_first: bool, src: int, group: Any) -> InputsInFlight:
    """Every rank of the pipeline gets the first stage's micro-batch calls (collective over ``group``).

    On the first stage ``calls`` are kept unchanged; elsewhere they only supply the objects that
    are not sent (see `decode`). Tensors arrive on the group's communication device. Call
    ``wait()`` on the result before reading a received tensor and before the next collective on
    ``group``.
    """
    device = collectives.tensor_device(group)
    if is_first:
        structure, payload = encode_calls(calls, device)
        collectives.broadcast_raw(structure, src, group)
    else:
        structure = collectives.broadcast_raw(None, src, group)
        payload = torch.empty(structure.nbytes, dtype=torch.uint8, device=device)
    work = collectives.broadcast_tensor_async(payload, src, group) if payload.numel() else None
    return InputsInFlight(list(calls) if is_first else decode_calls(structure, payload, calls), work, payload)
