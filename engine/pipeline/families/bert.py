"""BERT (``BertForSequenceClassification``, ``BertForQuestionAnswering``, ``BertForMaskedLM``) as pipeline
layers.

Sequence classification: ``bert.embeddings`` -> each ``BertLayer`` -> pooler + dropout +
classifier. Question answering: the same embeddings and layers -> ``qa_outputs`` on every token, whose two
channels the adapter splits into start and end logits. Masked LM: the word embedding is tied to
``cls.predictions.decoder``, so the first layer is the tied word-embedding lookup, then the rest of the
embeddings (token type + position, LayerNorm, dropout, in ``BertEmbeddings``' order), the encoder layers, the
prediction-head transform, the tied decoder matmul and the decoder bias.
Tensors between stages: ``(hidden, attention_mask, token_type_ids)`` before the embeddings are
complete, ``(hidden, attention_mask)`` after; masks are integers and each layer rebuilds the 4-D
mask with transformers' own mask builder. Losses follow the models' ``forward`` exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp2ds.engine.integrations.transformers_compat import layer_hidden
from smp2ds.engine.pipeline.families.causal_lm import Head
from smp2ds.engine.pipeline.families.hf_common import (
    bidirectional_mask,
    bind_call,
    causal_mask,
    check_call,
    finish,
    long_mask,
    positions,
)
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, tied

SUPPORTED_ARGS = ("input_ids", "attention_mask", "token_type_ids", "labels", "start_positions", "end_positions")
FAMILIES = ("BertForSequenceClassification", "BertForQuestionAnswering", "BertForMaskedLM")


def matches(model: nn.Module) -> bool:
    return type(model).__name__ in FAMILIES and hasattr(model, "bert")


def _attention_mask(config: Any, hidden: torch.Tensor, mask: torch.Tensor) -> Any:
    if config.is_decoder:
        return causal_mask(config, hidden, mask)
    return bidirectional_mask(config, hidden, mask)


class Embeddings(nn.Module):
    """The whole ``BertEmbeddings`` (untied case), run through its own ``forward``."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, inputs: tuple) -> tuple:
        input_ids, mask, token_type_ids = inputs
        return self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids), mask


def word_embedding(shared: nn.Module, inputs: tuple) -> tuple:
    """The tied word lookup of the first stage; the other inputs (mask, token types, positions) pass through."""
    input_ids, *others = inputs
    return (shared.module(input_ids), *others)


class EmbeddingRest(nn.Module):
    """``BertEmbeddings`` (or ``RobertaEmbeddings``) after the word lookup: + token type, + position, LayerNorm,
    dropout. Position ids come with the inputs when the family computes them from the tokens (RoBERTa), else
    they count from 0."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.token_type_embeddings = embeddings.token_type_embeddings
        self.position_embeddings = embeddings.position_embeddings
        self.LayerNorm = embeddings.LayerNorm
        self.dropout = embeddings.dropout

    def forward(self, inputs: tuple) -> tuple:
        embeds, mask, token_type_ids, *given = inputs
        position_ids = given[0] if given else positions(embeds)
        # Same additions in the same order as the embeddings' forward (float sums are order-sensitive).
        hidden = embeds + self.token_type_embeddings(token_type_ids)
        hidden = hidden + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(hidden)), mask


class Layer(nn.Module):
    """One ``BertLayer`` with its attention mask built from the integer padding mask."""

    def __init__(self, layer: nn.Module, config: Any):
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        return layer_hidden(self.layer(hidden, _attention_mask(self.config, hidden, mask))), mask


class ClassifierHead(nn.Module):
    """Pooler (first token, dense, tanh) -> dropout -> classifier, as the model's forward."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module):
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, inputs: tuple) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(inputs[0])))


class OnHidden(nn.Module):
    """A head module applied to every token's hidden state, dropping the mask: ``cls.predictions.transform``
    (dense, activation, LayerNorm) or ``qa_outputs`` (two channels: span start and end)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, inputs: tuple) -> torch.Tensor:
        return self.head(inputs[0])


def _tied_decoder(shared: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, shared.module.weight)


class DecoderBias(nn.Module):
    """The decoder's output bias (a parameter shared by ``cls.predictions`` and its decoder)."""

    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.bias = bias

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.bias


class BertAdapter:
    """``model(input_ids, attention_mask=..., token_type_ids=..., labels=...)`` <-> pipeline tensors."""

    def __init__(self, model: nn.Module):
        self.model = model

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple:
        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        ids = bound["input_ids"]
        tt = bound.get("token_type_ids")
        # BertEmbeddings' default token types are its all-zero buffer.
        tt = torch.zeros_like(ids, dtype=torch.long) if tt is None else tt.to(torch.long)
        return ids, long_mask(bound.get("attention_mask"), ids), tt

    def make_output(self, logits: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        labels = bound.get("labels")
        head = type(self.model).__name__  # BERT's or RoBERTa's (same heads, same losses)
        if head.endswith("ForMaskedLM"):
            from transformers.modeling_outputs import MaskedLMOutput

            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits.view(-1, self.model.config.vocab_size),
                                       labels.to(logits.device).view(-1))
            return finish(MaskedLMOutput(loss=loss, logits=logits), bound, self.model.config)
        if head.endswith("ForQuestionAnswering"):
            return finish(_span_output(logits, bound), bound, self.model.config)
        from transformers.modeling_outputs import SequenceClassifierOutput

        loss = None if labels is None else _classification_loss(self.model, logits, labels.to(logits.device))
        return finish(SequenceClassifierOutput(loss=loss, logits=logits), bound, self.model.config)


def _span_output(logits: torch.Tensor, bound: dict[str, Any]) -> Any:
    """``BertForQuestionAnswering``'s output: start and end logits, and with both positions given its loss (the
    mean of the two cross-entropies, positions outside the sequence clamped to an ignored index)."""
    from transformers.modeling_outputs import QuestionAnsweringModelOutput

    start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
    start, end = bound.get("start_positions"), bound.get("end_positions")
    loss = None
    if start is not None and end is not None:
        ignored = start_logits.size(1)
        start = start.to(logits.device).reshape(-1).clamp(0, ignored)
        end = end.to(logits.device).reshape(-1).clamp(0, ignored)
        loss = (F.cross_entropy(start_logits, start, ignore_index=ignored)
                + F.cross_entropy(end_logits, end, ignore_index=ignored)) / 2
    return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)


def _classification_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``BertForSequenceClassification``'s loss, including its ``problem_type`` inference."""
    config, n = model.config, model.num_labels
    if config.problem_type is None:
        if n == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze()) if n == 1 else F.mse_loss(logits, labels)
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, n), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels)


def build(model: nn.Module) -> LayerList:
    bert, config = model.bert, model.config
    emb = bert.embeddings
    layers: list[PipeLayer] = []
    is_mlm = type(model).__name__ == "BertForMaskedLM"
    decoder = model.cls.predictions.decoder if is_mlm else None
    is_tied = is_mlm and decoder.weight is emb.word_embeddings.weight
    if is_tied:
        rest = EmbeddingRest(emb)
        layers.append(PipeLayer(name="bert.embeddings.word_embeddings",
                                entry=tied("bert_word_embeddings", emb.word_embeddings, word_embedding),
                                modules=(emb.word_embeddings,), owners=(emb.word_embeddings,)))
        layers.append(PipeLayer(name="bert.embeddings", entry=rest, modules=(rest,), owners=(emb,)))
    else:
        layers.append(PipeLayer(name="bert.embeddings", entry=Embeddings(emb), modules=(emb,), owners=(emb,)))
    layers += [PipeLayer(name=f"bert.encoder.layer.{i}", entry=Layer(layer, config), modules=(layer,),
                         owners=(layer,)) for i, layer in enumerate(bert.encoder.layer)]
    if type(model).__name__ == "BertForQuestionAnswering":
        span = OnHidden(model.qa_outputs)
        layers.append(PipeLayer(name="qa_outputs", entry=span, modules=(span,), owners=(model.qa_outputs,)))
        return LayerList(family=type(model).__name__, layers=tuple(layers), adapter=BertAdapter(model), model=model)
    if not is_mlm:
        head = ClassifierHead(bert.pooler, model.dropout, model.classifier)
        layers.append(PipeLayer(name="bert.pooler+classifier", entry=head, modules=(head,),
                                owners=(bert.pooler, model.classifier)))
        return LayerList(family=type(model).__name__, layers=tuple(layers), adapter=BertAdapter(model), model=model)
    pred = model.cls.predictions
    layers.append(PipeLayer(name="cls.predictions.transform", entry=OnHidden(pred.transform),
                            modules=(pred.transform,), owners=(pred.transform,)))
    if is_tied:
        bias = DecoderBias(decoder.bias)
        layers.append(PipeLayer(name="cls.predictions.decoder",
                                entry=tied("bert_word_embeddings", emb.word_embeddings, _tied_decoder),
                                modules=(emb.word_embeddings,), owners=(decoder,),
                                compute=2.0 * decoder.weight.numel()))
        layers.append(PipeLayer(name="cls.predictions.bias", entry=bias, modules=(bias,), owners=(decoder,)))
    else:
        layers.append(PipeLayer(name="cls.predictions.decoder", entry=Head(decoder), modules=(decoder,),
                                owners=(decoder,)))
    return LayerList(family=type(model).__name__, layers=tuple(layers), adapter=BertAdapter(model), model=model)
