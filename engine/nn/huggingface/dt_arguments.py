"""What every Hugging Face family's ``DistributedTransformer(LMHead)`` arguments share: the activations the
distributed transformer runs, and the sizes GPT-2-style configs (``n_embd``, ``n_head``, ``*_pdrop``) hold."""

from __future__ import annotations

from typing import Any

from smp2ds.engine.exceptions import SMPUnsupportedError

ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
"""Hugging Face activation name -> the distributed transformer's."""


def activation(family: str, field: str, value: str) -> str:
    """The distributed transformer's activation for a Hugging Face config's ``field``, or a refusal."""
    if value not in ACTIVATIONS:
        raise SMPUnsupportedError(f"{family} {field}={value!r} is not supported by the distributed transformer; "
                                  f"supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[value]


def gpt_sizes(config: Any, act: str) -> dict[str, Any]:
    """Arguments read the same way from GPT-2 and GPT-J configs (``n_embd``, ``n_head``, ``*_pdrop``, ...)."""
    hidden, heads = config.n_embd, config.n_head
    return {
        "num_layers": config.n_layer, "num_attention_heads": heads, "attention_head_size": hidden // heads,
        "hidden_size": hidden, "intermediate_size": config.n_inner or 4 * hidden, "vocab_size": config.vocab_size,
        "num_positions": config.n_positions, "attention_dropout_prob": config.attn_pdrop,
        "hidden_dropout_prob": config.resid_pdrop, "embedding_dropout_prob": config.embd_pdrop,
        "activation": act, "layernorm_epsilon": config.layer_norm_epsilon,
        "causal_mask_size": config.n_positions, "initializer_range": config.initializer_range,
    }
