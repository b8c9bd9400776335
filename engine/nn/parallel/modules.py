"""``smp.nn``'s tensor-parallel modules: ``DistributedModule``, ``DistributedLinear``,
``DistributedEmbedding`` (real implementations; global sizes in the constructor, as in SMP).

Before ``smp.init`` or with ``tensor_parallel_degree`` 1 they are their plain counterparts. With
a degree ``tp`` > 1 each one is a tensor-parallel region on its own (:mod:`region`) and holds a
1/tp shard:

* ``DistributedLinear``: output features split (weight ``[out/tp, in]``); the output features
  are all-gathered, so it maps whole inputs to whole outputs like ``nn.Linear``;
* ``DistributedEmbedding``: ``embedding_dim`` split (weight ``[V, D/tp]``, SMP's default) and
  gathered, or with ``vocab_parallel=True`` the vocabulary split (``[V/tp, D]``): out-of-range
  ids look up zeros and the partial results are summed.

Fresh weights come from the tensor-parallel stream (``tensor_parallel_seed``): every rank draws
the same full tensor and keeps its shard, so the model is the same at any degree.

The group is the one of ``parallel_context`` (a keyword smp2ds adds to SMP's signatures), else of the active
context (:mod:`smp2ds.engine.nn.parallel.context`); the module keeps it as ``.tp``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.parallel.collectives import copy_to_tp, gather_last_dim
from smp2ds.engine.nn.parallel.context import ParallelContext, resolve
from smp2ds.engine.nn.parallel.layers import vocab_parallel_lookup
from smp2ds.engine.nn.parallel.region import mark_scaled_batch, run_region
from smp2ds.engine.nn.parallel.shards import ShardSpec, shard_parameter


class DistributedModule(torch.nn.Module):
    """Base class of SMP's distributed modules; applies a registration's forward/return hooks."""

    _smp2ds_forward_hook: Any = None
    _smp2ds_return_hook: Any = None

    @staticmethod
    def can_distribute(*args: Any, **kwargs: Any) -> bool:
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._smp2ds_forward_hook is not None:
            args, kwargs = self._smp2ds_forward_hook(*args, **kwargs)
        out = super().__call__(*args, **kwargs)
        return out if self._smp2ds_return_hook is None else self._smp2ds_return_hook(out)


class DistributedLinear(torch.nn.Linear, DistributedModule):
    """Tensor-parallel ``nn.Linear(in_features, out_features, bias)`` (sizes are global). No catch-all
    keyword arguments: a marking context's settings for other modules (``vocab_parallel``) skip it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, *, parallel_context: ParallelContext | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.tp = resolve(parallel_context).tp
        if self.tp.size == 1:
            return
        gen = self.tp.rng.init_generator()
        with torch.no_grad():
            # nn.Linear.reset_parameters' distribution, from the shared stream
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5), generator=gen)
            if self.bias is not None:
                bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
                torch.nn.init.uniform_(self.bias, -bound, bound, generator=gen)
        for name in ("weight", "bias") if bias else ("weight",):
            shard_parameter(self, name, ShardSpec(0, self.tp.size), self.tp.rank)
        mark_scaled_batch(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        return run_region(self.tp, self._local_forward, (x,), {})

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(F.linear(copy_to_tp(x, self.tp), self.weight, self.bias), self.tp)


class DistributedEmbedding(torch.nn.Embedding, DistributedModule):
    """Tensor-parallel ``nn.Embedding`` (SMP signature; sizes are global)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, vocab_parallel: bool = False, _weight: Any = None,
                 initializer_range: float = 0.02, _skip_allgather: bool = False,
                 _skip_scatter_and_merge: bool = False, _output_full_batch: bool = False, *,
                 parallel_context: ParallelContext | None = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, _weight)
        self.vocab_parallel = bool(vocab_parallel)
        self.tp = resolve(parallel_context).tp
        if _weight is None:
            gen = self.tp.rng.init_generator() if self.tp.size > 1 else None
            with torch.no_grad():
                torch.nn.init.normal_(self.weight, std=initializer_range, generator=gen)
                if padding_idx is not None:
                    self.weight[padding_idx].zero_()
        if self.tp.size == 1:
            return
        if max_norm is not None or sparse:
            raise SMPUnsupportedError("smp.nn.DistributedEmbedding with max_norm or sparse gradients cannot be "
                                      "split over tensor-parallel ranks; use max_norm=None, sparse=False")
        dim = 0 if self.vocab_parallel else 1
        shard_parameter(self, "weight", ShardSpec(dim, self.tp.size), self.tp.rank)
        mark_scaled_batch(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        return run_region(self.tp, self._local_forward, (ids,), {})

    def _local_forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.vocab_parallel:
            return gather_last_dim(F.embedding(ids, self.weight, self.padding_idx, None, self.norm_type,
                                               self.scale_grad_by_freq), self.tp)
        return vocab_parallel_lookup(ids, self.weight, self.tp, self.padding_idx, self.norm_type,
                                     self.scale_grad_by_freq)
