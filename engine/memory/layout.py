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
    topo = plan.topology_settings
    ds = plan.deepspeed
    zero = dict(ds.get("zero_optimization", {}))
    stage = int(zero.get("stage", 0))
    sdp = topo.sharded_data_parallel_degree
    if stage == 2 or (stage == 3 and sdp < 2):
        raise ValueError(f"ZeRO stage {stage} without sharded data parallelism is not estimated: the estimate covers "
                         "DDP, ZeRO-1 (shard_optimizer_state) and ZeRO-3 inside MiCS groups "
                         "(sharded_data_parallel_degree > 1)")
    shard = sdp if stage == 3 else topo.rdp_degree if stage == 1 else 1
    dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else (
        torch.float16 if ds.get("fp16", {}).get("enabled") else torch.float32)
    return StepShape(
        pipeline_stages=topo.pipeline_parallel_degree,
        tensor_parallel=topo.tensor_parallel_degree,
        microbatches=int(plan.engine_settings.microbatches),
        batch_per_rank=batch_per_rank,
        seq_len=seq_len,
        dtype=dtype,
        zero_stage=stage,
        optimizer_shard=shard,
        replicas=topo.rdp_degree // sdp if stage == 3 else 1,
        zero_config=zero,
        activation_checkpointing=activation_checkpointing,
        memory_weight=float(plan.engine_settings.pipeline.partition.memory_weight),
        prescaled_batch=bool(plan.engine_settings.tensor_parallel.prescaled_batch),
        backend=backend,
    )
