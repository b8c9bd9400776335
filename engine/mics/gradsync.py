"""Second hop of MiCS gradient synchronisation: all-reduce across the replica group once per step.

DeepSpeed's ZeRO-3 (with the shard group as its data-parallel group) already reduce-scatters
and averages gradients inside the shard group after every micro-batch, accumulating each rank's
gradient partition. At the accumulation boundary DeepSpeed calls ``optimizer.step()``, which
(DeepSpeed 0.19.8, ``runtime/zero/stage3.py`` ``DeepSpeedZeroOptimizer_Stage3.step``) first
checks overflow and computes the gradient norm from ``self.averaged_gradients`` and only then
unscales/clips and updates. Wrapping ``step`` therefore puts our all-reduce exactly where it must
be: once per optimizer step, after the last micro-batch, before overflow check, norm, clipping
and the update. After it every replica holds the dp-wide average of its partition, so the norm
DeepSpeed all-reduces over the shard group is the unsharded norm and clipping matches. By
default most of that all-reduce has already run by then, overlapped with backward (one
asynchronous all-reduce per reduce-scatter bucket, ``overlap.py``); ``step`` waits on it and
all-reduces only what it did not cover.

Private DeepSpeed attributes relied on (checked by ``check_stage3_internals``, pinned by
tests/engine/mics/test_mics_internals.py): ``averaged_gradients`` (dict: sub-group index -> list of
partition tensors, filled by ``independent_gradient_partition_epilogue``), ``fp16_groups``,
``offload_optimizer``, and optionally ``grad_partitions_flat_buffer`` (the storage those tensors
view; used to all-reduce in one call without a copy).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from smp2ds.engine.core import comm
from smp2ds.engine.mics.overlap import install_overlap

_REQUIRED = ("averaged_gradients", "fp16_groups", "step", "fp32_partitioned_groups_flat", "dp_process_group")


class DeepSpeedInternalsChanged(RuntimeError):
    """The installed DeepSpeed no longer has what the MiCS gradient hook relies on."""


def check_stage3_internals(optimizer: Any) -> None:
    """Raise ``DeepSpeedInternalsChanged`` (naming what is missing) unless ``optimizer`` fits."""
    import deepspeed

    missing = [name for name in _REQUIRED if not hasattr(optimizer, name)]
    if type(optimizer).__name__ != "DeepSpeedZeroOptimizer_Stage3" or missing:
        raise DeepSpeedInternalsChanged(
            f"MiCS needs DeepSpeed's ZeRO-3 optimizer with attributes {list(_REQUIRED)}; got "
            f"{type(optimizer).__name__} missing {missing} (deepspeed {deepspeed.__version__}). The replica "
            "all-reduce hooks DeepSpeedZeroOptimizer_Stage3.averaged_gradients (verified on 0.19.8); "
            "see smp2ds/engine/mics/gradsync.py.")
    if not isinstance(optimizer.averaged_gradients, dict):
        raise DeepSpeedInternalsChanged(
            f"DeepSpeedZeroOptimizer_Stage3.averaged_gradients is a {type(optimizer.averaged_gradients).__name__},"
            f" expected dict (deepspeed {deepspeed.__version__}); see smp2ds/engine/mics/gradsync.py")
    if getattr(optimizer, "offload_optimizer", False):
        raise DeepSpeedInternalsChanged(
            "MiCS sharded data parallelism does not support optimizer offload (SMP forbids cpu_offload with "
            "sharded_data_parallel_degree too): remove zero_optimization.offload_optimizer")


def _partition_tensors(optimizer: Any, skip: set[int] | frozenset[int] = frozenset()) -> list[torch.Tensor]:
    """The accumulated gradient partitions this rank holds, in a fixed order (same on every rank).

    ``skip``: ``ds_id``s of parameters whose partitions are left out (already averaged)."""
    import deepspeed

    groups = optimizer.averaged_gradients
    if len(groups) != len(optimizer.fp16_groups) or any(groups.get(i) is None for i in range(len(groups))):
        raise DeepSpeedInternalsChanged(
            f"at optimizer.step() DeepSpeedZeroOptimizer_Stage3.averaged_gradients holds {len(groups)} of "
            f"{len(optimizer.fp16_groups)} sub-groups (deepspeed {deepspeed.__version__}); the MiCS replica "
            "all-reduce cannot find the gradient partitions. Was backward() run before step()?")
    return [t for i in range(len(groups)) for p, t in zip(optimizer.fp16_groups[i], groups[i])
            if p.ds_id not in skip]


def _covers_flat_buffer(tensors: list[torch.Tensor], flat: torch.Tensor | None) -> bool:
    """Whether ``tensors`` are exactly the views of DeepSpeed's flat gradient buffer."""
    if flat is None or sum(t.numel() for t in tensors) != flat.numel():
        return False
    base = flat.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == base for t in tensors)


def replica_allreduce(optimizer: Any, replica_group: Any, replicas: int,
                      skip: set[int] | frozenset[int] = frozenset()) -> int:
    """Average this rank's gradient partitions over ``replica_group``; return elements reduced.

    ``skip``: ``ds_id``s already averaged (by the overlapped path); every rank skips the same ones."""
    tensors = _partition_tensors(optimizer, skip)
    if not tensors:
        return 0
    flat_buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if _covers_flat_buffer(tensors, flat_buffer):
        _average(flat_buffer, replica_group, replicas)  # one collective, no copy
        return flat_buffer.numel()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    count = 0
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = _flatten_dense_tensors(group)
        _average(flat, replica_group, replicas)
        for dst, src in zip(group, _unflatten_dense_tensors(flat, group)):
            dst.copy_(src)
        count += flat.numel()
    return count


def _average(flat: torch.Tensor, group: Any, replicas: int) -> None:
    # Half precision: divide first so the sum cannot overflow; fp32: divide after (fewer roundings).
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat.div_(replicas)
        comm.all_reduce(flat, group=group)
    else:
        comm.all_reduce(flat, group=group)
        flat.div_(replicas)


def install_replica_allreduce(optimizer: Any, replica_group: Any, replicas: int, overlap: bool = True) -> None:
    """Wrap ``optimizer.step`` so the replica all-reduce is complete before it; counts in ``mics_replica_syncs``.

    ``overlap``: start the all-reduce per reduce-scatter bucket during the boundary backward
    (``overlap.ReplicaOverlap``, kept as ``optimizer.mics_overlap``; None when off or when this
    DeepSpeed lacks the hook points) and wait on it here; what it did not cover is all-reduced here.
    ``optimizer.mics_sync_elements`` counts the elements all-reduced synchronously at ``step``.
    """
    check_stage3_internals(optimizer)
    if getattr(optimizer, "_smp2ds_mics_hooked", False):
        return
    original_step = optimizer.step
    optimizer.mics_replica_syncs = 0
    optimizer.mics_sync_elements = 0
    optimizer.mics_overlap = install_overlap(optimizer, replica_group, replicas) if overlap and replicas > 1 else None

    @functools.wraps(original_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        if replicas > 1:
            done = optimizer.mics_overlap.finish() if optimizer.mics_overlap is not None else frozenset()
            optimizer.mics_sync_elements += replica_allreduce(optimizer, replica_group, replicas, skip=done)
            optimizer.mics_replica_syncs += 1
        return original_step(*args, **kwargs)

    optimizer.step = step
    optimizer._smp2ds_mics_hooked = True
