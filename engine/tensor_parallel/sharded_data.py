"""Tensor parallelism with sharded data parallelism (SMP 1.15: ``tensor_parallel_degree`` > 1 and
``sharded_data_parallel_degree`` > 1, with ``prescaled_batch: true``).

Layout: the tensor-parallel group shares one batch; the MiCS shard groups lie inside the
reduced-data-parallel (rdp) group, the ranks holding the same tensor-parallel shard. Each rank's
shards (and the parameters every tensor-parallel rank keeps whole) are ZeRO-3 partitioned over its
shard group, so a rank holds about 1/(tp x sdp) of the sharded weights, their gradients and
optimizer state.

* Construction: the marked modules are sharded in place (:func:`registry.apply`), then DeepSpeed's
  ZeRO-3 partitions what is left whole (``mics.initialize`` with :class:`TensorShardMPU`: data
  parallel = shard group, model parallel = tensor-parallel group, which DeepSpeed's gradient norm
  uses to count each shard once and replicated parameters once).
* Delayed initialisation (``smp.model_creation`` / ``delay_param_initialization`` under
  ``delayed_parameter_initialization``): parameters are born partitioned over the shard group
  (``mics_init_context``); sharding then gathers one block at a time (:func:`partitioning`), cuts
  this rank's piece and partitions it at once, so no rank ever holds the whole model.
* State: ``state_dict()`` gathers over the shard group and joins over the tensor-parallel group
  (full tensors, original names); ``local_state_dict()`` is this rank's tensor-parallel shards
  whole (what partial checkpoints store per tp rank); loading takes either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.mics.backend import MicsBackend
from smp2ds.engine.mics.mpu import ShardGroupMPU
from smp2ds.engine.mics.shard_groups import MicsGroups
from smp2ds.engine.nn.parallel.group import TPGroup, current
from smp2ds.engine.nn.parallel.shards import full_tensor, local_part, spec_of
from smp2ds.engine.tensor_parallel import registry


class TensorShardMPU(ShardGroupMPU):
    """Data parallel = this rank's shard group (inside its rdp group); model parallel = its tp group."""

    def __init__(self, groups: MicsGroups, tp: TPGroup) -> None:
        super().__init__(groups)
        self._tp = tp

    def get_model_parallel_group(self) -> Any:
        return self._tp.handle

    def get_model_parallel_world_size(self) -> int:
        return self._tp.size

    def get_model_parallel_rank(self) -> int:
        return self._tp.rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._tp.src


def is_partitioned(module: torch.nn.Module) -> bool:
    """True when ``module``'s parameters were created partitioned (ZeRO-3 ``ds_tensor``)."""
    return any(hasattr(p, "ds_tensor") for p in module.parameters())


@contextlib.contextmanager
def whole(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s partitioned parameters gathered whole while the context lasts (every rank of the
    shard group enters it); nothing happens when none is partitioned. SMP's distributed-transformer
    replacement reads a Hugging Face model born partitioned through it: this gathers the whole model
    once, for the time it takes to build the replacement."""
    params = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def partitioning(ds_config: Mapping[str, Any], groups: MicsGroups) -> registry.Around:
    """``registry.apply``'s ``around`` for a model born partitioned: inside, the module's parameters
    are gathered whole (one block at a time); on exit the parameters sharding made (this rank's
    pieces, still ordinary tensors) are partitioned over the shard group."""
    import deepspeed

    from smp2ds.engine.mics.zero3 import shard_ds_config

    cfg = shard_ds_config(ds_config, groups)

    @contextlib.contextmanager
    def around(module: torch.nn.Module) -> Iterator[None]:
        with whole(module):
            yield
        if any(not hasattr(p, "ds_tensor") for p in module.parameters()):
            deepspeed.zero.Init(module=module, data_parallel_group=groups.shard_group, config_dict_or_path=cfg,
                                mpu=ShardGroupMPU(groups))

    return around


class TensorShardedBackend(MicsBackend):
    """Tensor-parallel shards, ZeRO-3 partitioned over shard groups inside the rdp group."""

    name = "tensor-parallel+mics"

    def __init__(self, module: torch.nn.Module, *, state: Any, microbatches: int):
        from smp2ds.engine.core.deepspeed_config import engine_config

        self.tp = current()
        if not self.tp.prescaled_batch:
            raise SMPUnsupportedError("tensor parallelism with sharded data parallelism needs prescaled_batch: true "
                                      "(smp.init refuses the configuration otherwise)")
        groups = state.mics_groups
        around = None
        if is_partitioned(module):
            around = partitioning(engine_config(state.plan.deepspeed, microbatches=microbatches), groups)
        self.report = registry.apply(module, self.tp, around=around)
        super().__init__(module, state=state, microbatches=microbatches, mpu=TensorShardMPU(groups, self.tp))

    # ---- state ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _whole(self, modifier_rank: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's module state, gathered over the shard group, as ``state_dict(keep_vars=True)``."""
        import deepspeed

        self.ensure_built()
        params = list(self.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            yield self.module.state_dict(keep_vars=True)

    def full_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Every tensor whole under its original name (collective over the shard and tp groups)."""
        with self._whole() as own:
            return {prefix + k: (full_tensor(v, self.tp) if spec_of(v) is not None else v).detach().clone().cpu()
                    for k, v in own.items()}

    def local_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """This rank's tensor-parallel shards whole (gathered over the shard group), original names."""
        with self._whole() as own:
            return {prefix + k: v.detach().clone().cpu() for k, v in own.items()}

    def load_module_state_dict(self, sd: dict, strict: bool = True) -> Any:
        """Load full tensors (cut to this rank's piece) or this rank's shards; the shard group's first
        rank's values are partitioned and DeepSpeed's fp32 master copy refreshed."""
        with self._whole(modifier_rank=0) as own:
            cut = {k: local_part(own[k], v, self.tp) if k in own and isinstance(v, torch.Tensor) else v
                   for k, v in sd.items()}
            result = self.module.load_state_dict(cut, strict=strict)
        if self.ds_optimizer is not None and hasattr(self.ds_optimizer, "refresh_fp32_params"):
            self.ds_optimizer.refresh_fp32_params()
        return result

    def param_shard_rank(self) -> int:
        return self.groups.layout.shard_rank
