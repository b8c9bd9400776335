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

import torch
import torch.nn.functional as F
from torch import nn

from .hf_common import bind_call, check_call, finish, long_mask, positions
from .layers import LayerList, PipeLayer, tied

SUPPORTED_ARGS = ("input_ids", "attention_mask", "labels")


def matches(model: nn.Module) -> bool:
    return type(model).__name__ == "LlamaForCausalLM" and hasattr(model, "model")


def _token_embedding(shared: nn.Module, inputs: tuple) -> tuple:
    input_ids, mask = inputs
    return shared.module(input_ids), mask


def _tied_head(shared: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, shared.module.weight)


class TokenEmbedding(nn.Module):
    """``embed_tokens`` when the head is not tied."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed

    def forward(self, inputs: tuple) -> tuple:
        input_ids, mask = inputs
        return self.embed_tokens(input_ids), mask


class DecoderLayer(nn.Module):
    """One decoder layer plus the per-call inputs ``LlamaModel.forward`` prepares for it."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config

    def forward(self, inputs: tuple) -> tuple:
        from transformers.masking_utils import create_causal_mask

        hidden, mask = inputs
        pos = positions(hidden)
        causal = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask,
                                    past_key_values=None, position_ids=pos)
        rope = self.rotary_emb(hidden, position_ids=pos)
        hidden = self.layer(hidden, attention_mask=causal, position_embeddings=rope, position_ids=pos,
                            past_key_values=None, use_cache=False)
        return hidden, mask


class FinalNorm(nn.Module):
    """``model.norm``; drops the mask."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple) -> torch.Tensor:
        return self.norm(inputs[0])


class Head(nn.Module):
    """Untied ``lm_head``."""

    def __init__(self, lm_head: nn.Linear):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class LlamaAdapter:
    """``model(input_ids, attention_mask=..., labels=...)`` <-> pipeline tensors."""

    def __init__(self, model: nn.Module):
        self.model = model

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple:
        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        ids = bound["input_ids"]
        return ids, long_mask(bound.get("attention_mask"), ids)

    def make_output(self, logits: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        loss = None
        if bound.get("labels") is not None:
            loss = self.model.loss_function(logits=logits, labels=bound["labels"],
                                            vocab_size=self.model.config.vocab_size)
        return finish(CausalLMOutputWithPast(loss=loss, logits=logits), bound, self.model.config)


def build(model: nn.Module) -> LayerList:
    inner, config = model.model, model.config
    embed = inner.embed_tokens
    is_tied = model.lm_head.weight is embed.weight
    first = tied("llama_embed_tokens", embed, _token_embedding) if is_tied else TokenEmbedding(embed)
    last = tied("llama_embed_tokens", embed, _tied_head) if is_tied else Head(model.lm_head)
    layers = [PipeLayer(name="model.embed_tokens", entry=first, modules=(embed,), owners=(embed,))]
    layers += [PipeLayer(name=f"model.layers.{i}", entry=DecoderLayer(layer, inner.rotary_emb, config),
                         modules=(layer,), owners=(layer,))
               for i, layer in enumerate(inner.layers[: config.num_hidden_layers])]
    layers.append(PipeLayer(name="model.norm", entry=FinalNorm(inner.norm), modules=(inner.norm,),
                            owners=(inner.norm,)))
    layers.append(PipeLayer(name="lm_head", entry=last, modules=(embed,) if is_tied else (model.lm_head,),
                            owners=(model.lm_head,), compute=2.0 * model.lm_head.weight.numel()))
    return LayerList(family="LlamaForCausalLM", layers=tuple(layers), adapter=LlamaAdapter(model), model=model)
