"""``smp.nn.huggingface``: state-dict translators between Hugging Face and the engine's layout.

SMP replaced Hugging Face transformers by its own distributed transformer, whose parameter names
differ; its translators mapped between the two. smp2ds shards the Hugging Face modules in place
and keeps their names, so a state dict in the engine's layout *is* a Hugging Face state dict:
every translator here returns a copy with the same keys and tensors, minus SMP's checkpoint
markers (``_smp_is_partial``, ``_smp_load_info``), which Hugging Face's loaders do not accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MARKERS = ("_smp_is_partial", "_smp_load_info")


def same_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` without SMP's markers (names and tensors unchanged)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict (mapping of names to tensors) is needed, got {type(state_dict).__name__}")
    return {k: v for k, v in state_dict.items() if k not in MARKERS}
