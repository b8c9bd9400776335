"""The model families' modules (engine/nn/huggingface): every block rule names projections and head sizes that
exist in the Hugging Face block it is for, and every replaced class builds its distributed transformer."""

from __future__ import annotations

import operator

import pytest
import torch
import transformers

from smp2ds.engine.nn.huggingface.families import BLOCK_RULES, ENCODER_ARGUMENTS, LM_REPLACEMENTS
from smp2ds.engine.nn.transformer import DistributedTransformer, DistributedTransformerLMHead
from smp2ds.engine.tensor_parallel.transformer_replacement import REPLACED_CLASSES

SMALL = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
         "intermediate_size": 64, "max_position_embeddings": 32}
CONFIGS = {
    "GPT2": transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=64, n_positions=32,
                                    bos_token_id=0, eos_token_id=0),
    "Llama": transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    "Mistral": transformers.MistralConfig(**SMALL, num_key_value_heads=2),
    "Bert": transformers.BertConfig(**SMALL),
    "Roberta": transformers.RobertaConfig(**SMALL),
    "GPTNeoX": transformers.GPTNeoXConfig(**SMALL),
    "GPTJ": transformers.GPTJConfig(n_embd=32, n_head=4, n_layer=1, vocab_size=64, n_positions=32, rotary_dim=4),
    "GPTNeo": transformers.GPTNeoConfig(hidden_size=32, num_heads=4, num_layers=1, vocab_size=64,
                                        max_position_embeddings=32, attention_types=[[["global"], 1]]),
}
MODELS = {"GPT2": "GPT2LMHeadModel", "Llama": "LlamaForCausalLM", "Mistral": "MistralForCausalLM",
          "Bert": "BertModel", "Roberta": "RobertaModel", "GPTNeoX": "GPTNeoXForCausalLM",
          "GPTJ": "GPTJForCausalLM", "GPTNeo": "GPTNeoForCausalLM"}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, MODELS[family])(CONFIGS[family])


@pytest.mark.parametrize("family", list(MODELS))
def test_every_rule_names_what_its_block_has(family):
    blocks = [(type(m).__name__, m) for m in _model(family).modules() if type(m).__name__ in BLOCK_RULES]
    assert blocks, f"no block of {family} has a rule"
    for name, block in blocks:
        rule = BLOCK_RULES[name]
        for path in (*rule.column, *rule.row):
            assert isinstance(operator.attrgetter(path)(block), torch.nn.Module), (name, path)
        # a head size may be an attribute of the attention module or read from the config at run time
        owners = {path.rpartition(".")[0] for path in rule.heads}
        assert all(isinstance(operator.attrgetter(owner)(block), torch.nn.Module) for owner in owners), (name, owners)
    assert set(BLOCK_RULES) >= {name for name, _ in blocks}


def test_the_replaced_classes_are_the_families_ones():
    assert set(REPLACED_CLASSES) == set(LM_REPLACEMENTS) | set(ENCODER_ARGUMENTS)
    assert set(LM_REPLACEMENTS) == {"GPT2LMHeadModel", "GPTNeoForCausalLM", "GPTNeoXForCausalLM", "GPTJForCausalLM"}
    assert set(ENCODER_ARGUMENTS) == {"BertEncoder", "RobertaEncoder"}


@pytest.mark.parametrize("family", ["GPT2", "GPTNeoX", "GPTJ", "GPTNeo"])
def test_each_language_model_family_builds_its_distributed_transformer_with_every_weight_named(family):
    hf = _model(family)
    replacement = LM_REPLACEMENTS[type(hf).__name__]
    built = DistributedTransformerLMHead(**replacement.arguments(hf.config, {}))
    translated = replacement.translate(hf.state_dict(), hf.config)
    built.load_state_dict(translated, strict=True)  # every weight of one is a weight of the other, by name
    for name, tensor in translated.items():
        assert torch.equal(built.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", ["Bert", "Roberta"])
def test_each_encoder_family_builds_its_distributed_transformer(family):
    hf = _model(family)
    arguments = ENCODER_ARGUMENTS[type(hf.encoder).__name__](hf.config, {})
    built = DistributedTransformer(**arguments)
    assert len(list(built.seq_layers.children())) == hf.config.num_hidden_layers
