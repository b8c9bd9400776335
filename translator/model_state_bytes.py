"""Bytes of model state per parameter under DeepSpeed with Adam: the one table ``explain --params`` / ``--scale``
(``tools/estimate.py``) and ``explain --memory`` (``smp2ds.engine.memory.model_states``) both use.

Per parameter a rank's slice of the model holds (``w`` = 2 bytes in fp16/bf16, 4 in fp32):

* the parameter and its gradient, ``2 w``;
* Adam's two fp32 moments, 8;
* ZeRO stage 0 (DDP) in 16-bit: an fp32 master copy and fp32 gradients, 8 more (none in fp32: the optimizer updates
  the parameters themselves);
* ZeRO stages 1 and 3 in any precision: an fp32 copy of the partition and its fp32 gradients, 8 more (DeepSpeed
  clones the partition even in fp32).

ZeRO-1 shards the optimizer side over ``S`` ranks; ZeRO-3 (and MiCS inside its shard groups) shards everything.
So 16-bit DDP is 20 bytes per parameter, fp32 DDP 16, ZeRO-1 ``2 w + 16 / S``, ZeRO-3 ``(2 w + 16) / S``.
"""

from __future__ import annotations

FP32 = 4
ADAM_MOMENTS = 2 * FP32
"""Adam's first and second moments, fp32."""


def optimizer_bytes_per_parameter(*, half: bool, zero_stage: int) -> int:
    """The optimizer side per parameter before sharding: the moments, and the fp32 copy and gradients where
    DeepSpeed keeps them."""
    if zero_stage == 0:
        return ADAM_MOMENTS + (2 * FP32 if half else 0)
    return ADAM_MOMENTS + 2 * FP32


def model_state_bytes_per_parameter(*, width: int, zero_stage: int, shard: int = 1) -> float:
    """Parameters, gradients and optimizer state per parameter of the rank's slice, ``shard`` ranks sharing it
    (ZeRO stage 1 or 3; ignored for 0)."""
    if width not in (2, 4):
        raise ValueError(f"parameter width {width!r}: 2 (fp16/bf16) or 4 (fp32) bytes")
    if zero_stage not in (0, 1, 3):
        raise ValueError(f"ZeRO stage {zero_stage!r}: 0 (DDP), 1 or 3")
    optimizer = optimizer_bytes_per_parameter(half=width == 2, zero_stage=zero_stage)
    if zero_stage == 0:
        return 2 * width + optimizer
    if zero_stage == 1:
        return 2 * width + optimizer / shard
    return (2 * width + optimizer) / shard
