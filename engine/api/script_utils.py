"""Helpers SMP's public scripts import from ``smdistributed.modelparallel.torch.utils``."""

from __future__ import annotations

from typing import Any

from smp2ds.engine.core.ranks import rank
from smp2ds.engine.nn.parallel.shards import spec_of


def rmsg(msg: str) -> str:
    """``msg`` prefixed with this process's global rank, as SMP's logs show it: ``"[3] msg"``."""
    return f"[{rank()}] {msg}"


def get_distribution_axis(obj: Any) -> int | None:
    """The dimension along which tensor parallelism split parameter ``obj`` across the tensor-parallel ranks, or
    None when ``obj`` is not split (replicated, or tensor parallelism is off)."""
    spec = spec_of(obj) if hasattr(obj, "shape") else None
    return None if spec is None else spec.dim
