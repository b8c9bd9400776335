"""The step a plan describes, as the memory estimate needs it (`StepShape`)."""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.memory.estimate import StepShape


def step_shape(plan: Any, *, batch_per_rank: int, seq_len: int, activation_checkpointing: bool) -> StepShape:
    """`StepShape` for a translator plan (``smp2ds.translator.planner.plan``'s result); ValueError for a
    layout the estimate does not cover yet, with the reason."""
    topo = plan.topology
    ds = plan.deepspeed
    zero = dict(ds.get("zero_optimization", {}))
    stage = int(zero.get("stage", 0))
    if int(topo.get("sharded_data_parallel_degree", 1)) > 1 or stage > 1:
        raise ValueError("sharded data parallelism (ZeRO-3 inside MiCS groups) is not estimated yet: its gathered "
                         "parameters and reduce-scatter buffers have no formula here")
    dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else (
        torch.float16 if ds.get("fp16", {}).get("enabled") else torch.float32)
    return StepShape(
        pipeline_stages=int(topo["pipeline_parallel_degree"]),
        tensor_parallel=int(topo["tensor_parallel_degree"]),
        microbatches=int(plan.engine_settings.microbatches),
        batch_per_rank=batch_per_rank,
        seq_len=seq_len,
        dtype=dtype,
        zero_stage=stage,
        optimizer_shard=int(topo["rdp_degree"]) if stage == 1 else 1,
        zero_config=zero,
        activation_checkpointing=activation_checkpointing,
        memory_weight=float(plan.engine_settings.pipeline.partition.memory_weight),
        prescaled_batch=bool(plan.engine_settings.tensor_parallel.prescaled_batch),
    )
