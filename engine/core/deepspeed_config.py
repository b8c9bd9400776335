"""Turn the Plan's DeepSpeed config into the one the engine hands to ``deepspeed.initialize``.

The translator's ``plan.deepspeed`` says what the user's SMP configuration means. The engine
adds only what depends on the running process: loss-scaling arguments given to
``smp.DistributedOptimizer`` (SMP puts them there, not in the config), batch bookkeeping keys
consistent with the real data-parallel size, and switches our step machinery relies on.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SMP_DYNAMIC_DEFAULTS = {"init_scale": 2.0**32, "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1.0,
                        "delayed_shift": 1, "consecutive_hysteresis": False}
"""SMP's dynamic loss-scaler defaults (docs/smp-semantics.md#precision)."""


@dataclass(frozen=True)
class LossScaleArgs:
    """``smp.DistributedOptimizer``'s loss-scaling arguments."""

    static_loss_scale: float | None = 1.0
    dynamic_loss_scale: bool = False
    dynamic_loss_args: Mapping[str, Any] | None = None


def fp16_block(args: LossScaleArgs) -> dict[str, Any]:
    """DeepSpeed ``fp16`` keys for SMP's loss-scaling arguments (docs/smp-semantics.md#precision)."""
    if not args.dynamic_loss_scale:
        scale = 1.0 if args.static_loss_scale is None else float(args.static_loss_scale)
        return {"loss_scale": scale}
    given = dict(args.dynamic_loss_args or {})
    unknown = sorted(set(given) - set(SMP_DYNAMIC_DEFAULTS))
    if unknown:
        raise ValueError(f"dynamic_loss_args has unknown key(s) {unknown}; allowed: {sorted(SMP_DYNAMIC_DEFAULTS)}")
    merged = {**SMP_DYNAMIC_DEFAULTS, **given}
    if float(merged["scale_factor"]) != 2.0:
        warnings.warn(f"dynamic_loss_args scale_factor={merged['scale_factor']} is not supported by DeepSpeed, "
                      "which always scales by 2; using 2", stacklevel=4)
    power = math.log2(float(merged["init_scale"]))
    if power != int(power):
        warnings.warn(f"dynamic_loss_args init_scale={merged['init_scale']} is not a power of 2; DeepSpeed "
                      f"starts at 2**{round(power)}", stacklevel=4)
    return {
        "loss_scale": 0,
        "initial_scale_power": round(power),
        "loss_scale_window": int(merged["scale_window"]),
        "min_loss_scale": float(merged["min_scale"]),
        "hysteresis": int(merged["delayed_shift"]),
        "consecutive_hysteresis": bool(merged["consecutive_hysteresis"]),
    }


def engine_config(plan_ds: Mapping[str, Any], *, microbatches: int,
                  loss_scale: LossScaleArgs | None = None) -> dict[str, Any]:
    """The DeepSpeed config for a data-parallel engine built from ``plan_ds``."""
    ds = copy.deepcopy(dict(plan_ds))
    # Batch keys are bookkeeping for us: smp.step owns micro-batching. Keep the plan's
    # micro-batch size when known and drop train_batch_size so DeepSpeed derives it from the
    # real data-parallel size instead of asserting on a stale product.
    ds.pop("train_batch_size", None)
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds["gradient_accumulation_steps"] = int(ds.get("gradient_accumulation_steps") or microbatches)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    # Any torch optimizer the script built is accepted, as under SMP.
    ds["zero_allow_untested_optimizer"] = True
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict) and int(zero.get("stage", 0)) <= 1:
        # We reduce once per optimizer step after the micro-batch loop (engine.allreduce_gradients);
        # stage-1 overlap hooks would reduce during backward instead.
        zero["overlap_comm"] = False
    fp16 = ds.get("fp16")
    if isinstance(fp16, dict) and fp16.get("enabled") and loss_scale is not None:
        for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis",
                    "consecutive_hysteresis"):
            fp16.pop(key, None)
        fp16.update(fp16_block(loss_scale))
    return ds


def precision(ds: Mapping[str, Any]) -> str:
    """``"fp16"``, ``"bf16"`` or ``"fp32"`` as the DeepSpeed config says."""
    if isinstance(ds.get("fp16"), Mapping) and ds["fp16"].get("enabled"):
        return "fp16"
    for key in ("bf16", "bfloat16"):
        if isinstance(ds.get(key), Mapping) and ds[key].get("enabled"):
            return "bf16"
    return "fp32"


def zero_stage(ds: Mapping[str, Any]) -> int:
    zero = ds.get("zero_optimization")
    return int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0
