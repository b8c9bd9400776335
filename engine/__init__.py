"""smp2ds engine: the ``smp.*`` API (SageMaker model parallel v1) running on DeepSpeed.

``smdistributed.modelparallel.torch`` re-exports these names, so an SMP script runs unchanged.
Like SMP, ``step`` is the decorator (shadowing the ``step`` submodule) and ``checkpoint`` is the
activation-checkpoint function (shadowing the ``checkpoint`` submodule with ``save_checkpoint``).
Nothing heavy is imported until ``smp.init()``: DeepSpeed loads on first use.
"""
# ruff: noqa: I001 - import order matters: `step` and `checkpoint` must be rebound last (see above)

from __future__ import annotations

from smp2ds.engine.api import amp
from smp2ds.engine import exceptions
from smp2ds.engine import nn
from smp2ds.engine.core.activation_checkpointing import checkpoint_sequential, set_activation_checkpointing
from smp2ds.engine.api.checkpoint import resume_from_checkpoint, save_checkpoint
from smp2ds.engine.core.save_load import load, save
from smp2ds.engine.core.object_collectives import (
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    gather,
    mp_barrier,
    pp_barrier,
    rdp_barrier,
    recv_from,
    send,
    tp_barrier,
)
from smp2ds.engine.api.creation import (
    delay_param_initialization,
    is_tracing,
    model_creation,
    partition,
    set_partition,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)
from smp2ds.engine.api.init import init, is_initialized, shutdown
from smp2ds.engine.api.model import DistributedModel
from smp2ds.engine.api.optimizer import DistributedOptimizer
from smp2ds.engine.core.ranks import (
    CommGroup,
    RankType,
    dp_rank,
    dp_size,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    num_microbatches,
    param_shard_rank,
    param_shard_size,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    size,
    tp_rank,
    tp_size,
)
from smp2ds.engine.core.state import state
from smp2ds.engine.nn.parallel import context as parallel_context
from smp2ds.engine.core.step_output import StepOutput
from smp2ds.engine.api.step import step  # rebinds the name `step` from the submodule to the decorator
from smp2ds.engine.core.activation_checkpointing import (
    checkpoint,
)  # rebinds `checkpoint` to the activation-checkpoint function

WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
DP_GROUP = CommGroup.DP_GROUP
MP_GROUP = CommGroup.MP_GROUP


def reset() -> None:
    """Forget the current model/optimizer so another ``DistributedModel`` can be created (SMP's ``smp.reset``); the
    tensor-parallel random streams start again from ``tensor_parallel_seed``."""
    state.reset()
    context = parallel_context.restart_streams()
    if state.runtime is not None:
        state.runtime = state.runtime.with_context(context)


__all__ = [
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "CommGroup",
    "DistributedModel",
    "DistributedOptimizer",
    "RankType",
    "StepOutput",
    "allgather",
    "amp",
    "barrier",
    "broadcast",
    "checkpoint",
    "checkpoint_sequential",
    "delay_param_initialization",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "exceptions",
    "gather",
    "get_dp_group",
    "get_dp_process_group",
    "get_mp_group",
    "get_mp_process_group",
    "get_pp_group",
    "get_pp_process_group",
    "get_rdp_group",
    "get_rdp_process_group",
    "get_tp_group",
    "get_tp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "is_tracing",
    "load",
    "local_rank",
    "local_size",
    "model_creation",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "nn",
    "num_microbatches",
    "param_shard_rank",
    "param_shard_size",
    "partition",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "reset",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "send",
    "set_activation_checkpointing",
    "set_partition",
    "set_tensor_parallelism",
    "shutdown",
    "size",
    "state",
    "step",
    "tensor_parallelism",
    "tp_barrier",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
]
