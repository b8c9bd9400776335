"""``smp.nn``: SMP's tensor-parallel module names.

smp2ds does not implement tensor parallelism yet (``tensor_parallel_degree > 1`` is refused
when the model is wrapped). With one tensor-parallel rank a distributed layer is exactly its
ordinary counterpart, so the simple layers below are usable and hold the global sizes; the
fused transformer blocks raise a clear error because their reference implementations are not
provided.
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import SMPUnsupportedError


def _require_tp1(name: str) -> None:
    if state.initialized and int(state.cfg.tensor_parallel_degree) > 1:
        raise SMPUnsupportedError(f"smp.nn.{name} with tensor_parallel_degree={state.cfg.tensor_parallel_degree}: "
                                  "tensor parallelism is not implemented by smp2ds")


class DistributedModule(torch.nn.Module):
    """Base class of SMP's distributed modules."""

    @staticmethod
    def can_distribute(*args: Any, **kwargs: Any) -> bool:
        return True


class DistributedLinear(torch.nn.Linear, DistributedModule):
    """``nn.Linear`` with global sizes (one tensor-parallel rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any):
        _require_tp1("DistributedLinear")
        super().__init__(in_features, out_features, bias=bias, **kwargs)


class DistributedEmbedding(torch.nn.Embedding, DistributedModule):
    """``nn.Embedding`` with global sizes (one tensor-parallel rank)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, vocab_parallel: bool = False, _weight: Any = None,
                 initializer_range: float = 0.02, _skip_allgather: bool = False,
                 _skip_scatter_and_merge: bool = False, _output_full_batch: bool = False):
        _require_tp1("DistributedEmbedding")
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, _weight)
        if _weight is None:
            torch.nn.init.normal_(self.weight, std=initializer_range)


class DistributedLayerNorm(torch.nn.LayerNorm, DistributedModule):
    def __init__(self, normalized_shape: Any, eps: float = 1e-5):
        super().__init__(normalized_shape, eps=eps)


class FusedLayerNorm(torch.nn.LayerNorm):
    """Stand-in for apex's FusedLayerNorm (same maths, PyTorch kernel)."""


def _unsupported(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise SMPUnsupportedError(f"smp.nn.{name} is not provided by smp2ds (no tensor-parallel transformer "
                                  "kernels); build the model from Hugging Face or torch.nn modules instead")

    return type(name, (DistributedModule,), {"__init__": __init__, "__doc__": f"Not available: {name}."})


DistributedTransformerLMHead = _unsupported("DistributedTransformerLMHead")
DistributedTransformer = _unsupported("DistributedTransformer")
DistributedTransformerLayer = _unsupported("DistributedTransformerLayer")
DistributedAttentionLayer = _unsupported("DistributedAttentionLayer")
DistributedTransformerOutputLayer = _unsupported("DistributedTransformerOutputLayer")
FlashAttentionLayer = _unsupported("FlashAttentionLayer")
