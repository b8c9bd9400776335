"""The backend for ``tensor_parallel_degree > 1``: our own Megatron-style sharding, with DeepSpeed
running data parallelism (DDP or ZeRO-1) over the reduced-data-parallel group.

Construction (inside ``smp.DistributedModel``) shards or replaces the marked modules in place
(:mod:`registry`); DeepSpeed then gets the module with an ``mpu`` whose data-parallel group is
the rdp group and whose model-parallel group is the tensor-parallel group (:mod:`mpu`).
Gradients: before DeepSpeed's reduction, :func:`grads.combine_group_batches` turns per-rank
gradients into the group's (``prescaled_batch: false``). State dicts: ``state_dict()`` joins
every shard (a collective over the tensor-parallel group, keys unchanged), ``local_state_dict()``
is this rank's shards, and loading accepts full tensors (cut to this rank's shard) or shards.
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.data_parallel.backend import DataParallelBackend
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.parallel.group import current
from smp2ds.engine.nn.parallel.region import first_tensor
from smp2ds.engine.nn.parallel.shards import full_tensor, local_part, spec_of
from smp2ds.engine.tensor_parallel import grads, registry
from smp2ds.engine.tensor_parallel.mpu import TensorParallelMPU


class TensorParallelBackend(DataParallelBackend):
    """Sharded modules on every tensor-parallel rank; DeepSpeed data parallelism over rdp."""

    name = "tensor-parallel"
    collective_state_dict = True

    def __init__(self, module: torch.nn.Module, *, state: Any, microbatches: int):
        self.tp = current()
        self.report = registry.apply(module, self.tp)
        mpu = TensorParallelMPU(state.groups)

        def initialize(*, model: Any, optimizer: Any, config: dict, **_: Any) -> tuple:
            import deepspeed

            return deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)

        super().__init__(module, dict(state.plan.deepspeed), microbatches=microbatches, initialize=initialize)

    # ---- the step ---------------------------------------------------------------------------------
    def run_step(self, model: Any, step_fn: Any, args: tuple, kwargs: dict) -> list[Any]:
        if not self.tp.prescaled_batch:
            self._check_equal_batches(args, kwargs)
        return super().run_step(model, step_fn, args, kwargs)

    def _check_equal_batches(self, args: tuple, kwargs: dict) -> None:
        """Joining batches needs the same batch size on every rank of the group: say so, not hang."""
        first = first_tensor((args, kwargs))
        size = int(first.shape[0]) if first is not None and first.dim() else -1
        sizes = comm.all_gather_object(size, group=self.tp.handle)
        if len(set(sizes)) > 1:
            raise SMPUnsupportedError(
                f"prescaled_batch is false, so the {self.tp.size} tensor-parallel ranks {list(self.tp.ranks)} join "
                f"their batches, which needs equal batch sizes; got {sizes}. Give every rank the same batch "
                "size (DistributedSampler with drop_last=True)")

    def build(self, optimizer: torch.optim.Optimizer | None = None, loss_scale: Any = None) -> None:
        super().build(optimizer, loss_scale)
        if self.has_optimizer and not self.tp.prescaled_batch and self._grad_hooks is None \
                and hasattr(self.ds_optimizer, "update_hp_grads"):
            # DeepSpeed's bf16 optimizer takes each backward's gradients into its fp32 buffers at once
            self._grad_hooks = grads.install_group_batch_hooks(self.module.parameters(), self.tp)

    _grad_hooks: list | None = None

    def sync_gradients(self) -> None:
        if not self._pending_backward or self.synced:
            return
        if not self.tp.prescaled_batch and self._grad_hooks is None:
            grads.combine_group_batches(self.module.parameters(), self.tp)
        super().sync_gradients()

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        if self.zero_stage >= 1:
            # DeepSpeed's ZeRO optimizer computes the norm with the mpu (shards once, replicas once)
            return super().grad_norm(norm_type)
        self.sync_gradients()
        return grads.grad_norm(self.module.parameters(), self.tp, norm_type) / self.loss_scale

    # ---- state ----------------------------------------------------------------------------------------
    def full_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Every parameter whole, under its original name (collective over the tensor-parallel group)."""
        sd = self.module.state_dict(prefix=prefix, keep_vars=True)
        out = {}
        for key, value in sd.items():
            if isinstance(value, torch.Tensor) and spec_of(value) is not None:
                value = full_tensor(value, self.tp)
            elif isinstance(value, torch.Tensor) and not keep_vars:
                value = value.detach()
            out[key] = value
        return out

    def local_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """This rank's shards (and the replicated tensors), under the original names."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_module_state_dict(self, sd: dict, strict: bool = True) -> Any:
        """Load full tensors (cut to this rank's shard) or this rank's shards."""
        own = self.module.state_dict(keep_vars=True)
        cut = {}
        for key, value in sd.items():
            target = own.get(key)
            if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                value = local_part(target, value, self.tp)
            cut[key] = value
        return self.module.load_state_dict(cut, strict=strict)


def create_backend(module: Any, *, state: Any, microbatches: int) -> TensorParallelBackend:
    """The backend ``backend_registry`` builds when the Plan enables tensor parallelism."""
    return TensorParallelBackend(module, state=state, microbatches=microbatches)
