"""``smp.nn``: SMP's tensor-parallel module names.

``DistributedModule``, ``DistributedLinear`` and ``DistributedEmbedding`` are real tensor-parallel
modules (:mod:`smp2ds.engine.nn.parallel.modules`): with ``tensor_parallel_degree`` 1 they are
their plain counterparts, above it each rank holds a shard. ``huggingface.<family>`` holds the
state-dict translators scripts import. SMP's distributed transformer
(``DistributedTransformer*``, ``DistributedAttentionLayer``, ``DistributedLayerNorm``) is real
(:mod:`transformer`, :mod:`transformer_layers`); ``FlashAttentionLayer`` is PyTorch's fused
attention on packed q/k/v (:mod:`flash_attention`).
"""

from __future__ import annotations

import torch

from smp2ds.engine.nn.flash_attention import FlashAttentionLayer
from smp2ds.engine.nn.parallel.modules import DistributedEmbedding, DistributedLinear, DistributedModule
from smp2ds.engine.nn.transformer import DistributedTransformer, DistributedTransformerLMHead
from smp2ds.engine.nn.transformer_layers import (
    DistributedAttentionLayer,
    DistributedLayerNorm,
    DistributedTransformerLayer,
    DistributedTransformerOutputLayer,
)

__all__ = [
    "DistributedAttentionLayer", "DistributedEmbedding", "DistributedLayerNorm", "DistributedLinear",
    "DistributedModule", "DistributedTransformer", "DistributedTransformerLMHead", "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer", "FlashAttentionLayer", "FusedLayerNorm",
]


class FusedLayerNorm(torch.nn.LayerNorm):
    """Stand-in for apex's FusedLayerNorm (same maths, PyTorch kernel)."""

