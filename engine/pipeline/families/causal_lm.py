"""Pipeline pieces shared by the causal-LM families (GPT-2, the structural decoders of ``hf_decoder``).

Both start with a token embedding and end with a final norm and an LM head that is either tied
to the embedding (a `TiedLayerSpec` pair, see `layers.tied`) or a plain linear layer. Between
stages they pass ``(hidden_states, attention_mask)`` with the mask as integers. The adapter turns
``model(input_ids, attention_mask=..., labels=...)`` into pipeline tensors and the last stage's
logits back into the model's own output class, with the loss computed by the model's own
``loss_function`` (shifted causal-LM cross entropy), as its ``forward`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp2ds.engine.integrations.transformers_compat import causal_lm_loss
from smp2ds.engine.pipeline.families.hf_common import bind_call, check_call, finish, long_mask

SUPPORTED_ARGS = ("input_ids", "attention_mask", "labels")


def tied_token_embedding(shared: nn.Module, inputs: tuple) -> tuple:
    """Forward of the tied embedding on the first stage."""
    input_ids, mask = inputs
    return shared.module(input_ids), mask


def tied_head(shared: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Forward of the tied embedding as the LM head on the last stage."""
    return F.linear(hidden, shared.module.weight)


Ops = tuple[tuple[str, float], ...]


def apply_ops(x: torch.Tensor, ops: Ops) -> torch.Tensor:
    """Scalings a model's ``forward`` applies outside its modules, in order (see ``OutsideOps``).

    ``mul`` / ``div`` by a Python number, ``mul_tensor`` by a 0-d tensor of ``x``'s dtype,
    ``softcap``: ``tanh(x / cap) * cap``; each spelled as the models spell it, so results match.
    """
    for kind, value in ops:
        if kind == "mul":
            x = x * value
        elif kind == "div":
            x = x / value
        elif kind == "mul_tensor":
            x = x * torch.tensor(value, dtype=x.dtype)
        elif kind == "softcap":
            x = torch.tanh(x / value) * value
        else:
            raise ValueError(f"unknown op {kind!r}")
    return x


def scaled_tied_head(ops: Ops, shared: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`tied_head` followed by the model's logit scaling (bind ``ops`` with `functools.partial`)."""
    return apply_ops(F.linear(hidden, shared.module.weight), ops)


class TokenEmbedding(nn.Module):
    """Token lookup when the head is not tied."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, inputs: tuple) -> tuple:
        input_ids, mask = inputs
        return self.embedding(input_ids), mask


class FinalNorm(nn.Module):
    """The final norm; drops the mask, which no later layer needs."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple) -> torch.Tensor:
        return self.norm(inputs[0])


class Head(nn.Module):
    """An untied output projection (``lm_head``; BERT-MLM's ``decoder`` uses it too)."""

    def __init__(self, lm_head: nn.Linear, ops: Ops = ()):
        super().__init__()
        self.lm_head = lm_head
        self.ops = ops  # logit scaling after the projection (Granite, Cohere, Gemma 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return apply_ops(self.lm_head(hidden), self.ops)


class CausalLMAdapter:
    """``model(input_ids, attention_mask=..., labels=...)`` <-> pipeline tensors."""

    def __init__(self, model: nn.Module, output_class: type):
        self.model = model
        self.output_class = output_class

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple:
        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        ids = bound["input_ids"]
        return ids, long_mask(bound.get("attention_mask"), ids)

    def make_output(self, logits: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        loss = None
        if bound.get("labels") is not None:
            loss = causal_lm_loss(self.model, logits, bound["labels"])
        return finish(self.output_class(loss=loss, logits=logits), bound, self.model.config)
