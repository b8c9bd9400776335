"""``parallelize(module, context)``: the one step that makes a model tensor-parallel, whichever DeepSpeed engine then
drives it (plain data parallelism, ZeRO-3 over MiCS shard groups, or the pipeline).

It shards the marked modules in place over the context's tensor-parallel group (:func:`registry.apply`; a model
born partitioned is read through ``around``) and returns a :class:`TensorParallelModel`: the module with what
the backends need of its sharding, behind :class:`smp2ds.engine.core.tensor_parallel_view.TensorParallelView`:

* DeepSpeed's ``mpu`` (:mod:`mpu`): data parallel over the reduced-data-parallel group, model parallel over
  the tensor-parallel group;
* state dicts: shards joined into whole tensors under the original names, whole tensors cut to this rank's
  shard on load (:mod:`smp2ds.engine.nn.parallel.shards`);
* gradients with ``prescaled_batch: false`` (:mod:`grads`): the group's per-rank gradients combined before
  DeepSpeed reduces them, or per micro-batch by hooks for optimizers that take each backward's gradients
  into their own buffers at once (DeepSpeed's bf16 optimizer; :func:`takes_grads_each_backward` is the one
  test of that); the gradient norm counting shards once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.core.partitioned_params import Around
from smp2ds.engine.core.process_groups import ProcessGroups
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.region import first_tensor
from smp2ds.engine.nn.parallel.shards import full_tensor, local_part, spec_of
from smp2ds.engine.tensor_parallel import grads, registry
from smp2ds.engine.tensor_parallel.mpu import TensorParallelMPU


def takes_grads_each_backward(optimizer: Any) -> bool:
    """True for DeepSpeed optimizers that move every backward's gradients into their own fp32 buffers at once
    (the bf16 optimizer: ``update_hp_grads``), so ``p.grad`` after the micro-batches is not what is reduced."""
    return hasattr(optimizer, "update_hp_grads")


@dataclass
class TensorParallelModel:
    """A module sharded over ``group`` (see the module docstring); implements ``TensorParallelView``."""

    module: torch.nn.Module
    group: TPGroup
    report: registry.Report | None = None
    """What :func:`registry.apply` sharded or replaced (None at tensor-parallel degree 1)."""
    _hooks: list = field(default_factory=list, repr=False)

    @property
    def size(self) -> int:
        return self.group.size

    def deepspeed_mpu(self, groups: ProcessGroups) -> TensorParallelMPU:
        return TensorParallelMPU(groups)

    # ---- state ------------------------------------------------------------------------------------
    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return full_tensor(tensor, self.group)

    def local_part(self, target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return local_part(target, value, self.group)

    def join(self, state_dict: Mapping[str, Any], keep_vars: bool = False) -> dict[str, Any]:
        out = {}
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and spec_of(value) is not None:
                value = full_tensor(value, self.group)
            elif isinstance(value, torch.Tensor) and not keep_vars:
                value = value.detach()
            out[key] = value
        return out

    def cut(self, own: Mapping[str, Any], state_dict: Mapping[str, Any]) -> dict[str, Any]:
        cut = {}
        for key, value in state_dict.items():
            target = own.get(key)
            if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                value = local_part(target, value, self.group)
            cut[key] = value
        return cut

    # ---- the step ---------------------------------------------------------------------------------
    def check_equal_batches(self, args: tuple, kwargs: dict) -> None:
        if self.group.size == 1 or self.group.prescaled_batch:
            return
        first = first_tensor((args, kwargs))
        size = int(first.shape[0]) if first is not None and first.dim() else -1
        sizes = comm.all_gather_object(size, group=self.group.handle)
        if len(set(sizes)) > 1:
            raise SMPUnsupportedError(
                f"prescaled_batch is false, so the {self.group.size} tensor-parallel ranks {list(self.group.ranks)} "
                f"join their batches, which needs equal batch sizes; got {sizes}. Give every rank the same batch "
                "size (DistributedSampler with drop_last=True)")

    def gradient_correction(self, params: Iterable[torch.nn.Parameter],
                            optimizer: Any) -> Callable[[list[torch.nn.Parameter]], None] | None:
        if self.group.size == 1 or self.group.prescaled_batch:
            return None
        if self._hooks:
            return None  # installed when the engine was first built with this optimizer
        if takes_grads_each_backward(optimizer):
            self._hooks = grads.install_group_batch_hooks(params, self.group)
            return None
        group = self.group
        return lambda ps: grads.combine_group_batches(ps, group)

    def grad_norm(self, params: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        return grads.grad_norm(params, self.group, norm_type)


def parallelize(module: torch.nn.Module, context: ParallelContext, *,
                around: Around | None = None) -> TensorParallelModel:
    """Shard ``module``'s marked modules in place over ``context``'s tensor-parallel group (nothing at degree 1)
    and return it with its tensor-parallel view. ``around``: a context in which a block's parameters can be
    read and replaced whole (models born partitioned by ZeRO-3)."""
    group = context.tp
    report = registry.apply(module, context, around=around) if group.size > 1 else None
    return TensorParallelModel(module, group, report)
