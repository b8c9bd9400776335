"""``smp.nn.huggingface.roberta``: RoBERTa state dicts between Hugging Face's names and SMP's, whose
``DistributedTransformer`` replaces the encoder (:mod:`encoder_names`: only encoder layers are renamed;
a state dict of the in-place sharded model already has Hugging Face's names and passes unchanged)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smp2ds.engine.nn.huggingface import encoder_names
from smp2ds.engine.nn.huggingface.bert import BERT_LAYER
from smp2ds.engine.nn.parallel.block_rule import BlockRule


def translate_hf_state_dict_to_smdistributed_roberta(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face RoBERTa state dict -> SMP's names (encoder layers under ``seq_layers``)."""
    return encoder_names.hf_to_smp(state_dict, "translate_hf_state_dict_to_smdistributed_roberta")


def translate_state_dict_to_hf_roberta(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """An SMP RoBERTa state dict -> Hugging Face's names (exact inverse)."""
    return encoder_names.smp_to_hf(state_dict, "translate_state_dict_to_hf_roberta")


# ---- RoBERTa for the tensor-parallel package and SMP's transformer replacement ----------------------------
BLOCK_RULES = {"RobertaLayer": BlockRule("roberta", BERT_LAYER.column, BERT_LAYER.row, BERT_LAYER.heads)}
"""RoBERTa's layer is BERT's; its encoder is replaced with BERT's arguments
(:func:`smp2ds.engine.nn.huggingface.bert.encoder_arguments`)."""
