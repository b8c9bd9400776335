"""What every backend asks of DeepSpeed's optimizer object, as functions the backends compose.

DeepSpeed wraps the script's optimizer in the same objects whatever engine drives it (its fp16/bf16
wrappers, the ZeRO optimizers, or the script's optimizer itself for fp32 without ZeRO), so the
data-parallel and the pipeline backend read the loss scale, the overflow flag and the ZeRO gradient
norm, set clipping and load partitioned state the same way. Functions, not a base class: each
backend keeps only the members it implements itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError


def overflow(ds_optimizer: Any) -> bool:
    """True when DeepSpeed skipped the last step because fp16 gradients overflowed."""
    return bool(getattr(ds_optimizer, "overflow", False))


def loss_scale(ds_optimizer: Any) -> float:
    """The current loss scale (1.0 where DeepSpeed's optimizer does not scale)."""
    for name in ("loss_scale", "cur_scale"):
        value = getattr(ds_optimizer, name, None)
        if isinstance(value, (int, float, torch.Tensor)):
            return float(value)
    return 1.0


def zero_grad_norm(ds_optimizer: Any, norm_type: float) -> torch.Tensor:
    """The global L2 norm of the unscaled gradients from DeepSpeed's ZeRO optimizer (``inf`` on overflow)."""
    if norm_type != 2:
        raise SMPUnsupportedError("with shard_optimizer_state only the L2 gradient norm is available")
    norm = torch.as_tensor(ds_optimizer.scaled_global_norm(), dtype=torch.float32)
    # DeepSpeed reports an overflowed norm as -1
    return torch.where(norm < 0, torch.tensor(float("inf")), norm) / loss_scale(ds_optimizer)


def scale_grads(params: Iterable[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Clip now, in place: where DeepSpeed steps the script's fp32 optimizer nothing clips for us."""
    if torch.isfinite(norm) and float(norm) > max_norm:
        coef = max_norm / (float(norm) + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef)


def clip_in_step(ds_optimizer: Any, max_norm: float) -> Callable[[], None] | None:
    """Make DeepSpeed's optimizer clip at ``max_norm`` in its next step; returns the function that
    restores its configured value afterwards (None when the optimizer cannot clip)."""
    if not hasattr(ds_optimizer, "clip_grad"):
        warnings.warn(f"{type(ds_optimizer).__name__} has no clip_grad; clip_master_grads cannot clip",
                      stacklevel=4)
        return None
    previous = ds_optimizer.clip_grad
    ds_optimizer.clip_grad = float(max_norm)

    def restore() -> None:
        ds_optimizer.clip_grad = previous

    return restore


def load_state(ds_optimizer: Any, sd: dict, zero_stage: int, partition: tuple[int, int]) -> None:
    """Load this rank's optimizer state: its ZeRO-1 partition (``partition`` = (index, count)) when sharded."""
    index, count = partition
    if zero_stage >= 1:
        shards: Sequence[Any] = [sd if r == index else None for r in range(count)]
        ds_optimizer.load_state_dict(list(shards), load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        ds_optimizer.load_state_dict(sd)
