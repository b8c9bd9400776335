"""Tensor parallelism inside pipeline stages (``tensor_parallel_degree`` x ``pipeline_parallel_degree``).

The whole model is sharded in place before the pipeline cuts it into stages (:func:`registry.apply`
on every rank: each stage's blocks are then tensor-parallel regions over the stage's
tensor-parallel group). DeepSpeed's `PipelineEngine` runs on the SMP layout's `ProcessTopology`
(axes pipe/data/model): activations travel between the ranks of the same tensor-parallel and
data-parallel coordinates, and its gradient reduction runs over the data axis, the
reduced-data-parallel group. What tensor parallelism adds to the pipeline runner:

* before the step's reductions, the group's per-rank gradients are combined
  (``prescaled_batch: false``, :func:`grads.combine_group_batches`; with bf16, whose optimizer
  moves each backward's gradients into its own buffers, per micro-batch by gradient hooks);
* ``state_dict()`` joins every shard (collective over the tensor-parallel group),
  ``load_state_dict`` cuts full tensors to this rank's shard;
* the gradient norm counts shards once per group and replicated tensors once.

DeepSpeed's ``pipe_partitioned`` / ``grad_partitioned`` (activations split over the model axis
between stages, assuming the group holds identical activations) stay off: with
``prescaled_batch: false`` every tensor-parallel rank's activations are its own rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.nn.parallel.group import TPGroup, current
from smp2ds.engine.nn.parallel.shards import full_tensor, local_part
from smp2ds.engine.tensor_parallel import grads, registry


def shard_before_stages(module: torch.nn.Module) -> TPGroup:
    """Shard the marked modules of the whole model in place; returns this rank's group."""
    tp = current()
    if tp.size > 1:
        registry.apply(module, tp)
    return tp


def attach(runner: Any, tp: TPGroup, precision: str) -> None:
    """Give a `PipelineRunner` the tensor-parallel gradient and state-dict hooks."""
    if tp.size == 1:
        return
    if not tp.prescaled_batch:
        if precision == "bf16":
            # DeepSpeed's bf16 optimizer takes each backward's gradients into its fp32 buffers at
            # once: correct every micro-batch's gradient as autograd produces it instead.
            grads.install_group_batch_hooks(runner.module.parameters(), tp)
        else:
            runner.before_reduce = lambda params: grads.combine_group_batches(params, tp)
    runner.full_tensor = lambda t: full_tensor(t, tp)
    runner.local_part = lambda target, value: local_part(target, value, tp)


def stage_grad_norm(params: Iterable[torch.nn.Parameter], tp: TPGroup, pipe_group: Any,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Norm over the whole model of this pipeline: each stage's norm (shards summed over the
    tensor-parallel group, replicated tensors once), then summed over the pipeline's stages.
    ``params``: this stage's parameters, tied copies on later stages excluded."""
    if norm_type == float("inf"):
        stage = grads.grad_norm(params, tp, norm_type).clone()
        comm.all_reduce(stage, op=comm.ReduceOp.MAX, group=pipe_group)
        return stage
    total = grads.grad_norm(params, tp, norm_type).pow(norm_type)
    comm.all_reduce(total, group=pipe_group)
    return total.pow(1.0 / norm_type)

