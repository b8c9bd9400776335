"""Small pure helpers for ``DistributedModel``: dtype casting of nested inputs/outputs,
the scalar handed to DeepSpeed's backward, and state-dict housekeeping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.core.checkpoint_format import MARKERS


def cast_floating(obj: Any, dtype: torch.dtype, only: torch.dtype | None = None) -> Any:
    """Cast floating tensors inside ``obj`` (tuples, lists, dicts, HF ModelOutput) to ``dtype``.

    With ``only``, just tensors of that dtype are cast (used to upcast 16-bit outputs to fp32,
    as SMP's 16-bit module wrapper did, leaving integer and fp32 outputs alone).
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and (only is None or obj.dtype == only) and obj.dtype != dtype:
            return obj.to(dtype)
        return obj
    if hasattr(obj, "to_tuple") and isinstance(obj, Mapping):
        for key in list(obj.keys()):
            obj[key] = cast_floating(obj[key], dtype, only)
        return obj
    if isinstance(obj, Mapping):
        items = {k: cast_floating(v, dtype, only) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_floating(v, dtype, only) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(v, dtype, only) for v in obj)
    return obj


def scalar_for_backward(tensors: Any, grad_tensors: Any = None) -> torch.Tensor:
    """One scalar whose gradient equals ``torch.autograd.backward(tensors, grad_tensors)``.

    DeepSpeed's backward takes a scalar loss; ``sum(t * g)`` has exactly the requested
    vector-Jacobian product as its gradient.
    """
    ts = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    if grad_tensors is None:
        gs: list[Any] = [None] * len(ts)
    else:
        gs = list(grad_tensors) if isinstance(grad_tensors, (list, tuple)) else [grad_tensors]
    if len(gs) != len(ts):
        raise ValueError(f"model.backward got {len(ts)} tensors but {len(gs)} grad_tensors")
    total = None
    for t, g in zip(ts, gs):
        if g is None:
            if t.numel() != 1:
                raise ValueError(
                    f"model.backward needs grad_tensors for a non-scalar tensor of shape {tuple(t.shape)}"
                )
            term = t.reshape(())
        else:
            term = (t * g.to(t.dtype)).sum()
        total = term if total is None else total + term
    return total.float() if total.dtype in (torch.float16, torch.bfloat16) else total


def to_cpu(sd: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def strip_markers(sd: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sd.items() if k not in MARKERS}
