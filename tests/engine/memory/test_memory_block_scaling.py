"""The memory estimate traced on a few blocks and scaled (``engine/memory/block_scaling.py``) equals the trace of
every block: each figure of each role, byte for byte, for GPT-2, LLaMA (grouped KV heads) and BERT, with
tensor parallelism, pipelines of uneven stages, activation checkpointing and sharded data parallelism. And the
scaled estimate is what makes a 70B model's layout cheap to size.
"""

from __future__ import annotations

import json

import pytest

from smp2ds.engine.memory import estimate_memory, load_model_source
from smp2ds.engine.memory.block_scaling import BlockSpan, block_span, stage_segment
from smp2ds.engine.memory.estimate import StepShape

CONFIGS = {
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 10, "n_head": 4,
             "vocab_size": 256, "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 10, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 64},
    "bert": {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 10, "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 64},
}
SHAPES = {
    "whole": {},
    "tp2": {"tensor_parallel": 2},
    "pp3-uneven": {"pipeline_stages": 3, "microbatches": 3, "batch_per_rank": 6},
    "tp2-pp2-checkpointing": {"pipeline_stages": 2, "microbatches": 2, "tensor_parallel": 2,
                              "activation_checkpointing": True},
    "checkpointing": {"activation_checkpointing": True},
    "sdp2": {"zero_stage": 3, "optimizer_shard": 2},
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    found = {}
    for name, config in CONFIGS.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps(config))
        found[name] = load_model_source(str(path))
    return found


CASES = [("llama", name) for name in SHAPES] + [(family, name) for family in ("gpt2", "bert")
                                                 for name in ("pp3-uneven", "tp2-pp2-checkpointing", "sdp2")]
"""Every shape on LLaMA; GPT-2 (tied head, Conv1D) and BERT (encoder, masked-LM head) where their layer lists
and blocks differ most."""


@pytest.mark.parametrize(("family", "shape_name"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_ten_blocks_scaled_from_one_and_two_equal_ten_traced(sources, family, shape_name):
    step = StepShape(**{"batch_per_rank": 4, "seq_len": 32, **SHAPES[shape_name]})
    traced = estimate_memory(sources[family], step, scale=False).to_dict()
    scaled = estimate_memory(sources[family], step).to_dict()
    assert scaled == traced
    assert traced["roles"][0]["activations"] > 0


def test_one_cache_across_layouts_gives_what_each_layout_alone_gives(sources):
    """``--fit`` shares one cache across its layouts (whole models, partitions, stretches of a small model): each
    estimate equals the one made without it, whatever came before."""
    cache: dict = {}
    for name in ("pp3-uneven", "tp2-pp2-checkpointing", "whole", "sdp2", "pp3-uneven"):
        step = StepShape(**{"batch_per_rank": 4, "seq_len": 32, **SHAPES[name]})
        assert estimate_memory(sources["gpt2"], step, cache=cache).to_dict() == \
            estimate_memory(sources["gpt2"], step).to_dict(), name
    assert any(key[0] == "stretch" for key in cache) and any(key[0] == "whole" for key in cache)


def test_the_block_run_and_each_stage_s_stand_in():
    names = ["embed", *(f"model.layers.{i}" for i in range(80)), "norm", "lm_head"]
    whole = block_span(names)
    small = block_span(["embed", *(f"model.layers.{i}" for i in range(4)), "norm", "lm_head"])
    assert whole == BlockSpan(head=1, count=80, tail=2) and small == BlockSpan(head=1, count=4, tail=2)
    # the first stage keeps the embedding, the last its norm and head, a middle one only blocks
    assert stage_segment(0, 20, whole, small, 3) == stage_segment(0, 20, whole, small, 3)
    first = stage_segment(0, 20, whole, small, 3)
    middle = stage_segment(20, 41, whole, small, 2)
    last = stage_segment(62, 83, whole, small, 3)
    assert (first.start, first.stop, first.stage_blocks) == (0, 4, 19)
    assert (middle.start, middle.stop, middle.stage_blocks) == (1, 3, 21)
    assert (last.start, last.stop, last.stage_blocks) == (2, 7, 19)
    # an encoder and a decoder (two stacks) are traced whole
    assert block_span(["shared", "encoder.block.0", "encoder.block.1", "decoder.block.0", "lm_head"]) is None


def test_a_70b_llama_at_tp8_pp4_is_sized_from_a_few_blocks(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    import torch

    estimate = estimate_memory(load_model_source(str(path)),
                               StepShape(pipeline_stages=4, tensor_parallel=8, microbatches=8, batch_per_rank=8,
                                         seq_len=4096, dtype=torch.bfloat16))
    roles = estimate.roles
    # every parameter is on some stage: each block's 855.6M cut over 8 tensor-parallel ranks (its two norms kept
    # whole, 16K), the embedding and the head (262M each) whole on every rank
    block = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    expected = 80 * (block // 8 + 2 * 8192) + 2 * 32000 * 8192 + 8192
    assert sum(role.elements for role in roles) == expected
    assert [role.layers for role in roles][0] == ("model.embed_tokens", "model.layers.18")
    # 1F1B: the first stage holds 4 micro-batches' activations, the last one
    assert [role.in_flight for role in roles] == [4, 3, 2, 1]


def test_per_layer_settings_are_cut_with_the_blocks_or_keep_the_model_whole(tmp_path):
    """Qwen2's ``layer_types`` (one entry per block, all alike) is cut with the block count and the scaled
    estimate still equals the whole trace; GPT-Neo's alternating global and local attention makes its blocks
    unlike, so it is traced whole (and a config that refuses fewer blocks would be too)."""
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 256, "max_position_embeddings": 64, "layer_types": ["full_attention"] * 6}
    neo = {"architectures": ["GPTNeoForCausalLM"], "model_type": "gpt_neo", "hidden_size": 64, "num_layers": 6,
           "num_heads": 4, "vocab_size": 256, "max_position_embeddings": 64,
           "attention_types": [[["global", "local"], 3]]}
    for name, config in (("qwen2", qwen2), ("neo", neo)):
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    qwen = load_model_source(str(tmp_path / "qwen2.json"))
    assert qwen.blocks == ("num_hidden_layers", 6)
    assert qwen.with_blocks(2).hf_config["layer_types"] == ["full_attention"] * 2
    step = StepShape(batch_per_rank=4, seq_len=32, pipeline_stages=2, microbatches=2)
    assert estimate_memory(qwen, step).to_dict() == estimate_memory(qwen, step, scale=False).to_dict()
    assert load_model_source(str(tmp_path / "neo.json")).blocks is None
