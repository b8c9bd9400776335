"""BLOOM (``BloomForCausalLM``) as pipeline layers.

BLOOM has no position embedding: every block adds ALiBi biases (a per-head slope times each
key's position among the unpadded tokens) to its attention scores, which ``BloomModel.forward``
builds once from the padding mask. A float tensor without gradient cannot cross a DeepSpeed
pipeline stage, so each block rebuilds the biases from the integer mask with the base model's own
``build_alibi_tensor``, and the causal mask with transformers' mask builder. Layers: token
embedding ``transformer.word_embeddings`` (a `TiedLayerSpec` pair with ``lm_head`` when tied, the
default) -> ``word_embeddings_layernorm`` -> each ``BloomBlock`` -> ``ln_f`` -> ``lm_head``.
Tensors between stages: ``(hidden_states, attention_mask)``. The cut is checked against the
model's own forward before training (`probe.check_equivalent`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp2ds.engine.integrations.transformers_compat import layer_hidden
from smp2ds.engine.pipeline.families.causal_lm import (
    CausalLMAdapter,
    FinalNorm,
    Head,
    TokenEmbedding,
    tied_head,
    tied_token_embedding,
)
from smp2ds.engine.pipeline.families.decoder_structure import NotADecoder
from smp2ds.engine.pipeline.families.hf_common import accepted, causal_mask
from smp2ds.engine.pipeline.families.probe import check_equivalent
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, UnsupportedModelError, tied

FAMILY = "transformers BloomForCausalLM"


def matches(model: nn.Module) -> bool:
    return type(model).__name__ == "BloomForCausalLM" and hasattr(model, "transformer")


class EmbeddingNorm(nn.Module):
    """``word_embeddings_layernorm`` on the token embeddings."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple) -> tuple:
        embeds, mask = inputs
        return self.norm(embeds), mask


class Block(nn.Module):
    """One ``BloomBlock``, with its ALiBi biases and causal mask rebuilt from the integer padding mask."""

    def __init__(self, block: nn.Module, base: nn.Module, config: Any):
        super().__init__()
        self.block = block
        self.config = config
        self.num_heads = base.num_heads
        self._base = [base]  # a list: the base model is not registered as a submodule of this stage

    def forward(self, inputs: tuple) -> tuple:
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor  # what BloomModel's method calls

        hidden, mask = inputs
        alibi = build_alibi_tensor(mask, self.num_heads, dtype=hidden.dtype)
        given = {"attention_mask": causal_mask(self.config, hidden, mask, owner=self._base[0]), "use_cache": False,
                 # releases before 4.50 size the keys from the cache positions
                 "cache_position": torch.arange(hidden.shape[1], device=hidden.device)}
        out = self.block(hidden, alibi=alibi, **accepted(self.block, given))
        return layer_hidden(out), mask


def layer_list(model: nn.Module) -> LayerList:
    """The BLOOM layer list, without the check against the model's forward."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    base, config, head = model.transformer, model.config, model.lm_head
    embed, norm = base.word_embeddings, base.word_embeddings_layernorm
    is_tied = head.weight is embed.weight
    key = "bloom_word_embeddings"
    first = EmbeddingNorm(norm)
    layers = [
        PipeLayer(name="transformer.word_embeddings", entry=tied(key, embed, tied_token_embedding) if is_tied
                  else TokenEmbedding(embed), modules=(embed,), owners=(embed,)),
        PipeLayer(name="transformer.word_embeddings_layernorm", entry=first, modules=(norm,), owners=(norm,)),
    ]
    layers += [PipeLayer(name=f"transformer.h.{i}", entry=Block(block, base, config), modules=(block,),
                         owners=(block,)) for i, block in enumerate(base.h)]
    layers.append(PipeLayer(name="transformer.ln_f", entry=FinalNorm(base.ln_f), modules=(base.ln_f,),
                            owners=(base.ln_f,)))
    layers.append(PipeLayer(name="lm_head", entry=tied(key, embed, tied_head) if is_tied else Head(head),
                            modules=(embed,) if is_tied else (head,), owners=(head,),
                            compute=2.0 * head.weight.numel()))
    return LayerList(family="BloomForCausalLM", layers=tuple(layers),
                     adapter=CausalLMAdapter(model, CausalLMOutputWithCrossAttentions), model=model)


def build(model: nn.Module) -> LayerList:
    built = layer_list(model)
    try:
        check_equivalent(model, built)
    except NotADecoder as exc:
        raise UnsupportedModelError(
            f"pipeline parallelism cannot split a {type(model).__module__}.{type(model).__name__}: its BLOOM layer "
            f"list does not reproduce its forward: {exc}") from None
    return built
