"""``smp.nn.huggingface.gpt2``: GPT-2 state-dict translators (see the package docstring:
the engine keeps Hugging Face's names, so both directions keep keys and tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smp2ds.engine.nn.huggingface import same_layout


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face GPT-2 state dict -> the engine's layout (the same names)."""
    return same_layout(state_dict)


def translate_state_dict_to_hf_gpt2(state_dict: Mapping[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """A GPT-2 state dict in the engine's layout -> Hugging Face's (the same names).

    ``max_seq_len`` is accepted for SMP compatibility: no attention-mask buffer needs rebuilding."""
    return same_layout(state_dict)


def translate_hf_state_dict_to_smdistributed_gpt2_layer(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """One GPT-2 block's Hugging Face state dict -> the engine's layout (the same names)."""
    return same_layout(state_dict)


def translate_state_dict_to_hf_gpt2_layer(state_dict: Mapping[str, Any],
                                          max_seq_len: int | None = None) -> dict[str, Any]:
    """One GPT-2 block's state dict in the engine's layout -> Hugging Face's (the same names)."""
    return same_layout(state_dict)
