"""``smp.nn.huggingface.bert``: BERT state-dict translators (see the package docstring:
the engine keeps Hugging Face's names, so both directions keep keys and tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smp2ds.engine.nn.huggingface import same_layout


def translate_hf_state_dict_to_smdistributed_bert(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face BERT state dict -> the engine's layout (the same names)."""
    return same_layout(state_dict)


def translate_state_dict_to_hf_bert(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A BERT state dict in the engine's layout -> Hugging Face's (the same names)."""
    return same_layout(state_dict)
