"""SMP's ``optimize: memory`` for the distributed transformer: Megatron-style sequence parallelism.

With ``optimize: "speed"`` (smp2ds's default, SMP 1.7/1.12's) every rank of a tensor-parallel group holds
the whole ``[N, S, H]`` hidden states between sublayers: layer norms, dropout and residual adds run on
all tokens on every rank, and their saved activations are duplicated across the group. With
``optimize: "memory"`` the hidden states between sublayers are split along the sequence (each rank holds
``S / tp`` tokens): layer norms, dropout and residual adds run on this rank's tokens, a column-parallel
projection all-gathers its input along the sequence (keeping only this rank's tokens for backward) and
a row-parallel projection reduce-scatters its output along the sequence instead of all-reducing it.

The outermost distributed module that gets whole hidden states (``DistributedTransformer``, or a
layer, attention or MLP used on its own, e.g. as a pipeline layer) splits them on entry and joins its
output on exit; the tensors it hands to its sublayers carry a mark (:func:`is_split`), so a sublayer
called with split states, also when activation checkpointing recomputes it, does not split again.

Replicated parameters used on split tokens (layer norms, the biases of row-parallel projections) see
only this rank's tokens: :func:`replicated` sums their gradients over the group. Dropout on split
tokens draws this rank's own masks (:func:`dropout`): a seed taken from the group's stream (the same
on every rank, and restored by checkpoint recomputation) plus the rank.

Every function takes the module's tensor-parallel group (``module.tp``).
"""

from __future__ import annotations

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.parallel.collectives import copy_to_tp, join_sequence, scatter_sequence
from smp2ds.engine.nn.parallel.group import TPGroup

_SPLIT = "_smp2ds_sequence_split"


def is_split(t: torch.Tensor | None) -> bool:
    """True for hidden states a parent module split along the sequence over the group."""
    return t is not None and bool(getattr(t, _SPLIT, False))


def mark(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as this rank's tokens of sequence-split hidden states (returns ``t``)."""
    setattr(t, _SPLIT, True)
    return t


def enabled(tp: TPGroup) -> bool:
    """True when ``tp`` asks for the memory layout with tensor parallelism."""
    return tp.size > 1 and tp.optimize == "memory"


def enter(hidden: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, bool]:
    """Hidden states as the module body runs on them, and whether this call split them (it then joins
    its output with :func:`leave`). Split states pass through; whole ones are split when enabled."""
    if is_split(hidden) or not enabled(tp):
        return hidden, False
    seq = hidden.shape[1]
    if seq % tp.size:
        raise SMPUnsupportedError(
            f"optimize: memory splits the sequence over the {tp.size} tensor-parallel ranks: sequence length "
            f"{seq} is not divisible by tensor_parallel_degree {tp.size}; pad the sequence to a multiple of "
            f"{tp.size} (e.g. {seq + tp.size - seq % tp.size}) or use optimize: speed")
    return mark(scatter_sequence(hidden, tp)), True


def leave(out: torch.Tensor, entered: bool, tp: TPGroup) -> torch.Tensor:
    """The module's output: joined whole when this call split the input, else marked as split."""
    if entered:
        return join_sequence(out, tp)
    return mark(out) if is_split(out) or enabled(tp) else out


def replicated(param: torch.Tensor | None, split: bool, tp: TPGroup) -> torch.Tensor | None:
    """A replicated parameter as used on split tokens: its gradient is summed over the group."""
    if param is None or not split:
        return param
    return copy_to_tp(param, tp)


def dropout(module: torch.nn.Dropout, x: torch.Tensor, split: bool, tp: TPGroup) -> torch.Tensor:
    """``module(x)``; on split tokens each rank draws the masks of its own tokens."""
    if not split or not module.training or module.p == 0.0:
        return module(x)
    if module.p == 1.0:
        return torch.zeros_like(x)
    seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))  # the group's stream: same on every rank
    gen = torch.Generator(device=x.device).manual_seed(seed + tp.rank)
    keep = torch.rand(x.shape, generator=gen, device=x.device) >= module.p
    return x.masked_fill(~keep, 0.0) * (1.0 / (1.0 - module.p))
