"""``smp.nn.huggingface.gptj``: GPT-J state dicts between Hugging Face's names and SMP's
``DistributedTransformerLMHead`` (what ``GPTJForCausalLM`` becomes under SMP's transformer API).

``transformer.wte`` <-> ``word_embedding``; ``transformer.h.<i>.ln_1`` (shared by attention and MLP)
<-> ``transformer.seq_layers.<i>.attention.layernorm``; ``attn.q_proj`` / ``k_proj`` / ``v_proj`` /
``out_proj`` <-> ``attention.query`` / ``key`` / ``value`` / ``dense``; ``mlp.fc_in`` / ``fc_out`` <->
``output.dense1`` / ``dense2``; ``transformer.ln_f`` <-> ``transformer.layernorm``; ``lm_head.weight``
/ ``lm_head.bias`` <-> ``lm_head.weight`` / ``lm_head_bias``. Same tensors (``nn.Linear`` on both
sides), exact both ways; unknown keys are refused by name. A state dict of the in-place sharded
model already has Hugging Face's names: give it to Hugging Face as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface import older_name, rename_layers
from smp2ds.engine.nn.huggingface.dt_arguments import activation, gpt_sizes
from smp2ds.engine.nn.parallel.block_rule import BlockRule

_TOP = {"transformer.wte.weight": "word_embedding.weight", "transformer.ln_f.weight": "transformer.layernorm.weight",
        "transformer.ln_f.bias": "transformer.layernorm.bias", "lm_head.weight": "lm_head.weight",
        "lm_head.bias": "lm_head_bias"}
_LAYER = {"ln_1": "attention.layernorm", "attn.q_proj": "attention.query", "attn.k_proj": "attention.key",
          "attn.v_proj": "attention.value", "attn.out_proj": "attention.dense", "mlp.fc_in": "output.dense1",
          "mlp.fc_out": "output.dense2"}
_OLD_BUFFERS = ("attn.bias", "attn.masked_bias", "attn.embed_positions")


def translate_hf_state_dict_to_smdistributed_gptj(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``GPTJForCausalLM`` state dict -> SMP's names."""
    return rename_layers(state_dict, _TOP, _LAYER, r"transformer\.h\.(\d+)\.(.+)\.(\w+)", "transformer.seq_layers",
                         "translate_hf_state_dict_to_smdistributed_gptj", "GPT-J", _OLD_BUFFERS)


def translate_state_dict_to_hf_gptj(state_dict: Mapping[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """An SMP GPT-J state dict -> ``GPTJForCausalLM``'s names (exact inverse; ``max_seq_len``: SMP's
    argument, nothing to rebuild)."""
    return rename_layers(state_dict, {v: k for k, v in _TOP.items()}, {v: k for k, v in _LAYER.items()},
                         r"transformer\.seq_layers\.(\d+)\.(.+)\.(\w+)", "transformer.h",
                         "translate_state_dict_to_hf_gptj", "GPT-J", _OLD_BUFFERS)


translate_hf_gptj_state_dict_to_smdistributed = older_name(
    "translate_hf_gptj_state_dict_to_smdistributed", translate_hf_state_dict_to_smdistributed_gptj)


# ---- GPT-J for the tensor-parallel package and SMP's transformer replacement ------------------------------
BLOCK_RULES = {"GPTJBlock": BlockRule("gptj", column=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
                                      row=("attn.out_proj", "mlp.fc_out"),
                                      heads=("attn.num_attention_heads", "attn.embed_dim"))}

MODEL_TYPE = "gptj"


def export_to_hf(state_dict: Mapping[str, Any], num_attention_heads: int) -> dict[str, Any]:
    """Offline export (``smp2ds checkpoint export``): SMP's distributed-transformer names -> Hugging Face's."""
    return translate_state_dict_to_hf_gptj(state_dict)


def gptj_arguments(config: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``DistributedTransformerLMHead`` arguments for a GPT-J config (interleaved rotary, one layer norm
    for the parallel attention and MLP, no q/k/v or attention-output bias, a head with a bias, untied unless
    ``tie_word_embeddings``)."""
    act = activation("GPT-J", "activation_function", config.activation_function)
    if not config.rotary_dim:
        raise SMPUnsupportedError(f"GPT-J with rotary_dim={config.rotary_dim!r} is not supported by the distributed "
                                  "transformer; give a positive rotary_dim (64 for GPT-J-6B)")
    args = {
        **gpt_sizes(config, act),
        "pre_layernorm": True, "post_layernorm": False, "add_lm_head": True, "use_positional_embedding": False,
        "tie_input_output_embedding": bool(getattr(config, "tie_word_embeddings", False)),
        "use_lm_head_bias": True, "rotary_dim": config.rotary_dim,
        "gpt_neox_type_rotary": False, "parallel_attn_output": True, "single_pre_layernorm": True,
        "use_qkv_bias": False, "use_attn_dense_bias": False,
    }
    return {**args, **settings}
