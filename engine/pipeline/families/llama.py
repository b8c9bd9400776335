"""LLaMA (``LlamaForCausalLM``) as pipeline layers.

Layers: ``model.embed_tokens`` -> each ``LlamaDecoderLayer`` -> ``model.norm`` -> ``lm_head``
(a `TiedLayerSpec` pair with the embedding when ``tie_word_embeddings`` ties them).
Tensors between stages: ``(hidden_states, attention_mask)``, the mask as integers. Decoder
layers in transformers 5 take ``position_embeddings`` (the rotary cos/sin) from the model, so
each layer wrapper holds the model's ``rotary_emb`` (buffers only) and computes position ids,
the causal mask (``create_causal_mask``) and the rotary embedding itself, exactly as
``LlamaModel.forward`` does before its layer loop.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from smp2ds.engine.pipeline.families.causal_lm import (
    CausalLMAdapter,
    FinalNorm,
    Head,
    TokenEmbedding,
    tied_head,
    tied_token_embedding,
)
from smp2ds.engine.pipeline.families.hf_common import causal_mask, positions
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, tied


def matches(model: nn.Module) -> bool:
    return type(model).__name__ == "LlamaForCausalLM" and hasattr(model, "model")


class DecoderLayer(nn.Module):
    """One decoder layer plus the per-call inputs ``LlamaModel.forward`` prepares for it."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        pos = positions(hidden)
        causal = causal_mask(self.config, hidden, mask, position_ids=pos)
        rope = self.rotary_emb(hidden, position_ids=pos)
        hidden = self.layer(
            hidden,
            attention_mask=causal,
            position_embeddings=rope,
            position_ids=pos,
            past_key_values=None,
            use_cache=False,
        )
        return hidden, mask


def build(model: nn.Module) -> LayerList:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    inner, config = model.model, model.config
    embed = inner.embed_tokens
    is_tied = model.lm_head.weight is embed.weight
    first = tied("llama_embed_tokens", embed, tied_token_embedding) if is_tied else TokenEmbedding(embed)
    last = tied("llama_embed_tokens", embed, tied_head) if is_tied else Head(model.lm_head)
    layers = [PipeLayer(name="model.embed_tokens", entry=first, modules=(embed,), owners=(embed,))]
    layers += [
        PipeLayer(
            name=f"model.layers.{i}",
            entry=DecoderLayer(layer, inner.rotary_emb, config),
            modules=(layer,),
            owners=(layer,),
        )
        for i, layer in enumerate(inner.layers[: config.num_hidden_layers])
    ]
    layers.append(
        PipeLayer(name="model.norm", entry=FinalNorm(inner.norm), modules=(inner.norm,), owners=(inner.norm,))
    )
    layers.append(
        PipeLayer(
            name="lm_head",
            entry=last,
            modules=(embed,) if is_tied else (model.lm_head,),
            owners=(model.lm_head,),
            compute=2.0 * model.lm_head.weight.numel(),
        )
    )
    return LayerList(
        family="LlamaForCausalLM",
        layers=tuple(layers),
        adapter=CausalLMAdapter(model, CausalLMOutputWithPast),
        model=model,
    )
