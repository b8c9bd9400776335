"""MiCS as a placement of parameters for the data-parallel backend: ZeRO-3 over the shard group (S ranks),
replicated over R = dp / S groups (the :class:`~smp2ds.engine.core.parameter_sharding.ParameterSharding` of
``sharded_data_parallel_degree`` > 1).

The MiCS package builds ZeRO-3 inside shard groups and installs the replica all-reduce in the optimizer's
``step``; the data-parallel backend drives it with the same step machinery as plain data parallelism.
Differences: ZeRO-3 reduce-scatters inside every ``backward``, so nothing is left to reduce after the
micro-batch loop (the step's last backward runs as DeepSpeed's accumulation boundary, so the replica all-reduce
overlaps it); DeepSpeed clips inside the step; the full state dict is gathered (collective); each rank's
optimizer partition is indexed by its rank inside the shard group.

With tensor parallelism (SMP 1.15: ``tensor_parallel_degree`` > 1 and ``sharded_data_parallel_degree`` > 1,
``prescaled_batch: true``) the backend factory hands over the model ``parallelize`` sharded: the MiCS shard
groups lie inside the reduced-data-parallel group (the ranks holding the same tensor-parallel shard), each
rank's shards and the parameters kept whole are ZeRO-3 partitioned over its shard group (about 1/(tp x sdp)
of the sharded weights, gradients and optimizer state per rank), and DeepSpeed's ``mpu`` answers the
tensor-parallel group as model parallel (:class:`~smp2ds.engine.mics.mpu.TensorShardMPU`). ``state_dict()``
then gathers over the shard group and joins over the tensor-parallel group; ``local_state_dict()`` is this
rank's tensor-parallel shards whole (what partial checkpoints store per tp rank); loading takes either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from smp2ds.engine.core.tensor_parallel_view import TensorParallelView
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.mics.mpu import TensorShardMPU
from smp2ds.engine.mics.shard_groups import MicsGroups
from smp2ds.engine.mics.zero3 import full_state_dict, initialize, load_full_state_dict


class MicsSharding:
    """ZeRO-3 over this rank's shard group of ``groups`` (made by ``smp.init``), optionally of a model sharded by
    tensor parallelism."""

    collective_state_dict = True
    clips_in_step = True
    """DeepSpeed clips inside the step at ``sdp_gradient_clipping``; ``clip_master_grads`` does nothing, as in SMP."""
    reduces_in_backward = True

    def __init__(self, groups: MicsGroups, tensor_parallel: TensorParallelView | None = None) -> None:
        self.groups = groups
        self._mpu: Any = None  # mics.initialize's default: the shard group, no model parallelism
        if tensor_parallel is not None and tensor_parallel.size > 1:
            if not tensor_parallel.group.prescaled_batch:
                raise SMPUnsupportedError("tensor parallelism with sharded data parallelism needs prescaled_batch: "
                                          "true (smp.init refuses the configuration otherwise)")
            self._mpu = TensorShardMPU(groups, tensor_parallel.group)
        else:
            tensor_parallel = None
        self.tensor_parallel = tensor_parallel
        self.name = "mics" if tensor_parallel is None else "tensor-parallel+mics"

    def initialize(self, *, model: Any, optimizer: Any, config: dict) -> tuple:
        return initialize(model, optimizer, config, self.groups, mpu=self._mpu)

    def optimizer_state_is_sharded(self, zero_stage: int) -> bool:
        return True

    def optimizer_partition(self) -> tuple[int, int]:
        return self.groups.layout.shard_rank, self.groups.shard_size

    def param_shard_rank(self) -> int:
        # Position inside this rank's shard group (SMP's param_shard_rank), not the index of its shard group.
        return self.groups.layout.shard_rank

    def param_shard_size(self) -> int:
        return self.groups.shard_size

    # ---- state ----------------------------------------------------------------------------------------
    def full_state_dict(self, backend: Any, prefix: str, keep_vars: bool) -> dict:
        """Every tensor whole under its original name (collective over the shard group, and over the
        tensor-parallel group with tensor parallelism)."""
        backend.ensure_built()
        if self.tensor_parallel is not None:
            with _gathered(backend) as own:
                whole = self.tensor_parallel.join(own, keep_vars=True)
                return {prefix + k: v.detach().clone().cpu() for k, v in whole.items()}
        sd = full_state_dict(backend.engine)
        return {prefix + k: v for k, v in sd.items()}

    def local_state_dict(self, backend: Any, prefix: str, keep_vars: bool) -> dict:
        """What this rank's partial checkpoint holds: the whole model, or with tensor parallelism this rank's
        shards whole (gathered over the shard group), under the original names."""
        if self.tensor_parallel is None:
            return self.full_state_dict(backend, prefix, keep_vars)
        with _gathered(backend) as own:
            return {prefix + k: v.detach().clone().cpu() for k, v in own.items()}

    def load_module_state_dict(self, backend: Any, state_dict: dict, strict: bool) -> Any:
        """Load full tensors (cut to this rank's tensor-parallel piece) or this rank's shards; gathered inside
        the shard group (the modifier rank is a shard-group rank), and DeepSpeed's fp32 master partitions are
        refreshed from the loaded weights."""
        backend.ensure_built()
        if self.tensor_parallel is None:
            return load_full_state_dict(backend.engine, state_dict, strict=strict)
        with _gathered(backend, modifier_rank=0) as own:
            result = backend.module.load_state_dict(self.tensor_parallel.cut(own, state_dict), strict=strict)
        if backend.ds_optimizer is not None and hasattr(backend.ds_optimizer, "refresh_fp32_params"):
            backend.ds_optimizer.refresh_fp32_params()
        return result


@contextlib.contextmanager
def _gathered(backend: Any, modifier_rank: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The backend's module state gathered over the shard group, as ``state_dict(keep_vars=True)``."""
    import deepspeed  # start-up: DeepSpeed is imported when the first engine is built

    backend.ensure_built()
    with deepspeed.zero.GatheredParameters(list(backend.module.parameters()), modifier_rank=modifier_rank):
        yield backend.module.state_dict(keep_vars=True)
