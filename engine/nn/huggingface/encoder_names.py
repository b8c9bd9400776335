"""Names of a Hugging Face BERT-style encoder (BERT, RoBERTa) and of SMP's ``DistributedTransformer``
that replaces it: only the encoder's layers are renamed (``nn.Linear`` weights keep their
``[out, in]`` layout), every other key (embeddings, pooler, heads) is the same on both sides."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from smp2ds.engine.nn.huggingface import same_layout

HF_TO_SMP = {
    "attention.self.query": "attention.query", "attention.self.key": "attention.key",
    "attention.self.value": "attention.value", "attention.output.dense": "attention.dense",
    "attention.output.LayerNorm": "attention.layernorm", "intermediate.dense": "output.dense1",
    "output.dense": "output.dense2", "output.LayerNorm": "output.layernorm",
}
SMP_TO_HF = {v: k for k, v in HF_TO_SMP.items()}

_HF = re.compile(r"(^|.*\.)layer\.(\d+)\.(.+)\.(weight|bias)$")
_SMP = re.compile(r"(^|.*\.)seq_layers\.(\d+)\.(.+)\.(weight|bias)$")


def _rename(state_dict: Mapping[str, Any], pattern: re.Pattern, table: dict[str, str], layers: str,
            fn: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in same_layout(state_dict).items():
        m = pattern.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, index, module, leaf = m.groups()
        if module not in table:
            raise KeyError(f"{fn}: {key!r} is not an encoder-layer parameter name this translator knows")
        out[f"{prefix}{layers}.{index}.{table[module]}.{leaf}"] = value
    return out


def hf_to_smp(state_dict: Mapping[str, Any], fn: str) -> dict[str, Any]:
    """``...layer.<i>.attention.self.query.weight`` -> ``...seq_layers.<i>.attention.query.weight`` etc."""
    return _rename(state_dict, _HF, HF_TO_SMP, "seq_layers", fn)


def smp_to_hf(state_dict: Mapping[str, Any], fn: str) -> dict[str, Any]:
    """The inverse of :func:`hf_to_smp` (exact)."""
    return _rename(state_dict, _SMP, SMP_TO_HF, "layer", fn)
