"""Column- and row-parallel linear layers made from an existing ``nn.Linear`` or Hugging Face
``Conv1D`` **in place**: the object, its class (a subclass is swapped in), its parameter names
and its place in the model stay; its weight (and bias) become this rank's shard.

* column-parallel: output features split; ``y_r = x W_r^T + b_r`` on a whole input that entered
  through :func:`copy_to_tp` (its gradient is summed over the group);
* row-parallel: input features split; ``y = sum_r x_r W_r^T + b`` with the sum an all-reduce
  (:func:`reduce_from_tp`) and the bias replicated, added once after the sum.

``nn.Linear`` keeps its weight as ``[out, in]``; GPT-2's ``Conv1D`` as ``[in, out]`` (transposed),
so the split dimension differs. ``blocks`` > 1 splits a fused projection (query/key/value) per
block, keeping every head's q, k and v on the same rank.

A vocab-parallel ``nn.Embedding`` keeps rows ``[r*V/tp, (r+1)*V/tp)`` on rank ``r``: ids outside
look up zeros and the group's partial results are summed (:func:`vocab_parallel_lookup`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from smp2ds.engine.nn.parallel.collectives import copy_to_tp, reduce_from_tp
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.shards import ShardSpec, shard_parameter

_DERIVED: dict[tuple[type, type], type] = {}


def swap_class(module: torch.nn.Module, mixin: type) -> None:
    """Give ``module`` the behaviour of ``mixin`` by making it an instance of ``(mixin, its class)``."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    key = (mixin, cls)
    if key not in _DERIVED:
        name = f"{mixin.__name__.lstrip('_')}{cls.__name__}"
        _DERIVED[key] = type(name, (mixin, cls), {"__module__": cls.__module__})
    module.__class__ = _DERIVED[key]


def is_conv1d(module: torch.nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (weight stored ``[in, out]``), recognised by name and shape."""
    return type(module).__name__ == "Conv1D" or any(c.__name__ == "Conv1D" for c in type(module).__mro__)


def _weight_out_in(module: torch.nn.Module) -> torch.Tensor:
    return module.weight.t() if module._smp2ds_conv1d else module.weight


class _ColumnParallel:
    """forward of a column-parallel linear (mixed in front of the original class)."""

    _smp2ds_tp: TPGroup
    _smp2ds_conv1d: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self._smp2ds_tp), _weight_out_in(self), self.bias)


class _RowParallel:
    """forward of a row-parallel linear (mixed in front of the original class)."""

    _smp2ds_tp: TPGroup
    _smp2ds_conv1d: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, _weight_out_in(self)), self._smp2ds_tp)
        return y if self.bias is None else y + self.bias


def _check_linear(module: Any, path: str) -> None:
    if not (isinstance(module, torch.nn.Linear) or is_conv1d(module)):
        raise TypeError(f"{path}: tensor parallelism shards nn.Linear or Hugging Face Conv1D layers, "
                        f"got {type(module).__name__}")


def make_column_parallel(module: torch.nn.Module, tp: TPGroup, *, blocks: int = 1, path: str = "linear") -> None:
    """Shard ``module``'s output features over ``tp`` in place (``blocks``: fused projections)."""
    _check_linear(module, path)
    conv = is_conv1d(module)
    out_dim = 1 if conv else 0
    shard_parameter(module, "weight", ShardSpec(out_dim, tp.size, blocks), tp.rank)
    if module.bias is not None:
        shard_parameter(module, "bias", ShardSpec(0, tp.size, blocks), tp.rank)
    module._smp2ds_tp, module._smp2ds_conv1d = tp, conv
    swap_class(module, _ColumnParallel)


def make_row_parallel(module: torch.nn.Module, tp: TPGroup, *, path: str = "linear") -> None:
    """Shard ``module``'s input features over ``tp`` in place; the bias stays whole."""
    _check_linear(module, path)
    conv = is_conv1d(module)
    in_dim = 0 if conv else 1
    shard_parameter(module, "weight", ShardSpec(in_dim, tp.size), tp.rank)
    module._smp2ds_tp, module._smp2ds_conv1d = tp, conv
    swap_class(module, _RowParallel)


def vocab_parallel_lookup(ids: torch.Tensor, weight: torch.Tensor, tp: TPGroup, padding_idx: int | None = None,
                          norm_type: float = 2.0, scale_grad_by_freq: bool = False) -> torch.Tensor:
    """Embedding lookup of global ``ids`` in this rank's rows ``weight`` of a vocabulary split over ``tp``."""
    rows = weight.shape[0]
    start = tp.rank * rows
    outside = (ids < start) | (ids >= start + rows)
    local_ids = (ids - start).masked_fill(outside, 0)
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + rows else None
    out = F.embedding(local_ids, weight, local_pad, None, norm_type, scale_grad_by_freq)
    return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), tp)


class _VocabParallelEmbedding:
    """forward of a vocab-parallel embedding (mixed in front of ``nn.Embedding``)."""

    _smp2ds_tp: TPGroup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(ids, self.weight, self._smp2ds_tp, self.padding_idx, self.norm_type,
                                     self.scale_grad_by_freq)


def make_vocab_parallel(module: torch.nn.Embedding, tp: TPGroup) -> None:
    """Split ``module``'s vocabulary (weight rows) over ``tp`` in place (it must run inside a region)."""
    if module.max_norm is not None or module.sparse:
        raise TypeError("a vocab-parallel embedding takes max_norm=None and sparse=False")
    shard_parameter(module, "weight", ShardSpec(0, tp.size), tp.rank)
    module._smp2ds_tp = tp
    swap_class(module, _VocabParallelEmbedding)
