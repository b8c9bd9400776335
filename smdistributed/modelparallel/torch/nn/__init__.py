"""``smp.nn`` (re-exported from ``smp2ds.engine.nn``)."""

from smp2ds.engine.nn import *
from smp2ds.engine.nn import (  # noqa: F401
                              DistributedAttentionLayer,
                              DistributedEmbedding,
                              DistributedLayerNorm,
                              DistributedLinear,
                              DistributedModule,
                              DistributedTransformer,
                              DistributedTransformerLayer,
                              DistributedTransformerLMHead,
                              DistributedTransformerOutputLayer,
                              FlashAttentionLayer,
                              FusedLayerNorm,
)
