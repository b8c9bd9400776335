"""``smp.nn.huggingface.bert``: BERT state dicts between Hugging Face's names and SMP's, whose
``DistributedTransformer`` replaces the encoder (:mod:`encoder_names`: only encoder layers are renamed;
a state dict of the in-place sharded model already has Hugging Face's names and passes unchanged)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface import encoder_names
from smp2ds.engine.nn.huggingface.dt_arguments import activation
from smp2ds.engine.nn.parallel.block_rule import BlockRule


def translate_hf_state_dict_to_smdistributed_bert(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face BERT state dict -> SMP's names (encoder layers under ``seq_layers``)."""
    return encoder_names.hf_to_smp(state_dict, "translate_hf_state_dict_to_smdistributed_bert")


def translate_state_dict_to_hf_bert(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """An SMP BERT state dict -> Hugging Face's names (exact inverse)."""
    return encoder_names.smp_to_hf(state_dict, "translate_state_dict_to_hf_bert")


# ---- BERT for the tensor-parallel package and SMP's transformer replacement -------------------------------
BERT_LAYER = BlockRule("bert", column=("attention.self.query", "attention.self.key", "attention.self.value",
                                       "intermediate.dense"),
                       row=("attention.output.dense", "output.dense"),
                       heads=("attention.self.num_attention_heads", "attention.self.all_head_size"))
BLOCK_RULES = {"BertLayer": BERT_LAYER}


def encoder_arguments(config: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``DistributedTransformer`` arguments for a BERT/RoBERTa config (post-layernorm, no causal mask)."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise SMPUnsupportedError("a BERT/RoBERTa decoder (is_decoder / add_cross_attention) cannot be replaced by "
                                  "smp.nn.DistributedTransformer: causal and cross attention are not implemented")
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise SMPUnsupportedError(f"BERT/RoBERTa position_embedding_type={kind!r} is not supported by "
                                  "smp.nn.DistributedTransformer; supported: 'absolute'")
    act = activation("BERT/RoBERTa", "hidden_act", config.hidden_act)
    hidden, heads = config.hidden_size, config.num_attention_heads
    args = {
        "num_layers": config.num_hidden_layers, "num_attention_heads": heads, "attention_head_size": hidden // heads,
        "hidden_size": hidden, "intermediate_size": config.intermediate_size,
        "attention_dropout_prob": config.attention_probs_dropout_prob,
        "hidden_dropout_prob": config.hidden_dropout_prob,
        "activation": act, "layernorm_epsilon": config.layer_norm_eps,
        "initializer_range": config.initializer_range, "causal_mask_size": None, "pre_layernorm": False,
        "post_layernorm": True,
    }
    return {**args, **settings}
