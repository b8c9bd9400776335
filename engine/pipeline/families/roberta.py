"""RoBERTa (``RobertaForSequenceClassification``, ``RobertaForQuestionAnswering``, ``RobertaForMaskedLM``) as
pipeline layers, on BERT's machinery (`bert`).

RoBERTa is BERT with other heads and other positions: position ids count the non-padding tokens
of ``input_ids`` from ``padding_idx + 1`` (padding tokens keep ``padding_idx``), so the adapter
computes them once from the token ids, as ``RobertaEmbeddings`` does, and they travel with the
token type ids until the embeddings are complete: ``(ids or embeddings, attention_mask,
token_type_ids, position_ids)``, then ``(hidden, attention_mask)``. Encoder layers are BERT's
`bert.Layer`. Heads: ``classifier`` (``RobertaClassificationHead``: first token, dropout, dense,
tanh, dropout, projection) or ``qa_outputs`` on every token's hidden state; for the masked LM
``lm_head``'s dense + GELU + LayerNorm, then its decoder (tied to the word embedding across the
first and last stage when the model ties them) and the decoder bias. Losses are BERT's, which
are RoBERTa's.
"""

from __future__ import annotations

import torch
from torch import nn

from smp2ds.engine.pipeline.families.bert import (
    BertAdapter,
    DecoderBias,
    EmbeddingRest,
    Layer,
    OnHidden,
    _tied_decoder,
    word_embedding,
)
from smp2ds.engine.pipeline.families.causal_lm import Head
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, tied

FAMILIES = ("RobertaForSequenceClassification", "RobertaForQuestionAnswering", "RobertaForMaskedLM")
FAMILY = "transformers " + " / ".join(FAMILIES)


def matches(model: nn.Module) -> bool:
    return type(model).__name__ in FAMILIES and hasattr(model, "roberta")


def roberta_positions(input_ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """``RobertaEmbeddings``' position ids for a cache-free call (same casts, so the same values)."""
    mask = input_ids.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


class Embeddings(nn.Module):
    """The whole ``RobertaEmbeddings`` (untied case), run through its own ``forward``."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, inputs: tuple) -> tuple:
        input_ids, mask, token_type_ids, position_ids = inputs
        return self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids), mask


class LMHeadTransform(nn.Module):
    """``RobertaLMHead`` before its decoder: dense, GELU, LayerNorm; drops the mask."""

    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.dense, self.layer_norm = lm_head.dense, lm_head.layer_norm

    def forward(self, inputs: tuple) -> torch.Tensor:
        from transformers.activations import gelu

        return self.layer_norm(gelu(self.dense(inputs[0])))


class RobertaAdapter(BertAdapter):
    """BERT's adapter, with RoBERTa's position ids computed from the token ids on the first stage."""

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple:
        ids, mask, token_type_ids = super().pipe_inputs(args, kwargs)
        return ids, mask, token_type_ids, roberta_positions(ids, self.model.roberta.embeddings.padding_idx)


def _embedding_layers(model: nn.Module, is_tied: bool) -> list[PipeLayer]:
    emb = model.roberta.embeddings
    if not is_tied:
        return [PipeLayer(name="roberta.embeddings", entry=Embeddings(emb), modules=(emb,), owners=(emb,))]
    rest = EmbeddingRest(emb)
    return [PipeLayer(name="roberta.embeddings.word_embeddings",
                      entry=tied("roberta_word_embeddings", emb.word_embeddings, word_embedding),
                      modules=(emb.word_embeddings,), owners=(emb.word_embeddings,)),
            PipeLayer(name="roberta.embeddings", entry=rest, modules=(rest,), owners=(emb,))]


def _mlm_head(model: nn.Module, is_tied: bool) -> list[PipeLayer]:
    lm_head, word = model.lm_head, model.roberta.embeddings.word_embeddings
    decoder = lm_head.decoder
    transform = LMHeadTransform(lm_head)
    layers = [PipeLayer(name="lm_head.dense+layer_norm", entry=transform, modules=(transform,),
                        owners=(lm_head.dense, lm_head.layer_norm))]
    if not is_tied:
        return [*layers, PipeLayer(name="lm_head.decoder", entry=Head(decoder), modules=(decoder,), owners=(decoder,))]
    bias = DecoderBias(decoder.bias)
    return [*layers,
            PipeLayer(name="lm_head.decoder", entry=tied("roberta_word_embeddings", word, _tied_decoder),
                      modules=(word,), owners=(decoder,), compute=2.0 * decoder.weight.numel()),
            PipeLayer(name="lm_head.bias", entry=bias, modules=(bias,), owners=(decoder,))]


def build(model: nn.Module) -> LayerList:
    name, config = type(model).__name__, model.config
    is_mlm = name == "RobertaForMaskedLM"
    is_tied = is_mlm and model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    layers = _embedding_layers(model, is_tied)
    layers += [PipeLayer(name=f"roberta.encoder.layer.{i}", entry=Layer(layer, config), modules=(layer,),
                         owners=(layer,)) for i, layer in enumerate(model.roberta.encoder.layer)]
    if is_mlm:
        layers += _mlm_head(model, is_tied)
    else:
        head = model.qa_outputs if name == "RobertaForQuestionAnswering" else model.classifier
        entry = OnHidden(head)
        layers.append(PipeLayer(name="qa_outputs" if head is getattr(model, "qa_outputs", None) else "classifier",
                                entry=entry, modules=(entry,), owners=(head,)))
    return LayerList(family=name, layers=tuple(layers), adapter=RobertaAdapter(model), model=model)
