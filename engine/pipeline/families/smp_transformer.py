"""SMP's ``smp.nn.DistributedTransformerLMHead`` as pipeline layers (also the Hugging Face GPT-2,
GPT-NeoX and GPT-J models SMP's transformer settings replace by it).

Layers: word embedding -> position embedding + embedding dropout -> each layer of
``transformer.seq_layers`` -> the stack's final ``layernorm`` (pre-layernorm models) -> LM head. A
head tied to the word embedding (the default) is a `TiedLayerSpec` pair, as in the GPT-2 family.
Tensors between stages: ``(hidden, masked)`` with ``masked`` SMP's 0/1 integer mask (1 = masked
key; zeros when the call gave none), turned into the additive mask inside each layer.

Under tensor parallelism the model is one tensor-parallel region when it runs whole; cut into
stages, every layer here is its own region (:func:`run_region`: the group's batches joined when
``prescaled_batch`` is false, its random stream), so every parameter still sees the group's
joined batch, as the engine's gradient bookkeeping expects for this module. The loss is the
module's own ``loss`` on the last stage, on this rank's rows, as in the unpipelined forward.
Refused here, by name: a split vocabulary (``distribute_embedding``), an LM-head bias (GPT-J),
token types and explicit position ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.region import run_region
from smp2ds.engine.nn.transformer import DistributedTransformerLMHead, unpack_lm_inputs
from smp2ds.engine.nn.transformer_layers import norm
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, UnsupportedModelError, tied

FAMILY = "smp.nn.DistributedTransformerLMHead"


def matches(model: nn.Module) -> bool:
    return isinstance(model, DistributedTransformerLMHead)


def _region(tp: TPGroup, fn: Callable[..., Any], *args: Any) -> Any:
    return run_region(tp, fn, args, {})


def _embed_tied(tp: TPGroup, shared: nn.Module, inputs: tuple) -> tuple:
    ids, masked = inputs
    return _region(tp, shared.module, ids), masked


def _head_tied(tp: TPGroup, shared: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return _region(tp, lambda h: F.linear(h, shared.module.weight), hidden)


class WordEmbedding(nn.Module):
    """The word embedding when the head is not tied to it."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.embedding, self.tp = embedding, tp

    def forward(self, inputs: tuple) -> tuple:
        ids, masked = inputs
        return _region(self.tp, self.embedding, ids), masked


class Positions(nn.Module):
    """Position embedding (when the model has one), embedding dropout and the fp32 residual stream."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.position_embedding, self.embedding_dropout = lm.position_embedding, lm.embedding_dropout
        self.fp32 = bool(lm.options.fp32_residual_addition)
        self.tp = lm.tp

    def forward(self, inputs: tuple) -> tuple:
        embeds, masked = inputs
        return _region(self.tp, self._forward, embeds), masked

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.position_embedding is not None:
            hidden = hidden + self.position_embedding(torch.arange(hidden.shape[1], device=hidden.device)[None])
        if self.fp32:
            hidden = hidden.float()
        return self.embedding_dropout(hidden)


class Layer(nn.Module):
    """One ``DistributedTransformerLayer`` with its additive mask built from the integer mask."""

    def __init__(self, layer: nn.Module, mask_value: float):
        super().__init__()
        self.layer, self.mask_value, self.tp = layer, mask_value, layer.tp

    def forward(self, inputs: tuple) -> tuple:
        hidden, masked = inputs
        return _region(self.tp, self._forward, hidden, masked)

    def _forward(self, hidden: torch.Tensor, masked: torch.Tensor) -> tuple:
        additive = (masked.to(hidden.dtype) * self.mask_value)[:, None, None, :]
        return self.layer((hidden, additive))[0], masked


class FinalNorm(nn.Module):
    """The stack's closing layer norm (pre-layernorm models); drops the mask."""

    def __init__(self, layernorm: nn.Module | None, tp: TPGroup):
        super().__init__()
        self.layernorm, self.tp = layernorm, tp

    def forward(self, inputs: tuple) -> torch.Tensor:
        hidden = inputs[0]
        return hidden if self.layernorm is None else _region(self.tp, lambda h: norm(self.layernorm, h), hidden)


class Head(nn.Module):
    """An LM head of its own (``tie_input_output_embedding=False``)."""

    def __init__(self, lm_head: nn.Linear, tp: TPGroup):
        super().__init__()
        self.lm_head, self.tp = lm_head, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _region(self.tp, self.lm_head, hidden)


class Adapter:
    """The model's call (SMP's tuple, or the Hugging Face call a replaced model keeps) <-> pipeline tensors."""

    def __init__(self, model: nn.Module):
        self.model = model

    def _unpacked(self, args: tuple, kwargs: dict) -> tuple:
        hook = getattr(self.model, "_smp2ds_forward_hook", None)
        if hook is not None:
            args, kwargs = hook(*args, **kwargs)
        if kwargs or len(args) != 1:
            raise UnsupportedModelError(f"pipelined {FAMILY} takes one argument, (input_ids, attention_mask, "
                                        f"token_type_ids, position_ids, labels); got {len(args)} and {sorted(kwargs)}")
        ids, mask, token_types, positions, labels = unpack_lm_inputs(args[0])
        if token_types is not None or positions is not None:
            raise UnsupportedModelError(f"pipelined {FAMILY} does not take token_type_ids or position_ids (positions "
                                        "are 0..S-1); pass None")
        return ids, mask, labels

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple:
        ids, mask, _ = self._unpacked(args, kwargs)
        return ids, (torch.zeros_like(ids, dtype=torch.long) if mask is None else mask.to(torch.long))

    def make_output(self, logits: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        _, _, labels = self._unpacked(args, kwargs)
        out = logits if labels is None else (self.model.loss(logits, labels), logits)
        back = getattr(self.model, "_smp2ds_return_hook", None)
        return out if back is None else back(out)


def _refuse(model: nn.Module) -> None:
    reasons = []
    if getattr(model, "vocab_parallel", False):
        reasons.append("a vocabulary split over tensor-parallel ranks (distribute_embedding=True)")
    if model.lm_head_bias is not None:
        reasons.append("an LM-head bias (use_lm_head_bias, GPT-J)")
    if not model.add_lm_head:
        reasons.append("no LM head (add_lm_head=False)")
    if model.token_type_embedding is not None:
        reasons.append("token-type embeddings")
    if reasons:
        raise UnsupportedModelError(f"pipelining {FAMILY} with {', '.join(reasons)} is not implemented; use "
                                    "pipeline_parallel_degree 1 for this model")


def build(model: nn.Module) -> LayerList:
    _refuse(model)
    words, stack, tp = model.word_embedding, model.transformer, model.tp  # the group the model was built over
    is_tied = model.lm_head is None
    first = tied("smp_word_embedding", words, functools.partial(_embed_tied, tp)) if is_tied else \
        WordEmbedding(words, tp)
    last = tied("smp_word_embedding", words, functools.partial(_head_tied, tp)) if is_tied else \
        Head(model.lm_head, tp)
    head_module = words if is_tied else model.lm_head
    prefix = [m for m in (model.position_embedding, model.embedding_dropout) if m is not None]
    layers = [
        PipeLayer(name="word_embedding", entry=first, modules=(words,), owners=(words,)),
        PipeLayer(name="position_embedding", entry=Positions(model), modules=tuple(prefix), owners=tuple(prefix)),
    ]
    layers += [
        PipeLayer(name=f"transformer.seq_layers.{i}", entry=Layer(layer, model.options.mask_value),
                  modules=(layer,), owners=(layer,))
        for i, layer in enumerate(stack.seq_layers)
    ]
    norm = stack.layernorm
    layers.append(PipeLayer(name="transformer.layernorm", entry=FinalNorm(norm, tp), modules=(norm,) if norm else (),
                            owners=(norm,) if norm else (stack,)))
    layers.append(PipeLayer(name="lm_head", entry=last, modules=(head_module,), owners=(head_module,),
                            compute=2.0 * head_module.weight.numel()))
    return LayerList(family=FAMILY, layers=tuple(layers), adapter=Adapter(model), model=model)
