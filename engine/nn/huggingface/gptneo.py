"""``smp.nn.huggingface.gptneo``: GPT-Neo state dicts between Hugging Face's names and SMP's
``smp.nn.DistributedTransformerLMHead`` (what ``GPTNeoForCausalLM`` becomes under SMP's transformer API).

``transformer.wte`` / ``wpe`` <-> ``word_embedding`` / ``position_embedding``; ``transformer.h.<i>.ln_1``
<-> ``transformer.seq_layers.<i>.attention.layernorm``; ``attn.attention.q_proj`` / ``k_proj`` /
``v_proj`` / ``out_proj`` <-> ``attention.query`` / ``key`` / ``value`` / ``dense``; ``ln_2`` <->
``output.layernorm``; ``mlp.c_fc`` / ``c_proj`` <-> ``output.dense1`` / ``dense2``; ``transformer.ln_f``
<-> ``transformer.layernorm``; ``lm_head`` tied to ``word_embedding`` (dropped, restored from it) or
kept as ``lm_head``. Same tensors (``nn.Linear`` on both sides), exact both ways; unknown keys are
refused by name. A state dict of the in-place sharded model (built without SMP's transformer
settings) already has Hugging Face's names: give it to Hugging Face as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.nn.huggingface import older_name, rename_layers
from smp2ds.engine.nn.huggingface.dt_arguments import activation
from smp2ds.engine.nn.parallel.block_rule import BlockRule

_TOP = {"transformer.wte.weight": "word_embedding.weight", "transformer.wpe.weight": "position_embedding.weight",
        "transformer.ln_f.weight": "transformer.layernorm.weight",
        "transformer.ln_f.bias": "transformer.layernorm.bias", "lm_head.weight": "lm_head.weight"}
_LAYER = {"ln_1": "attention.layernorm", "attn.attention.q_proj": "attention.query",
          "attn.attention.k_proj": "attention.key", "attn.attention.v_proj": "attention.value",
          "attn.attention.out_proj": "attention.dense", "ln_2": "output.layernorm", "mlp.c_fc": "output.dense1",
          "mlp.c_proj": "output.dense2"}
_OLD_BUFFERS = ("attn.attention.bias", "attn.attention.masked_bias")


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``GPTNeoForCausalLM`` state dict -> SMP's names (a head tied to ``wte`` is dropped)."""
    out = rename_layers(state_dict, _TOP, _LAYER, r"transformer\.h\.(\d+)\.(.+)\.(\w+)", "transformer.seq_layers",
                        "translate_hf_state_dict_to_smdistributed_gptneo", "GPT-Neo", _OLD_BUFFERS)
    head, wte = out.get("lm_head.weight"), out.get("word_embedding.weight")
    if head is not None and wte is not None and torch.equal(head, wte):
        del out["lm_head.weight"]
    return out


def translate_state_dict_to_hf_gptneo(state_dict: Mapping[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """An SMP GPT-Neo state dict -> ``GPTNeoForCausalLM``'s names (exact inverse; a tied head is restored;
    ``max_seq_len``: SMP's argument, nothing to rebuild)."""
    out = rename_layers(state_dict, {v: k for k, v in _TOP.items()}, {v: k for k, v in _LAYER.items()},
                        r"transformer\.seq_layers\.(\d+)\.(.+)\.(\w+)", "transformer.h",
                        "translate_state_dict_to_hf_gptneo", "GPT-Neo", _OLD_BUFFERS)
    if "lm_head.weight" not in out and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


translate_hf_gptneo_state_dict_to_smdistributed = older_name(
    "translate_hf_gptneo_state_dict_to_smdistributed", translate_hf_state_dict_to_smdistributed_gptneo)


# ---- GPT-Neo for the tensor-parallel package and SMP's transformer replacement ----------------------------
BLOCK_RULES = {"GPTNeoBlock": BlockRule("gpt_neo", column=("attn.attention.q_proj", "attn.attention.k_proj",
                                                           "attn.attention.v_proj", "mlp.c_fc"),
                                        row=("attn.attention.out_proj", "mlp.c_proj"),
                                        heads=("attn.attention.num_heads", "attn.attention.embed_dim"))}

MODEL_TYPE = "gpt_neo"


def export_to_hf(state_dict: Mapping[str, Any], num_attention_heads: int) -> dict[str, Any]:
    """Offline export (``smp2ds checkpoint export``): SMP's distributed-transformer names -> Hugging Face's."""
    return translate_state_dict_to_hf_gptneo(state_dict)


def gptneo_arguments(config: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``DistributedTransformerLMHead`` arguments for a GPT-Neo config: global and local (windowed) attention
    layers, unscaled attention scores in fp32, no q/k/v bias, learned positions, head tied to the embedding."""
    act = activation("GPT-Neo", "activation_function", config.activation_function)
    hidden, heads = config.hidden_size, config.num_heads
    args = {
        "num_layers": config.num_layers, "num_attention_heads": heads, "attention_head_size": hidden // heads,
        "hidden_size": hidden, "intermediate_size": config.intermediate_size or 4 * hidden,
        "vocab_size": config.vocab_size, "num_positions": config.max_position_embeddings,
        "attention_dropout_prob": config.attention_dropout, "hidden_dropout_prob": config.resid_dropout,
        "embedding_dropout_prob": config.embed_dropout, "activation": act,
        "layernorm_epsilon": config.layer_norm_epsilon, "causal_mask_size": config.max_position_embeddings,
        "initializer_range": config.initializer_range, "pre_layernorm": True, "post_layernorm": False,
        "add_lm_head": True, "tie_input_output_embedding": bool(getattr(config, "tie_word_embeddings", True)),
        "scale_attention_scores": False, "attention_in_fp32": True, "use_qkv_bias": False,
        "attention_layers_type": list(config.attention_layers), "window_size": config.window_size,
        "mask_value": -1e9,  # as SMP's GPT-Neo replacement: unscaled fp32 scores can be large
    }
    return {**args, **settings}
