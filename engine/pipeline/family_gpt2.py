"""GPT-2 (``GPT2LMHeadModel``) as pipeline layers.

Layers: token embedding ``transformer.wte`` -> position embedding + dropout -> each ``GPT2Block``
-> ``ln_f`` -> ``lm_head``. When ``lm_head`` shares its weight with ``wte`` (the default), both
ends are `TiedLayerSpec` entries with one key, so DeepSpeed keeps a copy on the first and the
last stage, broadcasts it once and all-reduces its gradient between the two stages every step.
Tensors between stages: ``(hidden_states, attention_mask)`` with an integer mask; the causal
mask is rebuilt inside each block with transformers' own ``create_causal_mask``.
Loss (last stage, when ``labels`` are given): the model's own ``loss_function`` (shifted
causal-LM cross entropy), exactly as ``GPT2LMHeadModel.forward`` computes it.
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
    return type(model).__name__ == "GPT2LMHeadModel" and hasattr(model, "transformer")


def _token_embedding(shared: nn.Module, inputs: tuple) -> tuple:
    input_ids, mask = inputs
    return shared.module(input_ids), mask


def _tied_head(shared: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, shared.module.weight)


class TokenEmbedding(nn.Module):
    """``wte`` lookup when the head is not tied."""

    def __init__(self, wte: nn.Embedding):
        super().__init__()
        self.wte = wte

    def forward(self, inputs: tuple) -> tuple:
        input_ids, mask = inputs
        return self.wte(input_ids), mask


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

    def __init__(self, block: nn.Module, config: Any):
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, inputs: tuple) -> tuple:
        from transformers.masking_utils import create_causal_mask

        hidden, mask = inputs
        pos = positions(hidden)
        causal = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask,
                                    past_key_values=None, position_ids=pos)
        hidden = self.block(hidden, None, causal, None, encoder_attention_mask=None, use_cache=False,
                            position_ids=pos)
        return hidden, mask


class FinalNorm(nn.Module):
    """``ln_f``; drops the mask, which no later layer needs."""

    def __init__(self, ln_f: nn.Module):
        super().__init__()
        self.ln_f = ln_f

    def forward(self, inputs: tuple) -> torch.Tensor:
        return self.ln_f(inputs[0])


class Head(nn.Module):
    """Untied ``lm_head``."""

    def __init__(self, lm_head: nn.Linear):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class GPT2Adapter:
    """``model(input_ids, attention_mask=..., labels=...)`` <-> pipeline tensors."""

    def __init__(self, model: nn.Module):
        self.model = model

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple:
        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        ids = bound["input_ids"]
        return ids, long_mask(bound.get("attention_mask"), ids)

    def make_output(self, logits: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        loss = None
        if bound.get("labels") is not None:
            loss = self.model.loss_function(logits, bound["labels"], vocab_size=self.model.config.vocab_size)
        return finish(CausalLMOutputWithCrossAttentions(loss=loss, logits=logits), bound, self.model.config)


def build(model: nn.Module) -> LayerList:
    t, config = model.transformer, model.config
    is_tied = model.lm_head.weight is t.wte.weight
    first = tied("gpt2_wte", t.wte, _token_embedding) if is_tied else TokenEmbedding(t.wte)
    last = tied("gpt2_wte", t.wte, _tied_head) if is_tied else Head(model.lm_head)
    head_modules = (t.wte,) if is_tied else (model.lm_head,)
    layers = [PipeLayer(name="transformer.wte", entry=first, modules=(t.wte,), owners=(t.wte,)),
              PipeLayer(name="transformer.wpe", entry=PositionEmbedding(t.wpe, t.drop), modules=(t.wpe, t.drop),
                        owners=(t.wpe, t.drop))]
    layers += [PipeLayer(name=f"transformer.h.{i}", entry=Block(block, config), modules=(block,), owners=(block,))
               for i, block in enumerate(t.h)]
    layers.append(PipeLayer(name="transformer.ln_f", entry=FinalNorm(t.ln_f), modules=(t.ln_f,), owners=(t.ln_f,)))
    layers.append(PipeLayer(name="lm_head", entry=last, modules=head_modules, owners=(model.lm_head,),
                            compute=2.0 * model.lm_head.weight.numel()))
    return LayerList(family="GPT2LMHeadModel", layers=tuple(layers), adapter=GPT2Adapter(model), model=model)
