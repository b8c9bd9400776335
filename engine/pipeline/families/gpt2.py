"""GPT-2 (``GPT2LMHeadModel``) as pipeline layers.

Layers: token embedding ``transformer.wte`` -> position embedding + dropout -> each ``GPT2Block``
-> ``ln_f`` -> ``lm_head``. When ``lm_head`` shares its weight with ``wte`` (the default), both
ends are `TiedLayerSpec` entries with one key, so DeepSpeed keeps a copy on the first and the
last stage, broadcasts it once and all-reduces its gradient between the two stages every step.
Tensors between stages: ``(hidden_states, attention_mask)`` with an integer mask; the causal
mask is rebuilt inside each block with transformers' own ``create_causal_mask`` (on releases without
``masking_utils``, the mask ``GPT2Model.forward`` builds there: `transformers_compat.legacy_causal_mask`).
Loss (last stage, when ``labels`` are given): the model's own ``loss_function`` (shifted
causal-LM cross entropy), exactly as ``GPT2LMHeadModel.forward`` computes it.
"""

from __future__ import annotations

from typing import Any

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
from smp2ds.engine.pipeline.families.hf_common import accepted, causal_mask, positions
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, tied


def matches(model: nn.Module) -> bool:
    return type(model).__name__ == "GPT2LMHeadModel" and hasattr(model, "transformer")


class PositionEmbedding(nn.Module):
    """``inputs_embeds + wpe(position_ids)``, then dropout, as ``GPT2Model.forward``."""

    def __init__(self, wpe: nn.Embedding, drop: nn.Dropout):
        super().__init__()
        self.wpe, self.drop = wpe, drop

    def forward(self, inputs: tuple) -> tuple:
        embeds, mask = inputs
        hidden = embeds + self.wpe(positions(embeds)).to(embeds.device)
        return self.drop(hidden), mask


class Block(nn.Module):
    """One ``GPT2Block`` with its causal mask built from the integer padding mask."""

    def __init__(self, block: nn.Module, config: Any, base: nn.Module):
        super().__init__()
        self.block = block
        self.config = config
        self._base = [base]  # a list: the base model is not registered as a submodule of this stage

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        pos = positions(hidden)
        causal = causal_mask(self.config, hidden, mask, position_ids=pos, owner=self._base[0])
        given = {"attention_mask": causal, "encoder_attention_mask": None, "use_cache": False, "position_ids": pos}
        out = self.block(hidden, **accepted(self.block, given))
        return layer_hidden(out), mask


def build(model: nn.Module) -> LayerList:
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    t, config = model.transformer, model.config
    is_tied = model.lm_head.weight is t.wte.weight
    first = tied("gpt2_wte", t.wte, tied_token_embedding) if is_tied else TokenEmbedding(t.wte)
    last = tied("gpt2_wte", t.wte, tied_head) if is_tied else Head(model.lm_head)
    head_modules = (t.wte,) if is_tied else (model.lm_head,)
    layers = [
        PipeLayer(name="transformer.wte", entry=first, modules=(t.wte,), owners=(t.wte,)),
        PipeLayer(
            name="transformer.wpe",
            entry=PositionEmbedding(t.wpe, t.drop),
            modules=(t.wpe, t.drop),
            owners=(t.wpe, t.drop),
        ),
    ]
    layers += [
        PipeLayer(name=f"transformer.h.{i}", entry=Block(block, config, t), modules=(block,), owners=(block,))
        for i, block in enumerate(t.h)
    ]
    layers.append(PipeLayer(name="transformer.ln_f", entry=FinalNorm(t.ln_f), modules=(t.ln_f,), owners=(t.ln_f,)))
    layers.append(
        PipeLayer(
            name="lm_head",
            entry=last,
            modules=head_modules,
            owners=(model.lm_head,),
            compute=2.0 * model.lm_head.weight.numel(),
        )
    )
    return LayerList(
        family="GPT2LMHeadModel",
        layers=tuple(layers),
        adapter=CausalLMAdapter(model, CausalLMOutputWithCrossAttentions),
        model=model,
    )
