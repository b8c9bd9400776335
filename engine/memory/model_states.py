"""The memory no tracer sees: what DeepSpeed's optimizer wrappers allocate beside the model.

A traced forward and backward sees the parameters and gradients the model holds. DeepSpeed adds,
outside any module (figures per parameter ``N`` this rank holds, ``S`` ranks sharing the optimizer
state, Adam's two fp32 moments):

* ZeRO stage 0 (DDP) in fp32: the moments, ``8 N``. In 16-bit (fp16 or bf16): an fp32 master copy and
  fp32 gradients besides, ``16 N``.
* ZeRO-1: a partition of the parameters in fp32 (a copy even in fp32: DeepSpeed clones it), its fp32
  gradient partition and the moments, ``16 N / S``.
* Gradient buckets. ZeRO-1 allocates its contiguous gradient buffer of ``reduce_bucket_size`` elements
  whole when ``contiguous_gradients`` is on (DeepSpeed's default), two with ``overlap_comm``, whatever the
  model's size, when backward starts. DDP flattens one bucket at a time, at most all the gradients, after
  backward.

The bytes per parameter are ``smp2ds.translator.model_state_bytes``'s, shared with ``explain --params``; here
each is a line with its reason and phase.

A part lives either through the whole step (``persistent``) or only while gradients are reduced and the
optimizer steps, after backward has freed the activations (``step``): the fp32 gradients and the flattened
DDP bucket. Each figure is one line of :func:`model_states` with its reason, so the report can show it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smp2ds.translator.model_state_bytes import ADAM_MOMENTS, FP32

DEFAULT_BUCKET = int(5e8)  # DeepSpeed's reduce_bucket_size default (elements)


@dataclass(frozen=True)
class StatePart:
    """One formula term: bytes on this rank and why."""

    name: str
    bytes: int
    reason: str
    phase: str = "persistent"
    """``persistent`` (held through forward, backward and update), ``step`` (only after backward), ``backward``
    (only during forward and backward) or ``transient`` (already in the role's transient column; shown for its
    reason)."""


def model_states(*, elements: int, grad_bytes_per_element: int, half: bool, zero_stage: int, shard: int,
                 zero_config: Mapping[str, Any]) -> tuple[list[StatePart], list[StatePart]]:
    """(optimizer-side parts, bucket parts) for ``elements`` parameters held by this rank."""
    if zero_stage not in (0, 1):
        raise ValueError(f"ZeRO stage {zero_stage}: these formulas cover stages 0 and 1 (DDP, ZeRO-1); stage 3 "
                         f"(sharded data parallelism) is zero3_states'")
    optimizer: list[StatePart] = []
    buckets: list[StatePart] = []
    if zero_stage == 0:
        optimizer.append(StatePart("Adam moments", ADAM_MOMENTS * elements, "two fp32 moments per parameter"))
        if half:
            optimizer.append(StatePart("fp32 master copy", FP32 * elements, "16-bit training updates fp32 weights"))
            optimizer.append(StatePart("fp32 gradients", FP32 * elements, "16-bit gradients are accumulated in fp32",
                                       "step"))
        bucket = int(zero_config.get("reduce_bucket_size", DEFAULT_BUCKET))
        buckets.append(StatePart("all-reduce bucket", min(elements, bucket) * grad_bytes_per_element,
                                 "the gradients of one bucket flattened for the all-reduce", "step"))
        return optimizer, buckets
    share = -(-elements // shard)
    optimizer.append(StatePart("Adam moments", ADAM_MOMENTS * share,
                               f"two fp32 moments, sharded over {shard} ranks"))
    optimizer.append(StatePart("fp32 parameter partition", FP32 * share,
                               "ZeRO-1 updates an fp32 copy of this rank's partition"))
    optimizer.append(StatePart("fp32 gradient partition", FP32 * share,
                               "the reduced gradients of this rank's partition", "step"))
    if zero_config.get("contiguous_gradients", True):
        bucket = int(zero_config.get("reduce_bucket_size", DEFAULT_BUCKET))
        count = 2 if zero_config.get("overlap_comm", False) else 1
        buckets.append(StatePart("contiguous gradient buffer", count * bucket * grad_bytes_per_element,
                                 f"{count} x reduce_bucket_size ({bucket:g} elements), allocated whole"))
    return optimizer, buckets
