"""Every Hugging Face model family smp2ds knows, gathered from the family modules, one per family: what the
tensor-parallel package shards in place (block rules) and what SMP's distributed transformer replaces
(its constructor arguments from the family's config, and the state-dict translation into its names).

A family's knowledge of GPT-2's structure lives in its module here (``gpt2.py``: block rule, distributed
transformer arguments, checkpoint names both ways); only what DeepSpeed's pipeline needs of it (the layer
list adapters) lives in the pipeline package, ``engine/pipeline/families/``, which may not be imported from
here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smp2ds.engine.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox, llama, roberta
from smp2ds.engine.nn.parallel.block_rule import BlockRule

BLOCK_RULES: dict[str, BlockRule] = {**gpt2.BLOCK_RULES, **llama.BLOCK_RULES, **bert.BLOCK_RULES,
                                     **roberta.BLOCK_RULES, **gptneox.BLOCK_RULES, **gptj.BLOCK_RULES,
                                     **gptneo.BLOCK_RULES}
"""Block class name -> how the tensor-parallel package shards it in place."""

EXPORTS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    family.MODEL_TYPE: family.export_to_hf for family in (gpt2, gptneo, gptneox, gptj)}
"""Hugging Face ``model_type`` -> its offline export from SMP's distributed-transformer names
(``(state_dict, num_attention_heads) -> Hugging Face state dict``)."""

CONFIGS_FROM_SHAPES: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    family.MODEL_TYPE: family.config_from_shapes for family in (gpt2, llama, gptneox)}
"""Hugging Face ``model_type`` -> a ``config.json`` dict read from a Hugging Face-named state dict's shapes and
the head count (which no shape holds); KeyError when the state dict lacks a tensor the family always has."""


@dataclass(frozen=True)
class LMReplacement:
    """How SMP's ``DistributedTransformerLMHead`` replaces one Hugging Face causal-LM class."""

    arguments: Callable[[Any, dict[str, Any]], dict[str, Any]]
    """(config, the marking context's settings) -> constructor arguments (settings override)."""
    translate: Callable[[dict[str, Any], Any], dict[str, Any]]
    """(Hugging Face state dict, config) -> the same weights under SMP's names."""
    to_hf: Callable[[dict[str, Any], Any], dict[str, Any]]
    """(SMP state dict, config) -> the same weights under Hugging Face's names (the exact inverse)."""


def _gptneox_translate(state_dict: dict[str, Any], config: Any) -> dict[str, Any]:
    gptneox.remember_num_attention_heads(config.num_attention_heads)  # SMP's translators default to it
    return gptneox.translate_hf_state_dict_to_smdistributed_gptneox(state_dict, config.num_attention_heads)


def _gptneox_to_hf(state_dict: dict[str, Any], config: Any) -> dict[str, Any]:
    return gptneox.translate_state_dict_to_hf_gptneox(state_dict, num_attention_heads=config.num_attention_heads)


LM_REPLACEMENTS: dict[str, LMReplacement] = {
    "GPT2LMHeadModel": LMReplacement(gpt2.gpt2_arguments,
                                     lambda sd, _: gpt2.translate_hf_state_dict_to_smdistributed_gpt2(sd),
                                     lambda sd, _: gpt2.translate_state_dict_to_hf_gpt2(sd)),
    "GPTNeoForCausalLM": LMReplacement(gptneo.gptneo_arguments,
                                       lambda sd, _: gptneo.translate_hf_state_dict_to_smdistributed_gptneo(sd),
                                       lambda sd, _: gptneo.translate_state_dict_to_hf_gptneo(sd)),
    "GPTNeoXForCausalLM": LMReplacement(gptneox.gptneox_arguments, _gptneox_translate, _gptneox_to_hf),
    "GPTJForCausalLM": LMReplacement(gptj.gptj_arguments,
                                     lambda sd, _: gptj.translate_hf_state_dict_to_smdistributed_gptj(sd),
                                     lambda sd, _: gptj.translate_state_dict_to_hf_gptj(sd)),
}
"""Hugging Face causal-LM class name -> its replacement by ``DistributedTransformerLMHead``."""

ENCODER_ARGUMENTS: dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {
    "BertEncoder": bert.encoder_arguments, "RobertaEncoder": bert.encoder_arguments}
"""Hugging Face encoder class name -> ``DistributedTransformer`` arguments for its config."""
