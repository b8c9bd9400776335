"""What ZeRO-3 inside a MiCS shard group adds to a traced step (``sharded_data_parallel_degree`` > 1).

The engine runs sharded data parallelism on DeepSpeed's ZeRO-3 (``engine/mics``) with the ZeRO settings the
translator emits (``stage3_param_persistence_threshold``, ``stage3_max_live_parameters``,
``reduce_bucket_size``, ``contiguous_gradients: false``). The trace runs the rank's model with every
parameter whole and no gradient held before backward; this module turns it into what DeepSpeed holds, for
``S`` ranks in the shard group, ``P`` = the sum over parameters of ``ceil(numel / S)`` (DeepSpeed pads every
partition) and the training dtype's ``e`` bytes:

* parameters: this rank's partition of every parameter, ``e P`` (DeepSpeed's flat partition buffer);
  parameters of at most ``param_persistence_threshold`` elements are also kept whole on every rank
  (``ds_persist``); the others are whole only while gathered (below).
* gathered parameters (transient): non-persistent parameters are all-gathered for the module that runs
  and prefetched ahead (``prefetch_bucket_size`` elements) while fewer than ``max_live_parameters`` are
  gathered; a released parameter whose next use comes within ``max_reuse_distance`` elements stays
  gathered. A layer's backward comes twice the elements after it after its forward, so when backward starts
  the last ``max_reuse_distance / 2`` elements of the model are still gathered, with the running layer and
  the prefetch: all of a model smaller than that.
* gradients: the flat partition of gradients, ``e P``, lives through the step. With
  ``contiguous_gradients: false`` each whole gradient autograd makes waits in the reduce bucket until
  ``reduce_bucket_size`` elements have arrived, then is reduce-scattered into the partition and freed: the
  trace sees the whole gradients made so far; at most a bucket (plus the parameter that overflows it) of
  them are alive.
* optimizer: Adam's two fp32 moments ``8 P`` and DeepSpeed's fp32 master partition ``4 P`` (a copy even in
  fp32); while it steps, the flattened fp32 gradient partition ``4 P`` and Adam's temporaries: the whole
  partition is one tensor (``sub_group_size``), so torch's single-tensor Adam makes ``sqrt(v)`` and its
  quotient, ``8 P`` (its foreach path, the default on GPU, makes one: an over-count of ``4 P`` there).
* the last reduce-scatter, when backward ends: the bucket's whole gradients, its flattened copy (one more
  on CPU ranks: gloo copies the input), the first layer's gathered parameters and what the step still holds
  (its output: traced). A small model peaks here.
* with ``R`` > 1 replicas, the copy of the gradient partition all-reduced across the replica group
  (``engine/mics/overlap.py``), ``e P``, from the boundary backward until the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from smp2ds.engine.memory.model_states import ADAM_MOMENTS, DEFAULT_BUCKET, FP32, StatePart

DEFAULT_PERSISTENCE = int(1e5)
"""DeepSpeed's ``param_persistence_threshold`` default (elements)."""
DEFAULT_MAX_LIVE = int(1e9)
"""DeepSpeed's ``max_live_parameters`` default (elements)."""
DEFAULT_REUSE = int(1e9)
"""DeepSpeed's ``max_reuse_distance`` default (elements)."""
DEFAULT_PREFETCH = int(5e7)
"""DeepSpeed's ``prefetch_bucket_size`` default (elements)."""


def _setting(zero_config: Mapping[str, Any], name: str, default: int) -> int:
    """A ZeRO-3 setting under its canonical name or its ``stage3_`` alias."""
    for key in (name, f"stage3_{name}"):
        if zero_config.get(key) is not None:
            return int(zero_config[key])
    return default


@dataclass(frozen=True)
class Zero3Census:
    """The rank's parameters as ZeRO-3 places them (elements)."""

    whole_bytes: int
    """Every parameter whole, in its dtype: what the trace counts."""
    partition: int
    """``P``: the sum of the padded partitions."""
    persistent: int
    """Elements of the parameters kept whole (``ds_persist``)."""
    persistent_bytes: int
    gathered: int
    """Non-persistent elements whole at once at most."""
    gathered_bytes: int
    largest_parameter: int
    largest_layer_bytes: int
    """The largest layer's non-persistent parameters, whole."""


def census(modules: Iterable[nn.Module], shard: int, zero_config: Mapping[str, Any]) -> Zero3Census:
    """``Zero3Census`` of the unique parameters of ``modules`` partitioned over ``shard`` ranks."""
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    threshold = _setting(zero_config, "param_persistence_threshold", DEFAULT_PERSISTENCE)
    max_live = _setting(zero_config, "max_live_parameters", DEFAULT_MAX_LIVE)
    reuse = _setting(zero_config, "max_reuse_distance", DEFAULT_REUSE)
    prefetch = _setting(zero_config, "prefetch_bucket_size", DEFAULT_PREFETCH)
    persistent = [p for p in params if p.numel() <= threshold]
    others = [p for p in params if p.numel() > threshold]
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False) if p.numel() > threshold)
                         for mod in modules for m in mod.modules()), default=0)
    other_elements = sum(p.numel() for p in others)
    # When backward starts: the layers whose backward comes within max_reuse_distance elements of their forward
    # (the last reuse / 2 of the model) are still gathered, the running layer, and the prefetch while fewer than
    # max_live_parameters are gathered.
    kept = reuse // 2
    gathered = min(other_elements, kept + largest_layer + max(0, min(prefetch, max_live - kept)))
    elem = next((p.element_size() for p in others), 0)
    return Zero3Census(
        whole_bytes=sum(p.numel() * p.element_size() for p in params),
        partition=sum(-(-p.numel() // shard) for p in params),
        persistent=sum(p.numel() for p in persistent),
        persistent_bytes=sum(p.numel() * p.element_size() for p in persistent),
        gathered=gathered,
        gathered_bytes=gathered * elem if other_elements else 0,
        largest_parameter=max((p.numel() for p in params), default=0),
        largest_layer_bytes=min(largest_layer, other_elements) * elem,
    )


def zero3_states(found: Zero3Census, *, element_size: int, shard: int, replicas: int,
                 zero_config: Mapping[str, Any], traced_gradients: int, final_gradients: int, final_held: int,
                 reduce_scatter_copies: int = 1) -> Zero3Parts:
    """The formula parts of ZeRO-3 over ``shard`` ranks. ``traced_gradients``: the whole gradients the trace saw
    alive at its peak; ``final_gradients`` / ``final_held``: the gradients, and everything else but parameters,
    alive when its backward ended; ``reduce_scatter_copies``: copies of the bucket a reduce-scatter makes (1:
    DeepSpeed flattens the bucket; 2 on CPU ranks, whose gloo backend copies its input again)."""
    share = found.partition
    optimizer = [
        StatePart("Adam moments", ADAM_MOMENTS * share, f"two fp32 moments of this rank's partition (1/{shard})"),
        StatePart("fp32 master partition", FP32 * share, "DeepSpeed updates an fp32 copy of the partition"),
        StatePart("fp32 gradient partition", FP32 * share, "the partition's gradients flattened in fp32 for the "
                  "update", "step"),
        StatePart("Adam temporaries", 2 * FP32 * share, "the partition is one tensor: torch's Adam makes sqrt(v) "
                  "and its quotient, each as large", "step"),
    ]
    bucket = _setting(zero_config, "reduce_bucket_size", DEFAULT_BUCKET)
    cap = (bucket + found.largest_parameter) * element_size
    last = min(final_gradients, cap)
    buckets = [
        StatePart("reduce bucket", min(traced_gradients, cap),
                  f"whole gradients waiting for the reduce-scatter at the traced peak (at most reduce_bucket_size "
                  f"{bucket:g} elements and one parameter)", "backward"),
        StatePart("last reduce bucket", last, "whole gradients of the last bucket, reduce-scattered when backward "
                  "ends (traced)", "reduce"),
        StatePart("reduce-scatter copies", reduce_scatter_copies * last,
                  f"{reduce_scatter_copies} flat cop{'y' if reduce_scatter_copies == 1 else 'ies'} of that bucket for "
                  f"the reduce-scatter", "reduce"),
    ]
    if replicas > 1:
        buckets.append(StatePart("replica all-reduce copy", element_size * share,
                                 f"the gradient partition copied for the all-reduce across {replicas} replicas",
                                 "step"))
    shown = [
        StatePart("gathered parameters", found.gathered_bytes,
                  f"{found.gathered:,} elements of parameters over the persistence threshold all-gathered at once "
                  f"(the model's last max_reuse_distance / 2, the running layer and the prefetch), in the transient "
                  f"column", "transient"),
        StatePart("first layer's gathered parameters", found.largest_layer_bytes,
                  "still gathered for the last layer's backward (at most the largest layer)", "reduce"),
        StatePart("held when backward ends", final_held, "the step's output (logits), caches and inputs (traced)",
                  "reduce"),
    ]
    return Zero3Parts(optimizer=optimizer, buckets=buckets, shown=shown)


@dataclass(frozen=True)
class Zero3Parts:
    """Formula parts by the column they are shown in (``shown``: in none, or already in the transient one)."""

    optimizer: list[StatePart]
    buckets: list[StatePart]
    shown: list[StatePart]

    def bucket_bytes(self) -> int:
        """The buckets column: the larger of the forward-and-backward bucket and the last reduce-scatter's."""
        by_phase: dict[str, int] = {}
        for part in self.buckets:
            by_phase[part.phase] = by_phase.get(part.phase, 0) + part.bytes
        return max(by_phase.values(), default=0)
