"""LLaMA-style decoder layers (LLaMA, Mistral) for the tensor-parallel package: sharded in place under their
own names (no SMP distributed transformer replaces them, so their state dicts stay Hugging Face's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smp2ds.engine.nn.huggingface import count_layers
from smp2ds.engine.nn.parallel.block_rule import BlockRule

MODEL_TYPE = "llama"

LLAMA_LAYER = BlockRule("llama", column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                         "mlp.up_proj"),
                        row=("self_attn.o_proj", "mlp.down_proj"),
                        heads=("self_attn.num_heads", "self_attn.num_key_value_heads"))
BLOCK_RULES = {"LlamaDecoderLayer": LLAMA_LAYER,
               "MistralDecoderLayer": BlockRule("mistral", LLAMA_LAYER.column, LLAMA_LAYER.row, LLAMA_LAYER.heads)}


def config_from_shapes(state_dict: Mapping[str, Any], num_attention_heads: int) -> dict[str, Any]:
    """A ``config.json`` dict with every size a LLaMA state dict's shapes tell (grouped-query heads from the key
    projection's rows, a tied head from the missing ``lm_head.weight``)."""
    vocab, hidden = state_dict["model.embed_tokens.weight"].shape
    kv_rows = state_dict["model.layers.0.self_attn.k_proj.weight"].shape[0]
    return {"model_type": MODEL_TYPE, "vocab_size": vocab, "hidden_size": hidden,
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": kv_rows // (hidden // num_attention_heads),
            "num_hidden_layers": count_layers(state_dict, r"model\.layers\.(\d+)\."),
            "intermediate_size": state_dict["model.layers.0.mlp.gate_proj.weight"].shape[0],
            "tie_word_embeddings": "lm_head.weight" not in state_dict}
