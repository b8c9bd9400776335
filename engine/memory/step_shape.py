"""The step a plan describes, as the memory estimate needs it (`StepShape`)."""

from __future__ import annotations

import torch

from smp2ds.engine.memory.estimate import StepShape
from smp2ds.translator.plan_types import Plan


def step_shape(plan: Plan, *, batch_per_rank: int, seq_len: int, activation_checkpointing: bool,
               backend: str = "nccl") -> StepShape:
    """`StepShape` for a translator plan (``smp2ds.translator.planner.plan``'s result); ValueError for a
    layout the estimate does not cover yet, with the reason. Sharded data parallelism partitions over the
    shard group (``sharded_data_parallel_degree``) and replicates over ``rdp / sdp`` groups. ``backend``: the
    collectives' (``gloo`` for CPU ranks)."""
    topo, settings = plan.topology_settings, plan.engine_settings
    zero = dict(plan.deepspeed.get("zero_optimization", {}))  # DeepSpeed's own knobs (buckets, thresholds)
    stage = settings.zero_stage
    sdp = topo.sharded_data_parallel_degree
    if stage == 2 or (stage == 3 and sdp < 2):
        raise ValueError(f"ZeRO stage {stage} without sharded data parallelism is not estimated: the estimate covers "
                         "DDP, ZeRO-1 (shard_optimizer_state) and ZeRO-3 inside MiCS groups "
                         "(sharded_data_parallel_degree > 1)")
    shard = sdp if stage == 3 else topo.rdp_degree if stage == 1 else 1
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(settings.precision.dtype, torch.float32)
    return StepShape(
        pipeline_stages=topo.pipeline_parallel_degree,
        tensor_parallel=topo.tensor_parallel_degree,
        microbatches=settings.microbatches,
        batch_per_rank=batch_per_rank,
        seq_len=seq_len,
        dtype=dtype,
        zero_stage=stage,
        optimizer_shard=shard,
        replicas=topo.rdp_degree // sdp if stage == 3 else 1,
        zero_config=zero,
        activation_checkpointing=activation_checkpointing,
        memory_weight=float(settings.pipeline.partition.memory_weight),
        prescaled_batch=bool(settings.tensor_parallel.prescaled_batch),
        backend=backend,
    )
