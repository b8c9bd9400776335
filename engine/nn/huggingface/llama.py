"""LLaMA-style decoder layers (LLaMA, Mistral) for the tensor-parallel package: sharded in place under their
own names (no SMP distributed transformer replaces them, so their state dicts stay Hugging Face's)."""

from __future__ import annotations

from smp2ds.engine.nn.parallel.block_rule import BlockRule

LLAMA_LAYER = BlockRule("llama", column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                         "mlp.up_proj"),
                        row=("self_attn.o_proj", "mlp.down_proj"),
                        heads=("self_attn.num_heads", "self_attn.num_key_value_heads"))
BLOCK_RULES = {"LlamaDecoderLayer": LLAMA_LAYER,
               "MistralDecoderLayer": BlockRule("mistral", LLAMA_LAYER.column, LLAMA_LAYER.row, LLAMA_LAYER.heads)}
