"""``smp.nn``: SMP's tensor-parallel module names.

``DistributedModule``, ``DistributedLinear`` and ``DistributedEmbedding`` are real tensor-parallel
modules (:mod:`smp2ds.engine.tensor_parallel.modules`): with ``tensor_parallel_degree`` 1 they are
their plain counterparts, above it each rank holds a shard. ``huggingface.<family>`` holds the
state-dict translators scripts import. SMP's distributed transformer
(``DistributedTransformer*``, ``DistributedAttentionLayer``, ``DistributedLayerNorm``) is real
(:mod:`transformer`, :mod:`transformer_layers`); ``FlashAttentionLayer`` raises a clear error.
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.transformer import DistributedTransformer, DistributedTransformerLMHead
from smp2ds.engine.nn.transformer_layers import (
    DistributedAttentionLayer,
    DistributedLayerNorm,
    DistributedTransformerLayer,
    DistributedTransformerOutputLayer,
)
from smp2ds.engine.tensor_parallel.modules import DistributedEmbedding, DistributedLinear, DistributedModule

__all__ = [
    "DistributedAttentionLayer", "DistributedEmbedding", "DistributedLayerNorm", "DistributedLinear",
    "DistributedModule", "DistributedTransformer", "DistributedTransformerLMHead", "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer", "FlashAttentionLayer", "FusedLayerNorm",
]


class FusedLayerNorm(torch.nn.LayerNorm):
    """Stand-in for apex's FusedLayerNorm (same maths, PyTorch kernel)."""


def _unsupported(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise SMPUnsupportedError(f"smp.nn.{name} is not provided by smp2ds (no fused tensor-parallel transformer "
                                  "kernels); build the model from Hugging Face or torch.nn modules inside "
                                  "smp.tensor_parallelism() instead: smp2ds shards them in place")

    return type(name, (DistributedModule,), {"__init__": __init__, "__doc__": f"Not available: {name}."})


FlashAttentionLayer = _unsupported("FlashAttentionLayer")
