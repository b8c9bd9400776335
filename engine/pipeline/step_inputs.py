"""The step's inputs come from the first stage: SMP's rule for pipelined ``@smp.step`` calls.

SMP scripts load batches on ``pp_rank 0`` only and pass dummies (often ``torch.empty(0)``) on the
other stages; SMP runs the step with the first stage's inputs. Here the first stage sends every
micro-batch's arguments to the other stages of its pipeline once per step, and they run the step
function (the last stage computes the loss from ``labels`` etc.) with those, never with their own.

What travels: tensors (as raw bytes), plain values (``None``, numbers, strings, numpy arrays) and
the structure around them (tuples, lists, dicts, named tuples). Objects that do not travel (the
model, an optimizer, a tokenizer...) are marked `_Local` and taken from the receiving rank's own
arguments at the same position, so every stage must pass those itself, as SMP scripts do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from smp2ds.engine.exceptions import SMPRuntimeError
from smp2ds.engine.pipeline import stage_collectives as collectives

MicroCall = tuple[tuple, dict]
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


def encode(obj: Any, memo: dict[int, collectives.Packed] | None = None) -> Any:
    """The first stage's arguments as something cheap to pickle (see the module docstring).

    ``memo`` packs a tensor passed several times (``labels=input_ids``, a ``non_split_inputs``
    tensor in every micro-batch) once: pickle then sends the shared object once.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        packed = memo.get(id(obj))
        if packed is None:
            packed = memo[id(obj)] = collectives.Packed(obj)
        return packed
    if isinstance(obj, _PLAIN):
        return obj
    if type(obj) is dict:
        return {k: encode(v, memo) for k, v in obj.items()}
    if isinstance(obj, Mapping):  # ModelOutput, OrderedDict, a tokenizer's BatchEncoding...
        return _MappingParts(type(obj), {k: encode(v, memo) for k, v in obj.items()})
    if _is_named_tuple(obj):
        return _NamedTupleParts(type(obj), tuple(encode(v, memo) for v in obj))
    if type(obj) in (list, tuple):
        return type(obj)(encode(v, memo) for v in obj)
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


def decode(enc: Any, local: Any, where: str) -> Any:
    """Rebuild the first stage's value; `_Local` leaves take ``local`` (this rank's own value)."""
    if isinstance(enc, collectives.Packed):
        return enc.unpack()
    if isinstance(enc, _Local):
        if local is _MISSING:
            raise SMPRuntimeError(
                f"step argument {where} ({enc.kind} on the first pipeline stage) is missing on this stage: "
                "every stage must pass the step function the same non-tensor arguments (the model, optimizer "
                "...); only tensors and plain values are taken from the first stage")
        return local
    if isinstance(enc, dict):
        return {k: decode(v, _child(local, k), f"{where}[{k!r}]") for k, v in enc.items()}
    if isinstance(enc, _MappingParts):
        return enc.rebuild({k: decode(v, _child(local, k), f"{where}[{k!r}]") for k, v in enc.items.items()})
    if isinstance(enc, _NamedTupleParts):
        return enc.cls(*(decode(v, _child(local, i), f"{where}[{i}]") for i, v in enumerate(enc.values)))
    if type(enc) in (list, tuple):
        return type(enc)(decode(v, _child(local, i), f"{where}[{i}]") for i, v in enumerate(enc))
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


def encode_calls(calls: Sequence[MicroCall]) -> list[tuple[tuple, dict]]:
    """Every micro-batch's ``(args, kwargs)`` of the first stage, ready to broadcast."""
    memo: dict[int, collectives.Packed] = {}
    return [(tuple(encode(a, memo) for a in args), {k: encode(v, memo) for k, v in kwargs.items()})
            for args, kwargs in calls]


def decode_calls(encoded: Sequence[tuple[tuple, dict]], local_calls: Sequence[MicroCall]) -> list[MicroCall]:
    """The first stage's micro-batch calls, with this rank's own objects where nothing was sent."""
    out = []
    for i, (args, kwargs) in enumerate(encoded):
        local_args, local_kwargs = local_calls[i] if i < len(local_calls) else ((), {})
        new_args = tuple(decode(a, local_args[j] if j < len(local_args) else _MISSING, f"#{j}")
                         for j, a in enumerate(args))
        new_kwargs = {k: decode(v, local_kwargs.get(k, _MISSING), repr(k)) for k, v in kwargs.items()}
        out.append((new_args, new_kwargs))
    return out


def from_first_stage(calls: Sequence[MicroCall], *, is_first: bool, src: int, group: Any) -> list[MicroCall]:
    """Every rank of the pipeline gets the first stage's micro-batch calls (collective over ``group``).

    On the first stage ``calls`` are returned unchanged; elsewhere they only supply the objects
    that are not sent (see `decode`). Tensors arrive on CPU.
    """
    payload = encode_calls(calls) if is_first else None
    received = collectives.broadcast_raw(payload, src, group)
    if is_first:
        return list(calls)
    return decode_calls(received, calls)
