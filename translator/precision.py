"""Precision: SMP ``fp16`` / ``bf16`` and ``DistributedOptimizer`` loss scaling -> DeepSpeed blocks.

SMP decides the loss scaler when the script calls ``smp.DistributedOptimizer(opt,
static_loss_scale, dynamic_loss_scale, dynamic_loss_args)``, i.e. at run time. The plan therefore
shows dynamic scaling with SMP's dynamic-scaler defaults, and the engine calls
:func:`fp16_block` again with the script's real arguments. Pure functions, usable by both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .bf16_settings import bf16_block

Dtype = Literal["fp16", "bf16", "fp32"]

# SMP's DynamicLossScaler defaults (docs/smp-semantics.md#precision).
SMP_DYNAMIC_LOSS_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
}


def dtype_of(params: Mapping[str, Any]) -> Dtype:
    """Training dtype: ``fp16`` (also for the deprecated ``fp16_params``), ``bf16`` or ``fp32``."""
    if params.get("fp16") or params.get("fp16_params"):
        return "fp16"
    if params.get("bf16"):
        return "bf16"
    return "fp32"


@dataclass(frozen=True, kw_only=True)
class PrecisionSettings:
    """The Plan's ``/engine/precision`` (the defaults here are the only ones)."""

    dtype: Dtype = "fp32"
    loss_scale: str = (
        "from smp.DistributedOptimizer(static_loss_scale, dynamic_loss_scale, dynamic_loss_args) at run time; "
        "/deepspeed/fp16 shows SMP's dynamic-scaler defaults"
    )
    """Where the loss scaler comes from: the script's optimizer wrapper, not the config."""


def fp16_block(
    static_loss_scale: float | None = None,
    dynamic_loss_scale: bool = True,
    dynamic_loss_args: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """DeepSpeed's ``fp16`` block for SMP's loss-scale arguments, plus remarks on inexact parts.

    Mapping (docs/smp-semantics.md#precision): init_scale -> initial_scale_power (log2), scale_window ->
    loss_scale_window, min_scale -> min_loss_scale, delayed_shift -> hysteresis,
    consecutive_hysteresis -> consecutive_hysteresis; a static scale -> loss_scale.
    Raises ValueError for values DeepSpeed cannot represent at all (non-positive scales, unknown keys).
    """
    remarks: list[str] = []
    if not dynamic_loss_scale:
        scale = 1.0 if static_loss_scale is None else float(static_loss_scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"static_loss_scale must be a positive finite number, got {static_loss_scale!r}")
        return {"enabled": True, "loss_scale": scale}, remarks
    args = dict(SMP_DYNAMIC_LOSS_DEFAULTS)
    unknown = sorted(set(dynamic_loss_args or {}) - set(args))
    if unknown:
        raise ValueError(f"dynamic_loss_args has unknown keys {unknown}; allowed: {sorted(args)}")
    args.update(dynamic_loss_args or {})
    init = float(args["init_scale"])
    if not math.isfinite(init) or init <= 0:
        raise ValueError(f"dynamic_loss_args.init_scale must be a positive finite number, got {init!r}")
    power = round(math.log2(init))
    if 2.0**power != init:
        remarks.append(f"init_scale {init:g} is not a power of two; DeepSpeed starts at 2**{power}")
    if float(args["scale_factor"]) != 2.0:
        remarks.append(f"scale_factor {args['scale_factor']} is not supported; DeepSpeed always scales by 2")
    min_scale = float(args["min_scale"])
    min_loss = max(1, math.ceil(min_scale))
    if min_loss != min_scale:
        remarks.append(
            f"min_scale {min_scale:g} rounded to {min_loss}: DeepSpeed's min_loss_scale is an int >= 1"
        )
    block = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": power,
        "loss_scale_window": int(args["scale_window"]),
        "hysteresis": int(args["delayed_shift"]),
        "consecutive_hysteresis": bool(args["consecutive_hysteresis"]),
        "min_loss_scale": min_loss,
    }
    return block, remarks


def precision_blocks(params: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level ``fp16`` and ``bf16`` blocks (both always present, so the choice is explicit); the bf16
    block writes out the speed switches :mod:`smp2ds.translator.bf16_settings` chooses."""
    dtype = dtype_of(params)
    fp16: dict[str, Any] = {"enabled": False}
    if dtype == "fp16":
        fp16, _ = fp16_block()
    return {"fp16": fp16, "bf16": bf16_block(params) if dtype == "bf16" else {"enabled": False}}


def gradient_clipping(params: Mapping[str, Any]) -> float:
    """Explicit clipping: SMP clipped only with sharded data parallelism (``sdp_gradient_clipping``).

    DeepSpeed >= 0.19.3 defaults to 1.0, so 0.0 must be written out to keep SMP's no-clipping.
    """
    if params.get("sharded_data_parallel_degree", 1) > 1:
        return float(params.get("sdp_gradient_clipping", 1.0))
    return 0.0


def torch_dtype_name(dtype: Dtype) -> str:
    """``torch.<dtype>`` spelling used in Megatron's ``params_dtype``."""
    return {"fp16": "torch.float16", "bf16": "torch.bfloat16", "fp32": "torch.float32"}[dtype]
