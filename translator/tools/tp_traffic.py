"""Tensor-parallel activation traffic per transformer layer and optimizer step, by formula.

Megatron-LM (Shoeybi et al. 2019, section 3): in every transformer layer the attention and the
MLP each end in a row-parallel layer whose output is all-reduced over the tensor-parallel group
in the forward pass, and each begins with a column-parallel layer whose input gradient is
all-reduced in the backward pass: four all-reduces per layer and micro-batch, each of
``b * s * h`` elements, ``b`` being the batch the layer computes on. With SMP's
``prescaled_batch: false`` the group joins its ranks' batches first, so ``b`` is ``tp`` times the
per-rank micro-batch (the join's own all-gathers are not included here); with ``true`` the group
shares one batch and ``b`` is the per-rank micro-batch.

``bench/tp_comm_bytes.py`` measures the engine's all-reduce volume against
:func:`tensor_parallel_traffic` (buffer bytes); a ring all-reduce moves ``2 (t-1)/t`` of its
buffer through each rank's link.
"""

from __future__ import annotations

from typing import Any


def tensor_parallel_traffic(
    *,
    tp: int,
    layers: int,
    hidden: int,
    seq_len: int,
    batch_per_rank: int,
    microbatches: int,
    bytes_per_element: int,
    prescaled_batch: bool,
) -> dict[str, Any]:
    """All-reduce volume of tensor parallelism per layer and per optimizer step (JSON-ready).

    ``batch_per_rank`` is the batch handed to ``@smp.step`` on one rank; it is split into
    ``microbatches`` micro-batches. Raises ValueError for sizes that are not positive or a batch
    the micro-batches do not divide.
    """
    sizes = {"tp": tp, "layers": layers, "hidden": hidden, "seq_len": seq_len, "batch_per_rank": batch_per_rank,
             "microbatches": microbatches, "bytes_per_element": bytes_per_element}
    bad = [f"{name}={value!r}" for name, value in sizes.items() if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"tensor-parallel traffic needs positive integers, got {', '.join(bad)}")
    if batch_per_rank % microbatches:
        raise ValueError(f"batch_per_rank({batch_per_rank}) is not divisible by microbatches({microbatches})")
    micro = batch_per_rank // microbatches
    layer_batch = micro if prescaled_batch else micro * tp
    buffer = 4 * layer_batch * seq_len * hidden * bytes_per_element * microbatches
    ring = 2 * (tp - 1) / tp * buffer
    return {
        "tensor_parallel_degree": tp,
        "layer_batch": layer_batch,
        "all_reduces_per_layer_and_step": 4 * microbatches,
        "all_reduce_buffer_bytes_per_layer_and_step": buffer,
        "ring_bytes_per_rank_per_layer_and_step": ring,
        "ring_bytes_per_rank_per_step": ring * layers,
        "layers": layers,
    }
