"""Glue between ``DistributedModel`` and the MiCS engine (``smp2ds.engine.mics``).

The MiCS package builds ZeRO-3 inside shard groups and installs the replica all-reduce in the
optimizer's ``step``; this backend drives it with the same step machinery as plain data
parallelism. Differences: ZeRO-3 reduce-scatters inside every ``backward``, so nothing is left
to reduce after the micro-batch loop; the full state dict is gathered (collective); each rank's
optimizer partition is indexed by its rank inside the shard group.
"""

from __future__ import annotations

from typing import Any

from smp2ds.engine.data_parallel.backend import DataParallelBackend


class MicsBackend(DataParallelBackend):
    """ZeRO-3 over the shard group (S ranks), replicated over R = dp / S groups."""

    name = "mics"
    collective_state_dict = True
    clips_in_step = True
    """DeepSpeed clips inside the step at ``sdp_gradient_clipping``; ``clip_master_grads`` does nothing, as in SMP."""

    def __init__(self, module: Any, *, state: Any, microbatches: int, mpu: Any = None):
        """``mpu``: DeepSpeed's view of the groups (None: ``ShardGroupMPU``, no model parallelism)."""
        from smp2ds.engine import mics

        self.groups = state.mics_groups  # created by smp.init
        self._mics = mics

        def initialize(*, model: Any, optimizer: Any, config: dict, **_: Any) -> tuple:
            return mics.initialize(model, optimizer, config, self.groups, mpu=mpu)

        super().__init__(module, dict(state.plan.deepspeed), microbatches=microbatches, initialize=initialize)

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
        from smp2ds.engine.exceptions import SMPUnsupportedError

        raise SMPUnsupportedError("clip_master_grads with sharded data parallelism: DeepSpeed clips inside the "
                                  "step; set sdp_gradient_clipping in the configuration instead")

    def full_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        self.ensure_built()
        sd = self._mics.full_state_dict(self.engine)
        return {prefix + k: v for k, v in sd.items()}

    local_state_dict = full_state_dict

    def load_module_state_dict(self, sd: dict, strict: bool = True) -> Any:
        # The MiCS package gathers inside the shard group (modifier rank is a shard-group rank)
        # and refreshes DeepSpeed's fp32 master partitions from the loaded weights.
        self.ensure_built()
        return self._mics.load_full_state_dict(self.engine, sd, strict=strict)

    def optimizer_partition(self) -> tuple[int, int]:
        return self.groups.layout.shard_rank, self.groups.shard_size
