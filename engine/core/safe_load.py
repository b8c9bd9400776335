"""Reading checkpoint files without running code hidden in them.

A checkpoint folder on a shared bucket can hold a pickle that runs code on every rank that unpickles it. PyTorch
made ``weights_only=True`` its default in 2.6 for this reason; smp2ds reads every checkpoint file that way:

* model and optimizer files: tensors, plain containers, and the few data-only DeepSpeed classes a ZeRO optimizer
  state holds (:func:`deepspeed_globals`: its stage enum, loss scaler and ZeRO-1 slice addresses);
* ``user_content`` and ``smp.load``: also the types SMP scripts put there, allowed by name
  (:func:`user_content_global`): Hugging Face configs, ``argparse.Namespace``, numpy scalars and arrays (an
  LR scheduler's state is a plain dict already).

Anything else is refused before a byte is unpickled (``torch.serialization.get_unsafe_globals_in_checkpoint`` lists
what a file references), with one message naming the types and the switch that trusts the checkpoint:
``SMP2DS_TRUST_CHECKPOINTS=1`` for an unchanged script, ``trust_checkpoint=True`` to
``smp.resume_from_checkpoint``, or ``weights_only=False`` to ``smp.load``.
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

from smp2ds.engine.exceptions import SMPCheckpointError

TRUST_ENV = "SMP2DS_TRUST_CHECKPOINTS"
"""Set to 1 to load checkpoints with ``weights_only=False`` (only for checkpoints you trust)."""

SWITCHES = (f"{TRUST_ENV}=1 in the environment, smp.resume_from_checkpoint(..., trust_checkpoint=True) or "
            "smp.load(..., weights_only=False)")


def trusted_by_environment() -> bool:
    """``SMP2DS_TRUST_CHECKPOINTS`` is set to 1 (refused when set to anything but 0 or 1)."""
    value = os.environ.get(TRUST_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise SMPCheckpointError(f"environment variable {TRUST_ENV}={value!r} is not a switch; allowed: 0 or 1")
    return value == "1"


@functools.cache
def deepspeed_globals() -> tuple[Any, ...]:
    """The data-only DeepSpeed classes a ZeRO optimizer state dict pickles (attributes only: no code runs to
    rebuild them)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)


_NUMPY = {"numpy.dtype", "numpy.ndarray", "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
          "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"}


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None


def user_content_global(name: str) -> Any:
    """The class or function ``name`` (as a pickle references it) when SMP scripts' ``user_content`` may hold it,
    else None. Only names of these forms are ever imported: transformers' config classes, argparse's
    ``Namespace``, numpy's array, scalar and dtype reconstruction."""
    if name == "argparse.Namespace" or name in _NUMPY or (name.startswith("numpy.dtypes.") and name.endswith("DType")):
        return _resolve(name)
    if name.startswith("transformers."):
        from transformers import PretrainedConfig  # start-up: only when a checkpoint holds a config

        found = _resolve(name)
        return found if isinstance(found, type) and issubclass(found, PretrainedConfig) else None
    return None


@functools.cache
def _numpy_dtype_classes() -> tuple[Any, ...]:
    """numpy's dtype classes (``Float64DType``, ...): unpickling a numpy dtype builds one of them."""
    import numpy

    return tuple(getattr(numpy.dtypes, n) for n in dir(numpy.dtypes) if n.endswith("DType"))


def _referenced_globals(path: str) -> list[str]:
    if not zipfile.is_zipfile(path):
        return []  # a legacy pickle: weights_only refuses any global it does not know, naming it
    return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))


def load(path: str, *, user_content: bool = False, trust: bool | None = None, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, map_location="cpu")`` allowing :func:`deepspeed_globals` (and with
    ``user_content`` the types :func:`user_content_global` names); ``trust`` (default: the environment switch)
    loads with ``weights_only=False``. Refuses, naming the types, a file that references anything else."""
    kwargs.setdefault("map_location", "cpu")
    if trust if trust is not None else trusted_by_environment():
        return torch.load(path, weights_only=False, **kwargs)
    allowed: dict[str, Any] = {f"{g.__module__}.{g.__qualname__}": g for g in deepspeed_globals()}
    refused = []
    for name in _referenced_globals(path):
        found = allowed.get(name) or (user_content_global(name) if user_content else None)
        if found is None:
            refused.append(name)
        else:
            allowed[name] = found
    if refused:
        raise _refusal(path, refused)
    extra = _numpy_dtype_classes() if "numpy.dtype" in allowed else ()
    try:
        with torch.serialization.safe_globals([*allowed.values(), *extra]):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise _refusal(path, [str(exc).strip().splitlines()[0] if str(exc).strip() else "an unknown object"]) \
            from None


def _refusal(path: str, what: Iterable[str]) -> SMPCheckpointError:
    return SMPCheckpointError(
        f"{path} references {', '.join(sorted(set(what)))}, which smp2ds does not unpickle: loading it could run "
        f"code hidden in the checkpoint. If you trust this checkpoint, set {SWITCHES}")
