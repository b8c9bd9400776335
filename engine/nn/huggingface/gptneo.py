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
