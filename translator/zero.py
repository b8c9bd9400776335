"""The DeepSpeed ``zero_optimization`` block for an SMP configuration.

* plain data parallelism -> stage 0;
* ``shard_optimizer_state`` -> stage 1 (optimizer state partitioned over the data-parallel ranks);
* ``sharded_data_parallel_degree`` S > 1 -> stage 3 with SMP's own fixed ZeRO-3 defaults and the
  ``sdp_*`` knobs. DeepSpeed only ever sees the shard group as its data-parallel group (the engine
  passes it in), so MiCS needs no DeepSpeed key - and ``mics_shard_size`` is gone since 0.19.7.

Key names are the ones DeepSpeed documents for its JSON config (``stage3_*`` spellings are the
aliases ``DeepSpeedZeroConfig`` reads them by).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# SMP's sharded-data-parallel defaults (backend/ds_config_defaults.json in SMP 1.12.1, see
# docs/smp-semantics.md#sharded-data-parallelism): fixed, not user-settable, so they are copied as-is.
SMP_SDP_FIXED: dict[str, Any] = {
    "overlap_comm": True,
    # SMP required contiguous_gradients off for its ZeRO-2D; kept so numerics match SMP's.
    "contiguous_gradients": False,
    "reduce_scatter": True,
    "stage3_prefetch_bucket_size": int(5e8),
    "stage3_max_reuse_distance": int(1e9),
    "sub_group_size": int(1e12),
}


def zero_stage(params: Mapping[str, Any]) -> int:
    """ZeRO stage for the resolved SMP parameters."""
    if params.get("sharded_data_parallel_degree", 1) > 1:
        return 3
    if params.get("shard_optimizer_state"):
        return 1
    return 0


def zero_block(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``zero_optimization`` dict (accepted by ``DeepSpeedZeroConfig(**block)``)."""
    stage = zero_stage(params)
    if stage == 3:
        block: dict[str, Any] = {"stage": 3, **SMP_SDP_FIXED}
        block["reduce_bucket_size"] = int(params.get("sdp_reduce_bucket_size", int(5e8)))
        block["stage3_param_persistence_threshold"] = int(
            params.get("sdp_param_persistence_threshold", int(1e6))
        )
        block["stage3_max_live_parameters"] = int(params.get("sdp_max_live_parameters", int(1e9)))
        return block
    return {"stage": stage}


def top_level(params: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level keys that go with the ZeRO block.

    ``zero_allow_untested_optimizer``: SMP accepted any torch optimizer (SGD, Adagrad, ...), while
    DeepSpeed refuses optimizers outside its tested list under ZeRO unless this is set.
    """
    if zero_stage(params) > 0:
        return {"zero_allow_untested_optimizer": True}
    return {}
