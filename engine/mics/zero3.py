"""MiCS on DeepSpeed ZeRO-3: config adaptation, engine set-up, state access.

Parameter creation under ``zero.Init`` lives in ``param_creation``."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.mics.allgather import install_hierarchical_allgather
from smp2ds.engine.mics.gradsync import install_replica_allreduce
from smp2ds.engine.mics.mpu import ShardGroupMPU
from smp2ds.engine.mics.shard_groups import MicsGroups


def shard_ds_config(ds_config: Mapping[str, Any], groups: MicsGroups) -> dict:
    """The DeepSpeed config as DeepSpeed must see it when its data-parallel world is the shard group.

    DeepSpeed checks ``train_batch_size == micro * accumulation * dp_world``; its dp world is S,
    not dp, so a given ``train_batch_size`` (computed for dp ranks) is divided by R. Raises
    ValueError for configs MiCS cannot run (not ZeRO stage 3, optimizer offload).
    """
    cfg = copy.deepcopy(dict(ds_config))
    zero = cfg.get("zero_optimization") or {}
    if zero.get("stage") != 3:
        raise ValueError(f"/zero_optimization/stage: sharded data parallelism needs ZeRO stage 3, given "
                         f"{zero.get('stage')!r}; the planner emits stage 3 when sharded_data_parallel_degree > 1")
    if zero.get("offload_optimizer") or zero.get("offload_param"):
        raise ValueError("/zero_optimization/offload_optimizer: sharded data parallelism (MiCS) does not support "
                         "offload; remove offload_optimizer/offload_param")
    if "train_batch_size" in cfg and cfg["train_batch_size"] is not None:
        total = int(cfg["train_batch_size"])
        if total % groups.replicas:
            raise ValueError(f"/train_batch_size: {total} is not divisible by the number of MiCS replicas "
                             f"R = dp / sharded_data_parallel_degree = {groups.replicas}")
        cfg["train_batch_size"] = total // groups.replicas
    return cfg


def sync_replicas(model: torch.nn.Module, groups: MicsGroups) -> None:
    """Give every replica the same starting weights (those of the first shard group).

    Partitioned parameters broadcast their partition over the replica group; ordinary parameters
    and buffers broadcast whole over the replica group (DeepSpeed then broadcasts parameters
    inside the shard group from its first rank; buffers are broadcast there too here).
    """
    src_replica = groups.layout.replica_ranks[0]
    src_shard = groups.layout.shard_ranks[0]
    with torch.no_grad():
        for p in model.parameters() if groups.replicas > 1 else ():
            # A partitioned parameter may also hold its full data (persistent, small ones).
            tensors = [p.ds_tensor, p.data] if hasattr(p, "ds_tensor") else [p.data]
            for tensor in tensors:
                if tensor.numel():
                    comm.broadcast(tensor, src_replica, group=groups.replica_group)
        for b in model.buffers():
            if groups.replicas > 1:
                comm.broadcast(b.data, src_replica, group=groups.replica_group)
            if groups.shard_size > 1:
                comm.broadcast(b.data, src_shard, group=groups.shard_group)


def initialize(model: torch.nn.Module, optimizer: Any, ds_config: Mapping[str, Any], groups: MicsGroups,
               hierarchical: bool | None = None, lr_scheduler: Any = None,
               model_parameters: Any = None, mpu: Any = None, overlap: bool = True) -> tuple[Any, Any]:
    """``deepspeed.initialize`` for MiCS; returns ``(engine, engine.optimizer)`` with the replica hook.

    * DeepSpeed's data-parallel group is the shard group (``ShardGroupMPU``), so ZeRO-3 partitions
      parameters, gradients and optimizer state over S ranks; a model built normally is
      partitioned here, one built under ``mics_init_context`` already is.
    * replicas start from identical weights (``sync_replicas``);
    * the optimizer's ``step`` first averages gradient partitions over the replica group; with
      ``overlap`` (default) that all-reduce starts per reduce-scatter bucket during the boundary
      backward and ``step`` only waits on it (``engine/mics/overlap.py``; same results);
    * ``hierarchical`` (None = as ``groups`` decided, False = off) routes parameter fetches of a
      shard group spanning nodes through the two-stage all-gather;
    * only the first shard group of each rdp group writes checkpoint files (replicas hold identical
      state and the same file names), every rank reads;
    * ``mpu``: DeepSpeed's view of the groups (default ``ShardGroupMPU``: model parallelism of one
      rank); tensor parallelism passes one whose model-parallel group is the tensor-parallel group.
    """
    import deepspeed

    cfg = shard_ds_config(ds_config, groups)
    sync_replicas(model, groups)
    if groups.hierarchical and hierarchical is not False:
        plan = groups.layout.my_hierarchical
        install_hierarchical_allgather(groups.shard_group, groups.inter_group, groups.intra_group,
                                       plan.nodes, plan.per_node)
    kwargs: dict[str, Any] = {"model": model, "config": cfg, "mpu": mpu or ShardGroupMPU(groups)}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    if lr_scheduler is not None:
        kwargs["lr_scheduler"] = lr_scheduler
    if model_parameters is not None:
        kwargs["model_parameters"] = model_parameters
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    if optimizer is not None:  # an engine only for evaluation / state dicts has no ZeRO-3 optimizer
        install_replica_allreduce(engine.optimizer, groups.replica_group, groups.replicas, overlap=overlap)
    if groups.layout.replica_rank != 0:
        engine.save_non_zero_checkpoint = False
        engine.save_zero_checkpoint = False
    engine.mics_groups = groups
    return engine, engine.optimizer


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The full (unpartitioned) model state dict on every rank, as CPU tensors (collective)."""
    import deepspeed

    module = engine.module if hasattr(engine, "module") else engine
    params = [p for p in module.parameters()]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {k: v.detach().clone().cpu() for k, v in module.state_dict(keep_vars=True).items()}


def load_full_state_dict(engine: Any, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> Any:
    """Load a full (unpartitioned) state dict into a MiCS engine on every rank (collective).

    Every rank passes the same dict. Parameters are gathered, loaded, re-partitioned
    (``GatheredParameters(modifier_rank=0)``: shard rank 0's copy wins), and DeepSpeed's fp32 master
    partitions are refreshed from them, so the next optimizer step starts from the loaded weights. Before
    ``smp.DistributedOptimizer`` the engine has no optimizer (DeepSpeed's parameter offload object stands in):
    there are no master partitions yet, and the optimizer builds them from the loaded weights.
    Returns ``load_state_dict``'s result (missing/unexpected keys).
    """
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        result = module.load_state_dict(dict(state_dict), strict=strict)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh is not None:
        refresh()
    return result


def partition_stats(engine: Any) -> dict[str, int | float]:
    """Elements and bytes of parameters, gradients and optimizer state this rank holds.

    Measured from the partitions themselves: ``p.ds_tensor`` (parameters), DeepSpeed's gradient
    partition buffer, ``optimizer.fp32_partitioned_groups_flat`` (fp32 master copy) and the inner
    optimizer's state tensors. ``*_full_*`` give the unsharded counterparts (same dtypes), so
    ``model_state_bytes / full_model_state_bytes`` is the fraction of the model states held here.
    """
    opt = engine.optimizer
    params = list(engine.module.parameters())
    trainable = [p for group in opt.fp16_groups for p in group]
    full_numel = sum(p.ds_numel for p in params)
    trainable_full = sum(p.ds_numel for p in trainable)
    stats: dict[str, int | float] = {
        "param_elements": sum(p.ds_tensor.numel() for p in params),
        "param_full_elements": full_numel,
        "persistent_full_elements": sum(p.ds_numel for p in params if getattr(p, "ds_persist", False)),
    }
    flat = getattr(opt, "grad_partitions_flat_buffer", None)
    stats["grad_elements"] = flat.numel() if flat is not None else sum(p.partition_numel() for p in trainable)
    stats["grad_full_elements"] = trainable_full
    master = list(opt.fp32_partitioned_groups_flat)
    stats["master_elements"] = sum(t.numel() for t in master)
    state_tensors = [v for s in opt.optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0]
    stats["optimizer_state_elements"] = sum(t.numel() for t in state_tensors)
    per_master = len(state_tensors) / max(len(master), 1)
    stats["optimizer_state_full_elements"] = round(per_master * trainable_full)
    param_bytes = params[0].ds_tensor.element_size() if params else 0
    grad_bytes = flat.element_size() if flat is not None else param_bytes
    master_bytes = master[0].element_size() if master else 4
    state_bytes = state_tensors[0].element_size() if state_tensors else 4
    stats["model_state_bytes"] = (stats["param_elements"] * param_bytes + stats["grad_elements"] * grad_bytes
                                  + stats["master_elements"] * master_bytes
                                  + stats["optimizer_state_elements"] * state_bytes)
    stats["full_model_state_bytes"] = (full_numel * param_bytes + trainable_full * (grad_bytes + master_bytes)
                                       + stats["optimizer_state_full_elements"] * state_bytes)
    stats["fraction"] = stats["model_state_bytes"] / max(stats["full_model_state_bytes"], 1)
    return stats
