"""MiCS-style sharded data parallelism (``sharded_data_parallel_degree``) on DeepSpeed ZeRO-3.

DeepSpeed >= 0.19.7 removed its MiCS; this package rebuilds it on DeepSpeed's plain ZeRO-3 by
choosing the group ZeRO-3 partitions over, and adding what ZeRO-3 lacks
(docs/smp-semantics.md#sharded-data-parallelism):

* S = ``sharded_data_parallel_degree`` ranks per *shard group* (consecutive data-parallel
  ranks), R = dp / S *replica groups* (strided ranks holding the same shard);
* ZeRO-3 partitions parameters, gradients and optimizer state inside the shard group only
  (an ``mpu`` whose data-parallel group is the shard group);
* two-hop gradient sync: DeepSpeed reduce-scatters inside the shard group every micro-batch;
  we all-reduce the gradient partition across the replica group once per optimizer step, before
  overflow check, norm, clipping and update (so the norm and clipping equal the unsharded ones),
  started per reduce-scatter bucket during the last micro-batch's backward (``overlap``);
* ``sdp_hierarchical_allgather``: shard groups spanning nodes fetch parameters inter-node first,
  then intra-node (identical bytes); off automatically when the group fits in a node.

Public surface (for the engine core; all collective calls must run on every rank):

``MicsGroups.create(topology, shard_size, rank=None, ranks_per_node=None, hierarchical=True)``
    Creates every process group in one order on all ranks (idempotent for equal arguments, so
    model creation and engine share group objects). ``ranks_per_node`` defaults to
    ``LOCAL_WORLD_SIZE``. Fields: ``layout`` (pure ``MicsLayout``: ``shard_groups``,
    ``replica_groups``, ``shard_ranks``, ``replica_ranks``, ``shard_index``, ``replica_index``,
    ``shard_rank`` / ``replica_rank`` (positions inside the groups; with tensor parallelism the
    groups lie inside the rdp group),
    ``hierarchical`` plans with reasons), ``shard_group``, ``replica_group``, ``inter_group``,
    ``intra_group``, ``shard_size``, ``replicas``, ``hierarchical``.
``shard_ds_config(ds_config, groups) -> dict``
    The DeepSpeed config as DeepSpeed must see it (its dp world is S: ``train_batch_size`` / R);
    clear ValueError unless ZeRO stage 3 without offload.
``mics_init_context(ds_config, groups)``
    Context manager: parameters created inside are born partitioned over the shard group
    (``deepspeed.zero.Init``); for ``delayed_parameter_initialization``,
    ``smp.delay_param_initialization()`` and ``smp.model_creation()``. Lazily imported modules
    (``torch._dynamo``, Hugging Face model code) work inside it, Hugging Face's ``_init_weights``
    runs on gathered parameters (a seeded model gets the eager weights) and ``from_pretrained``
    loads into the partitions (``param_creation``).
``import_lazy_modules()``
    Import what must not be imported for the first time under ``zero.Init`` (called by the above).
``initialize(model, optimizer, ds_config, groups, hierarchical=None, lr_scheduler=None, overlap=True)``
    ``deepspeed.initialize`` with the shard-group mpu; replicas start identical; the optimizer's
    ``step`` carries the replica all-reduce (``optimizer.mics_replica_syncs`` counts it); with
    ``overlap`` it is issued per bucket during the boundary backward (``optimizer.mics_overlap``:
    its ``log`` and ``async_elements``; ``optimizer.mics_sync_elements``: what ``step`` reduced);
    hierarchical all-gather installed when it applies; only shard group 0 writes checkpoint
    files. Use the returned engine's ``forward/backward/step``, ``save_checkpoint`` and
    ``load_checkpoint`` as usual; ``p.ds_tensor``, ``p.ds_numel``, ``p.ds_shape`` and
    ``optimizer.fp32_partitioned_groups_flat`` are DeepSpeed's own and stay available.
``full_state_dict(engine) -> dict``
    Full model state dict (gathered, CPU) on every rank.
``load_full_state_dict(engine, state_dict, strict=True)``
    Load a full state dict on every rank: re-partitions and refreshes the fp32 master copy.
``partition_stats(engine) -> dict``
    Elements/bytes of parameters, gradients, fp32 master and optimizer state held by this rank,
    with unsharded counterparts and ``fraction``.
``ShardGroupMPU(groups)``, ``replica_allreduce``, ``hierarchical_all_gather``: building blocks.

DeepSpeed private attributes relied on (pinned by tests/engine/mics/test_mics_internals.py):
``DeepSpeedZeroOptimizer_Stage3.averaged_gradients`` / ``fp16_groups`` /
``grad_partitions_flat_buffer`` / ``partition_grads`` / ``__param_id_to_grad_partition`` /
``backward_prologue``, ``partition_parameters._dist_allgather_fn``,
``partition_parameters.dist.broadcast`` (during ``mics_init_context`` only) and the engine flags
``save_non_zero_checkpoint`` / ``save_zero_checkpoint``.
"""

from smp2ds.engine.mics.allgather import (
    hierarchical_all_gather,
    install_hierarchical_allgather,
    uninstall_hierarchical_allgather,
)
from smp2ds.engine.mics.gradsync import DeepSpeedInternalsChanged, check_stage3_internals, replica_allreduce
from smp2ds.engine.mics.mpu import ShardGroupMPU
from smp2ds.engine.mics.param_creation import import_lazy_modules, mics_init_context
from smp2ds.engine.mics.rank_arithmetic import HierarchicalPlan, MicsLayout, plan_hierarchical
from smp2ds.engine.mics.shard_groups import MicsGroups
from smp2ds.engine.mics.zero3 import (
    full_state_dict,
    initialize,
    load_full_state_dict,
    partition_stats,
    shard_ds_config,
    sync_replicas,
)

__all__ = [
    "DeepSpeedInternalsChanged",
    "HierarchicalPlan",
    "MicsGroups",
    "MicsLayout",
    "ShardGroupMPU",
    "check_stage3_internals",
    "full_state_dict",
    "hierarchical_all_gather",
    "import_lazy_modules",
    "initialize",
    "install_hierarchical_allgather",
    "load_full_state_dict",
    "mics_init_context",
    "partition_stats",
    "plan_hierarchical",
    "replica_allreduce",
    "shard_ds_config",
    "sync_replicas",
    "uninstall_hierarchical_allgather",
]
