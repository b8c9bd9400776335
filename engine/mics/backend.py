"""Glue between ``DistributedModel`` and the MiCS engine (``smp2ds.engine.mics``).

The MiCS package builds ZeRO-3 inside shard groups and installs the replica all-reduce in the
optimizer's ``step``; this backend drives it with the same step machinery as plain data
parallelism. Differences: ZeRO-3 reduce-scatters inside every ``backward``, so nothing is left
to reduce after the micro-batch loop; the full state dict is gathered (collective); each rank's
optimizer partition is indexed by its rank inside the shard group.

With tensor parallelism (SMP 1.15: ``tensor_parallel_degree`` > 1 and ``sharded_data_parallel_degree`` > 1,
``prescaled_batch: true``) the backend factory hands it the model ``parallelize`` sharded: the MiCS shard
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
from smp2ds.engine.data_parallel.backend import DataParallelBackend
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.mics.mpu import TensorShardMPU
from smp2ds.engine.mics.zero3 import full_state_dict, initialize, load_full_state_dict


class MicsBackend(DataParallelBackend):
    """ZeRO-3 over the shard group (S ranks), replicated over R = dp / S groups."""

    name = "mics"
    collective_state_dict = True
    clips_in_step = True
    """DeepSpeed clips inside the step at ``sdp_gradient_clipping``; ``clip_master_grads`` does nothing, as in SMP."""

    def __init__(self, module: Any, *, state: Any, microbatches: int,
                 tensor_parallel: TensorParallelView | None = None):
        """``tensor_parallel``: the model as ``parallelize`` sharded it (None without tensor parallelism)."""
        self.groups = state.mics_groups  # created by smp.init
        groups = self.groups
        mpu: Any = None  # mics.initialize's default: the shard group, no model parallelism
        if tensor_parallel is not None and tensor_parallel.size > 1:
            if not tensor_parallel.group.prescaled_batch:
                raise SMPUnsupportedError("tensor parallelism with sharded data parallelism needs prescaled_batch: "
                                          "true (smp.init refuses the configuration otherwise)")
            mpu = TensorShardMPU(groups, tensor_parallel.group)
        else:
            tensor_parallel = None

        def initialize_on_shard_groups(*, model: Any, optimizer: Any, config: dict, **_: Any) -> tuple:
            return initialize(model, optimizer, config, groups, mpu=mpu)

        super().__init__(module, dict(state.plan.deepspeed), microbatches=microbatches,
                         initialize=initialize_on_shard_groups, tensor_parallel=tensor_parallel)
        self.name = "mics" if tensor_parallel is None else "tensor-parallel+mics"

    @property
    def optimizer_state_is_sharded(self) -> bool:
        return True

    _step_model: Any = None

    def run_step(self, model: Any, step_fn: Any, args: tuple, kwargs: dict) -> list[Any]:
        self._step_model = model
        try:
            return super().run_step(model, step_fn, args, kwargs)
        finally:
            self._step_model = None

    def backward(self, loss: Any) -> None:
        """The step's last backward before ``optimizer.step()`` runs as DeepSpeed's accumulation
        boundary, so the replica all-reduce overlaps it (:mod:`smp2ds.engine.mics.overlap`); other
        backwards keep the boundary off (their partitions are not final)."""
        model = self._step_model
        boundary = model is not None and self.engine is not None and model.ends_accumulation()
        if boundary:
            self.engine.set_gradient_accumulation_boundary(True)
        try:
            super().backward(loss)
        finally:
            if boundary:
                self.engine.set_gradient_accumulation_boundary(False)

    def param_shard_rank(self) -> int:
        # Position inside this rank's shard group (SMP's param_shard_rank), not the index of its shard group.
        return self.groups.layout.shard_rank

    def param_shard_size(self) -> int:
        return self.groups.shard_size

    def sync_gradients(self) -> None:
        # ZeRO-3 already reduce-scattered each micro-batch inside backward; the replica all-reduce
        # runs inside optimizer.step (installed by mics.initialize).
        if self._pending_backward:
            self.synced = True

    def grad_norm(self, norm_type: float = 2.0) -> Any:
        raise SMPUnsupportedError("clip_master_grads with sharded data parallelism: DeepSpeed clips inside the "
                                  "step; set sdp_gradient_clipping in the configuration instead")

    def full_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Every tensor whole under its original name (collective over the shard group, and over the
        tensor-parallel group with tensor parallelism)."""
        self.ensure_built()
        if self.tensor_parallel is not None:
            with self._gathered() as own:
                whole = self.tensor_parallel.join(own, keep_vars=True)
                return {prefix + k: v.detach().clone().cpu() for k, v in whole.items()}
        sd = full_state_dict(self.engine)
        return {prefix + k: v for k, v in sd.items()}

    def local_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """What this rank's partial checkpoint holds: the whole model, or with tensor parallelism this rank's
        shards whole (gathered over the shard group), under the original names."""
        if self.tensor_parallel is None:
            return self.full_state_dict(prefix, keep_vars)
        with self._gathered() as own:
            return {prefix + k: v.detach().clone().cpu() for k, v in own.items()}

    def load_module_state_dict(self, sd: dict, strict: bool = True) -> Any:
        """Load full tensors (cut to this rank's tensor-parallel piece) or this rank's shards; gathered inside
        the shard group (the modifier rank is a shard-group rank), and DeepSpeed's fp32 master partitions are
        refreshed from the loaded weights."""
        self.ensure_built()
        if self.tensor_parallel is None:
            return load_full_state_dict(self.engine, sd, strict=strict)
        with self._gathered(modifier_rank=0) as own:
            cut = {k: self.tensor_parallel.local_part(own[k], v) if k in own and isinstance(v, torch.Tensor) else v
                   for k, v in sd.items()}
            result = self.module.load_state_dict(cut, strict=strict)
        if self.ds_optimizer is not None and hasattr(self.ds_optimizer, "refresh_fp32_params"):
            self.ds_optimizer.refresh_fp32_params()
        return result

    @contextlib.contextmanager
    def _gathered(self, modifier_rank: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's module state gathered over the shard group, as ``state_dict(keep_vars=True)``."""
        import deepspeed  # start-up: DeepSpeed is imported when the first engine is built

        self.ensure_built()
        with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=modifier_rank):
            yield self.module.state_dict(keep_vars=True)

    def optimizer_partition(self) -> tuple[int, int]:
        return self.groups.layout.shard_rank, self.groups.shard_size
