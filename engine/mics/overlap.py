"""Replica all-reduce overlapped with backward: one asynchronous all-reduce per reduce-scatter bucket.

DeepSpeed 0.19.8's ZeRO-3 reduce-scatters gradients inside the shard group bucket by bucket while
backward runs: ``DeepSpeedZeroOptimizer_Stage3.__reduce_and_partition_ipg_grads`` (name-mangled;
called when a bucket of ``reduce_bucket_size`` elements fills, and for the last bucket from
``independent_gradient_partition_epilogue``) hands the reduced partitions to the public
``partition_grads(params, grad_partitions)``, which writes (first micro-batch) or adds each
parameter's partition into its view of ``grad_partitions_flat_buffer``
(``__param_id_to_grad_partition[param.ds_id]``, the same tensors ``averaged_gradients`` lists).
On the accumulation-boundary micro-batch (``optimizer.is_gradient_accumulation_boundary()``, set
by the engine before backward) those views hold their final value for the step once
``partition_grads`` returns.

``ReplicaOverlap`` wraps ``partition_grads``: on a boundary backward it copies the bucket's
partitions into one flat tensor and starts an asynchronous all-reduce of it over the replica
group; backward goes on (earlier layers, the shard group's all-gathers and reduce-scatters) while
that all-reduce crosses the nodes. ``finish()`` (called by gradsync's ``step`` wrapper, before
DeepSpeed's overflow check, norm, clipping and update) waits on every handle, divides by R and
copies the averages into the partitions; gradsync all-reduces synchronously whatever was not
covered. The arithmetic per element is the synchronous path's (fp32: sum then divide; half: divide
then sum), so results are equal.

Why this is safe: the local partitions are never written before ``finish`` (the copies are
reduced, not the partitions), so dropping a copy always leaves the synchronous path's state.
A copy is dropped when its partition may have changed after it was taken: the parameter is
reduced again in the same window (a second backward before ``step``, reentrant checkpointing),
a new backward begins before ``step`` (``backward_prologue``), or a gradient is set through
DeepSpeed's ``set_local_grad_for_param`` / ``set_fp32_grad_for_param``. Backwards that are not
marked as the boundary (in SMP's ``@smp.step`` path every backward but the step's last micro-batch
before ``optimizer.step()``, see ``DataParallelBackend.backward``; DeepSpeed's unmanaged accumulation)
issue nothing and keep the synchronous path.

Cost: from the first bucket of the boundary backward until ``step``, a copy of the partitions
issued so far (at most this rank's gradient partition, 1/S of the gradients) in the gradient
dtype. Tested with gloo on CPU; on GPU the copy and the all-reduce are issued on the stream
``partition_grads`` runs on (DeepSpeed's ``reduce_and_partition_stream``), not measured there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from smp2ds.engine.core import comm

VIEWS_ATTR = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
_INVALIDATING = ("set_local_grad_for_param", "set_fp32_grad_for_param")


@dataclass
class _Bucket:
    ids: list[int]
    views: list[torch.Tensor]
    flat: torch.Tensor
    work: Any


class ReplicaOverlap:
    """Asynchronous per-bucket replica all-reduce for one ZeRO-3 optimizer (see module docstring).

    ``log`` records ``("issue", elements)`` and ``("wait", elements)`` in order (tests append
    their own markers to see where they fall); ``async_elements`` counts elements averaged by the
    overlapped path since creation.
    """

    def __init__(self, optimizer: Any, group: Any, replicas: int) -> None:
        self.optimizer, self.group, self.replicas = optimizer, group, replicas
        self.pending: list[_Bucket] = []
        self.issued: set[int] = set()
        self.dirty: set[int] = set()
        self.log: list[tuple[str, int]] = []
        self.async_elements = 0

    def install(self) -> None:
        """Wrap ``partition_grads``, ``backward_prologue`` and the gradient setters on the optimizer."""
        opt = self.optimizer
        original = opt.partition_grads

        @functools.wraps(original)
        def partition_grads(params: list[Any], grad_partitions: list[torch.Tensor]) -> Any:
            ids = [p.ds_id for p in params]  # DeepSpeed clears the bucket's list after this call
            result = original(params, grad_partitions)
            if _is_boundary(opt):
                self.issue(ids)
            return result

        opt.partition_grads = partition_grads
        self._wrap_before("backward_prologue", self.discard)
        for name in _INVALIDATING:
            self._wrap_before(name, self.discard)

    def _wrap_before(self, name: str, action: Any) -> None:
        original = getattr(self.optimizer, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            action()
            return original(*args, **kwargs)

        setattr(self.optimizer, name, wrapped)

    def issue(self, ids: list[int]) -> None:
        """Start the all-reduce of the partitions of ``ids`` (just reduced inside the shard group)."""
        fresh = []
        for i in ids:
            if i in self.issued:
                self.dirty.add(i)  # reduced again in this window: its copy is stale
            else:
                fresh.append(i)
        # Looked up each time: DeepSpeed's offload_states() replaces the dict.
        by_id: dict[int, torch.Tensor] = getattr(self.optimizer, VIEWS_ATTR, None) or {}
        if not fresh or any(i not in by_id for i in fresh):
            return  # nothing new, or partitions not where expected: step() all-reduces them
        views = [by_id[i] for i in fresh]
        flat = _flatten_dense_tensors(views)  # a copy: the partitions stay local until finish()
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat.div_(self.replicas)  # as the synchronous path: divide first so half cannot overflow
        work = comm.all_reduce(flat, group=self.group, async_op=True)
        self.pending.append(_Bucket(fresh, views, flat, work))
        self.issued.update(fresh)
        self.log.append(("issue", flat.numel()))

    def discard(self) -> None:
        """Drop every pending all-reduce (waited on, results unused); the partitions are untouched."""
        for bucket in self.pending:
            bucket.work.wait()
        self._reset()

    def finish(self) -> set[int]:
        """Wait on the pending all-reduces, write the averages in place; return the ``ds_id``s covered."""
        covered: set[int] = set()
        for bucket in self.pending:
            bucket.work.wait()
            self.log.append(("wait", bucket.flat.numel()))
            if bucket.flat.dtype not in (torch.float16, torch.bfloat16):
                bucket.flat.div_(self.replicas)
            for i, view, avg in zip(bucket.ids, bucket.views, _unflatten_dense_tensors(bucket.flat, bucket.views)):
                if i not in self.dirty:
                    view.copy_(avg)
                    covered.add(i)
                    self.async_elements += view.numel()
        self._reset()
        return covered

    def _reset(self) -> None:
        self.pending, self.issued, self.dirty = [], set(), set()


def _is_boundary(optimizer: Any) -> bool:
    check = getattr(optimizer, "is_gradient_accumulation_boundary", None)
    return bool(check()) if callable(check) else False


def install_overlap(optimizer: Any, group: Any, replicas: int) -> ReplicaOverlap | None:
    """Install ``ReplicaOverlap`` when this DeepSpeed offers the hook points; None (synchronous) otherwise."""
    if not (callable(getattr(optimizer, "partition_grads", None))
            and isinstance(getattr(optimizer, VIEWS_ATTR, None), dict)):
        return None
    overlap = ReplicaOverlap(optimizer, group, replicas)
    overlap.install()
    return overlap
