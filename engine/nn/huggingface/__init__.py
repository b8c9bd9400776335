"""``smp.nn.huggingface``: state-dict translators between Hugging Face and SMP's layouts.

SMP replaced Hugging Face transformers by its own distributed transformer, whose parameter names
differ; its translators mapped between the two. These do the same for what smp2ds builds under SMP's
transformer settings, exactly both ways: ``gpt2``, ``gptneo``, ``gptneox`` and ``gptj`` for the
``smp.nn.DistributedTransformerLMHead`` those models become, ``bert`` / ``roberta`` for the encoder
layers of the ``smp.nn.DistributedTransformer`` that replaces their encoder. A model built without
those settings is sharded in place under its own names: its state dict already is Hugging Face's.
Every translator drops SMP's checkpoint markers (``_smp_is_partial``, ``_smp_load_info``), which
Hugging Face's loaders do not accept.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from smp2ds.engine.core.checkpoint_format import MARKERS


def count_layers(state_dict: Mapping[str, Any], pattern: str) -> int:
    """How many distinct layer indices ``pattern`` (one group: the index) finds among the keys."""
    return len({m.group(1) for k in state_dict if (m := re.match(pattern, k))})


def same_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` without SMP's markers (names and tensors unchanged)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict (mapping of names to tensors) is needed, got {type(state_dict).__name__}")
    return {k: v for k, v in state_dict.items() if k not in MARKERS}


def rename_layers(state_dict: Mapping[str, Any], top: Mapping[str, str], layer: Mapping[str, str], pattern: str,
                  out_layers: str, fn: str, family: str, skipped: tuple[str, ...] = ()) -> dict[str, Any]:
    """Rename a state dict key by key: ``top`` maps whole names, ``layer`` maps the module path inside a
    layer (``pattern`` captures layer index, module path and leaf; ``out_layers`` prefixes the result).
    Layer entries named in ``skipped`` (old mask buffers) are dropped; any other key is refused by name."""
    out: dict[str, Any] = {}
    for key, value in same_layout(state_dict).items():
        m = re.fullmatch(pattern, key)
        if key in top:
            out[top[key]] = value
        elif m and m.group(2) in layer and m.group(3) in ("weight", "bias"):
            out[f"{out_layers}.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"] = value
        elif not (m and f"{m.group(2)}.{m.group(3)}" in skipped):
            raise KeyError(f"{fn}: {key!r} is not a {family} parameter name this translator knows")
    return out


def older_name(name: str, translate: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """SMP's older ``translate_hf_<model>_state_dict_to_smdistributed(state_dict, max_seq_len)``, called
    ``name``: the same translation as ``translate``; ``max_seq_len`` is accepted and unused."""

    def older(state_dict: Mapping[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
        return translate(state_dict)

    older.__name__ = older.__qualname__ = name
    older.__doc__ = f"SMP's older name of ``{translate.__name__}`` (``max_seq_len`` accepted, unused)."
    return older
