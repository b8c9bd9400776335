"""Loading checkpoint files safely: ``weights_only=True`` and memory-mapped, errors naming the file.

A checkpoint folder can hold anything: a file cut short by a full disk, a pickle some other
program wrote, a file that is not a pickle at all. ``torch.load(weights_only=True)`` refuses to
run code from a pickle, and every failure becomes an :class:`SMPCheckpointError` that names the
file and says what is wrong with it, never a traceback from deep inside ``pickle``.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any

import torch

from smp2ds.engine.core.checkpoint_format import LOAD_INFO, SDP_MODULE
from smp2ds.engine.core.safe_load import deepspeed_globals
from smp2ds.engine.exceptions import SMPCheckpointError


def load_weights(path: str, mmap: bool = True, deepspeed_state: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``, memory-mapped when the file allows it.

    Memory-mapping needs the zip format ``torch.save`` writes since torch 1.6; an older file is
    read into memory instead. ``deepspeed_state`` also allows ``deepspeed_globals`` (an
    optimizer file of a ZeRO run holds them; the runtime's list, :mod:`smp2ds.engine.core.safe_load`).
    """
    if not os.path.isfile(path):
        raise SMPCheckpointError(f"{path}: file is missing")
    use_mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(list(deepspeed_globals()) if deepspeed_state else []):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SMPCheckpointError(
            f"{path}: not a checkpoint smp2ds can read safely (weights_only=True refused it: {first}); it holds "
            "objects other than tensors and plain containers, e.g. a pickle written by another program") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SMPCheckpointError(f"{path}: unreadable ({_diagnose(path)}; torch said: {first})") from None


def _diagnose(path: str) -> str:
    """A short guess at why ``path`` did not load: truncated zip, empty, or not a torch file."""
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty"
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        return f"the file is truncated or corrupt ({size} bytes, its zip directory is missing)"
    if head[:1] == b"\x80":
        return "a legacy pickle that did not load; it may be truncated"
    return "not a file torch.save wrote"


def model_tensors(path: str, mmap: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a model state-dict file (SMP's markers ``_smp_*`` left out).

    Anything but a dict of name -> tensor is refused, naming the file.
    """
    obj = load_weights(path, mmap=mmap)
    if isinstance(obj, dict) and isinstance(obj.get(SDP_MODULE), dict):  # SMP's sharded-data-parallel model_0.pt
        obj = _sdp_module(obj)
    if not isinstance(obj, dict):
        raise SMPCheckpointError(f"{path}: expected a model state dict (a dict of name -> tensor), "
                                 f"found a {type(obj).__name__}")
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        if isinstance(key, str) and key.startswith("_smp"):
            continue
        if not isinstance(value, torch.Tensor):
            raise SMPCheckpointError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; this is not "
                                     "a model state dict")
        out[key] = value
    return out


def _sdp_module(obj: dict[str, Any]) -> dict[str, Any]:
    """``module`` of SMP's ``model_0.pt``, in its order (SMP's empty placeholders of partitioned parameters kept:
    :class:`~smp2ds.engine.checkpoint_tools.consolidate.ShardReader` fills them from the optimizer files)."""
    return dict(obj[SDP_MODULE])


def load_info(path: str) -> dict[str, Any]:
    """SMP's ``_smp_load_info`` marker of a partial model file (empty when absent)."""
    obj = load_weights(path, mmap=True)
    info = obj.get(LOAD_INFO) if isinstance(obj, dict) else None
    return dict(info) if isinstance(info, dict) else {}
