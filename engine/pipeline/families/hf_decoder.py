"""Any Hugging Face decoder-only causal LM as pipeline layers, cut by its structure.

Layers: token embedding (+ the forward's embedding scaling, + embedding dropout) -> each block
of the base model's ``ModuleList`` -> final norm -> output projection (+ the forward's logit
scaling or soft-capping, `decoder_structure.OutsideOps`) (a `TiedLayerSpec` pair with the embedding when tied), found
by `decoder_structure.find_structure` from the module tree and the config, not from a per-family
list. Tensors between stages: ``(hidden_states, attention_mask)``, the mask as integers. What the
base model's ``forward`` prepares once before its block loop (position ids, the causal or
sliding-window mask per ``config.layer_types`` from transformers' ``masking_utils`` or, on releases
without it, the base model's own mask builder (`transformers_compat.legacy_causal_mask`), the rotary
cos/sin) is rebuilt on each stage from those two tensors, once per micro-batch (`StageInputs`):
the rotary embedding is a float tensor without gradient, which DeepSpeed's pipeline cannot send
between stages, and recomputing it is cheap.

Before the layer list is used, `probe.check_equivalent` runs it and the model's own forward on a
small padded batch: a model whose forward does anything the structure does not show is refused
by name (`NotADecoder`), as is a model whose structure does not fit; `build` then tries the
``torch.fx`` path, and refuses the model with both reasons when that fails too.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from smp2ds.engine.integrations.transformers_compat import layer_hidden
from smp2ds.engine.pipeline.families import traced
from smp2ds.engine.pipeline.families.causal_lm import (
    CausalLMAdapter,
    FinalNorm,
    Head,
    Ops,
    TokenEmbedding,
    apply_ops,
    scaled_tied_head,
    tied_head,
    tied_token_embedding,
)
from smp2ds.engine.pipeline.families.decoder_structure import (
    DecoderStructure,
    NotADecoder,
    find_structure,
    is_causal_lm,
)
from smp2ds.engine.pipeline.families.hf_common import causal_mask, positions, sliding_window_mask
from smp2ds.engine.pipeline.families.probe import check_equivalent
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, UnsupportedModelError, tied

FAMILY = "transformers *ForCausalLM decoders (embedding, ModuleList of blocks, final norm, head)"


def matches(model: nn.Module) -> bool:
    return is_causal_lm(model)


class StageInputs:
    """Position ids, masks by attention type and rotary cos/sin for one micro-batch on one stage.

    Every block wrapper of a model shares one instance; the blocks of a stage see the same mask
    tensor object, so the values are built by the stage's first block and reused by the rest.
    """

    def __init__(self, config: Any, kinds: frozenset[str], base: nn.Module):
        self.config, self.kinds = config, kinds
        self.base = base  # builds the masks on releases without masking_utils
        self._key: tuple | None = None
        self._value: tuple | None = None

    def get(self, hidden: torch.Tensor, mask: torch.Tensor, rotary: nn.Module | None) -> tuple:
        """``(position_ids, {attention type: mask}, rotary cos/sin or None)`` for this micro-batch."""
        key = (mask, mask._version, hidden.shape, hidden.dtype, hidden.device, rotary)
        if self._key is not None and self._key[0] is mask and self._key[1:] == key[1:]:
            return self._value
        pos = positions(hidden)
        builders = {"full_attention": causal_mask, "sliding_attention": sliding_window_mask}
        masks = {kind: builders[kind](self.config, hidden, mask, position_ids=pos, owner=self.base)
                 for kind in self.kinds}
        rope = None if rotary is None else rotary(hidden, position_ids=pos)
        self._key, self._value = key, (pos, masks, rope)  # holding the mask keeps its id from being reused
        return self._value


class EmbeddingScale(nn.Module):
    """What the base model's forward multiplies the token embeddings by (Granite, Gemma on 4.x)."""

    def __init__(self, ops: Ops):
        super().__init__()
        self.ops = ops

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        return apply_ops(hidden, self.ops), mask


class EmbeddingDropout(nn.Module):
    """The base model's dropout on the token embeddings (Phi, GPT-NeoX)."""

    def __init__(self, dropout: nn.Module):
        super().__init__()
        self.dropout = dropout

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        return self.dropout(hidden), mask


class Block(nn.Module):
    """One block, called with the per-call inputs the base model's forward prepares for it."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None, attention_type: str, shared: StageInputs,
                 args: frozenset[str]):
        super().__init__()
        self.block = block
        self.rotary_emb = rotary  # registered here so it moves with the stage (buffers only)
        self.attention_type, self.args = attention_type, args
        self.shared = shared  # a plain helper object, not a submodule

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        pos, masks, rope = self.shared.get(hidden, mask, self.rotary_emb)
        given = {"attention_mask": masks[self.attention_type], "position_ids": pos, "position_embeddings": rope,
                 "alibi": None, "use_cache": False, "cache": None, "past_key_values": None, "layer_past": None,
                 "output_attentions": False,
                 # the positions a cache-free forward passes (Gemma2's blocks before 4.53 size their window by it)
                 "cache_position": pos[0]}
        out = self.block(hidden, **{k: v for k, v in given.items() if k in self.args})
        return layer_hidden(out), mask


def layer_list(model: nn.Module, parts: DecoderStructure) -> LayerList:
    """The layer list for a model whose parts `find_structure` found."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base, embed, head = parts.base_path, parts.embed, parts.head
    key = f"{type(model).__name__}_{parts.embed_name}"
    first = tied(key, embed, tied_token_embedding) if parts.tied else TokenEmbedding(embed)
    layers = [PipeLayer(name=f"{base}.{parts.embed_name}", entry=first, modules=(embed,), owners=(embed,))]
    if parts.outside.embed:
        scale = EmbeddingScale(parts.outside.embed)
        layers.append(PipeLayer(name=f"{base}.{parts.embed_name}.scale", entry=scale, modules=(scale,),
                                owners=(embed,)))
    if parts.dropout is not None:
        drop = EmbeddingDropout(parts.dropout)
        layers.append(PipeLayer(name=f"{base}.{parts.dropout_name}", entry=drop, modules=(drop,), owners=(embed,)))
    shared = StageInputs(model.config, frozenset(parts.attention_types), parts.base)
    layers += [
        PipeLayer(name=f"{base}.{parts.blocks_name}.{i}",
                  entry=Block(block, parts.rotary, parts.attention_types[i], shared, parts.block_args),
                  modules=(block,), owners=(block,))
        for i, block in enumerate(parts.blocks)
    ]
    layers.append(PipeLayer(name=f"{base}.{parts.norm_name}", entry=FinalNorm(parts.norm), modules=(parts.norm,),
                            owners=(parts.norm,)))
    ops = parts.outside.logits
    if parts.tied:
        last = tied(key, embed, partial(scaled_tied_head, ops) if ops else tied_head)
    else:
        last = Head(head, ops)
    layers.append(PipeLayer(name=parts.head_name, entry=last, modules=(embed,) if parts.tied else (head,),
                            owners=(head,), compute=2.0 * head.weight.numel()))
    return LayerList(family=type(model).__name__, layers=tuple(layers),
                     adapter=CausalLMAdapter(model, CausalLMOutputWithPast), model=model)


def structural_layer_list(model: nn.Module) -> LayerList:
    """The structural layer list, checked against the model's forward; `NotADecoder` when it does not fit."""
    built = layer_list(model, find_structure(model))
    check_equivalent(model, built)
    return built


def build(model: nn.Module) -> LayerList:
    try:
        return structural_layer_list(model)
    except NotADecoder as exc:
        reason = str(exc)
    try:
        return traced.build(model)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"pipeline parallelism cannot split a {type(model).__module__}.{type(model).__name__}: it is not cut "
            f"as a decoder (embedding, ModuleList of blocks, final norm, head) because {reason}; and {exc}") from None
