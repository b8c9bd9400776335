"""OPT (``OPTForCausalLM``) as pipeline layers.

OPT's base model nests an ``OPTDecoder`` and adds learned positions computed from the padding
mask (``cumsum(mask) * mask - 1``, looked up at an offset of 2), so the structural cut of
``hf_decoder`` does not fit it. Layers: token embedding ``model.decoder.embed_tokens`` (a
`TiedLayerSpec` pair with ``lm_head`` when tied, the default) -> ``project_in`` (when
``word_embed_proj_dim`` differs from ``hidden_size``) plus the positional embedding -> each
``OPTDecoderLayer`` (pre- or post-norm per ``do_layer_norm_before``, inside the layer) ->
``final_layer_norm`` (absent for post-norm models) and ``project_out`` -> ``lm_head``.
Tensors between stages: ``(hidden_states, attention_mask)`` with an integer mask; each block
rebuilds the causal mask and OPT's position ids from it. The cut is checked against the model's
own forward before training (`probe.check_equivalent`); ``layerdrop`` > 0 (blocks skipped at
random in training) is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp2ds.engine.integrations.transformers_compat import layer_hidden
from smp2ds.engine.pipeline.families.causal_lm import (
    CausalLMAdapter,
    Head,
    TokenEmbedding,
    tied_head,
    tied_token_embedding,
)
from smp2ds.engine.pipeline.families.decoder_structure import NotADecoder
from smp2ds.engine.pipeline.families.hf_common import accepted, causal_mask
from smp2ds.engine.pipeline.families.probe import check_equivalent
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, UnsupportedModelError, tied

FAMILY = "transformers OPTForCausalLM"


def matches(model: nn.Module) -> bool:
    return type(model).__name__ == "OPTForCausalLM" and hasattr(getattr(model, "model", None), "decoder")


def opt_positions(mask: torch.Tensor) -> torch.Tensor:
    """``OPTDecoder``'s position ids for a cache-free call: 0, 1, ... over the unpadded tokens, -1 on padding."""
    position_ids = torch.cumsum(mask, dim=1)
    return (position_ids * mask - 1).long()


class Positions(nn.Module):
    """``project_in`` (if any) of the token embeddings plus the learned positional embedding."""

    def __init__(self, embed_positions: nn.Embedding, project_in: nn.Module | None):
        super().__init__()
        self.embed_positions, self.project_in = embed_positions, project_in

    def forward(self, inputs: tuple) -> tuple:
        embeds, mask = inputs
        # releases before 4.50 compute the same position ids inside the embedding (no position_ids argument)
        position_ids = accepted(self.embed_positions, {"position_ids": opt_positions(mask)})
        pos_embeds = self.embed_positions(mask, 0, **position_ids)
        if self.project_in is not None:
            embeds = self.project_in(embeds)
        return embeds + pos_embeds.to(embeds.device), mask


class Block(nn.Module):
    """One ``OPTDecoderLayer`` with its causal mask and position ids rebuilt from the integer padding mask."""

    def __init__(self, block: nn.Module, config: Any, decoder: nn.Module):
        super().__init__()
        self.block = block
        self.config = config
        self._decoder = [decoder]  # a list: the decoder is not registered as a submodule of this stage

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        causal = causal_mask(self.config, hidden, mask, owner=self._decoder[0])
        given = {"attention_mask": causal, "position_ids": opt_positions(mask), "use_cache": False}
        out = self.block(hidden, **accepted(self.block, given))
        return layer_hidden(out), mask


class Finish(nn.Module):
    """``final_layer_norm`` and ``project_out``, each when the model has it; drops the mask."""

    def __init__(self, norm: nn.Module | None, project_out: nn.Module | None):
        super().__init__()
        self.norm, self.project_out = norm, project_out

    def forward(self, inputs: tuple) -> torch.Tensor:
        hidden = inputs[0]
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


def _present(*modules: nn.Module | None) -> tuple[nn.Module, ...]:
    return tuple(m for m in modules if m is not None)


def layer_list(model: nn.Module) -> LayerList:
    """The OPT layer list, without the check against the model's forward."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    decoder, config, head = model.model.decoder, model.config, model.lm_head
    embed = decoder.embed_tokens
    is_tied = head.weight is embed.weight
    key = "opt_embed_tokens"
    pos = Positions(decoder.embed_positions, decoder.project_in)
    layers = [
        PipeLayer(name="model.decoder.embed_tokens", entry=tied(key, embed, tied_token_embedding) if is_tied
                  else TokenEmbedding(embed), modules=(embed,), owners=(embed,)),
        PipeLayer(name="model.decoder.embed_positions", entry=pos, modules=(pos,),
                  owners=_present(decoder.embed_positions, decoder.project_in)),
    ]
    layers += [PipeLayer(name=f"model.decoder.layers.{i}", entry=Block(block, config, decoder), modules=(block,),
                         owners=(block,)) for i, block in enumerate(decoder.layers)]
    finish = Finish(decoder.final_layer_norm, decoder.project_out)
    tail = _present(decoder.final_layer_norm, decoder.project_out)
    name = "model.decoder.final_layer_norm" if decoder.final_layer_norm is not None else "model.decoder.project_out"
    layers.append(PipeLayer(name=name, entry=finish, modules=(finish,), owners=tail or (decoder.layers[-1],)))
    layers.append(PipeLayer(name="lm_head", entry=tied(key, embed, tied_head) if is_tied else Head(head),
                            modules=(embed,) if is_tied else (head,), owners=(head,),
                            compute=2.0 * head.weight.numel()))
    return LayerList(family="OPTForCausalLM", layers=tuple(layers),
                     adapter=CausalLMAdapter(model, CausalLMOutputWithPast), model=model)


def build(model: nn.Module) -> LayerList:
    prefix = f"pipeline parallelism cannot split a {type(model).__module__}.{type(model).__name__}"
    if getattr(model.config, "layerdrop", 0.0):
        raise UnsupportedModelError(f"{prefix}: config.layerdrop={model.config.layerdrop} skips blocks at random "
                                    "in training, which a pipeline with fixed stages cannot do; set layerdrop=0")
    built = layer_list(model)
    try:
        check_equivalent(model, built)
    except NotADecoder as exc:
        raise UnsupportedModelError(f"{prefix}: its OPT layer list does not reproduce its forward: {exc}") from None
    return built
