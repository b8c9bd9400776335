"""Every difference between the transformers releases smp2ds supports, kept in one place.

Supported: the last 4.x line (4.57, from 4.57.1) and 5.x. The rest of smp2ds calls these helpers instead of
asking which release is installed. What differs, and who needs it:

* ``transformers.masking_utils.create_bidirectional_mask`` (the pipeline's BERT layers) exists
  from 5.0 on; 4.57's ``BertModel.forward`` builds the encoder mask itself, which
  `bidirectional_mask_builder` reproduces there.
* A transformer layer (``BertLayer`` in 4.57, ``GPT2Block`` in early 5.x) returns ``(hidden, ...)``;
  later releases return the hidden states alone (`layer_hidden`).
* Rotary settings: 5.x configs hold them in ``config.rope_parameters`` (``rope_type``,
  ``rope_theta``, ``partial_rotary_factor``); 4.57 configs in ``rope_theta`` (GPT-NeoX:
  ``rotary_emb_base``), ``partial_rotary_factor`` (GPT-NeoX: ``rotary_pct``) and ``rope_scaling``
  (`rope_parameters`, `rope_config_kwargs`); 4.57's GPT-NeoX config takes only its own names.

Older releases are refused by name (`require_supported_transformers`): their Trainer's SMP path and
model code were not tested. The Hugging Face Trainer's SMP path needs no version switch: the same
repairs (`hf_trainer_repairs`) fit 4.57 and 5.x. The version is read from the installed distribution's metadata, so
importing this module does not import transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from packaging.version import Version

from smp2ds.engine.exceptions import SMPUnsupportedError

__all__ = [
    "TRANSFORMERS_FLOOR",
    "bidirectional_mask_builder",
    "is_transformers_5",
    "layer_hidden",
    "require_supported_transformers",
    "rope_config_kwargs",
    "rope_parameters",
    "transformers_version",
]

TRANSFORMERS_FLOOR = Version("4.57.1")
"""The oldest transformers release smp2ds supports (pyproject.toml declares the same floor; 4.57.0 was
yanked from PyPI)."""


@functools.cache
def transformers_version() -> Version:
    """The installed transformers release (``PackageNotFoundError`` when none is installed)."""
    return Version(version("transformers"))


def is_transformers_5() -> bool:
    """Whether the installed transformers is a 5.x (or later) release."""
    return transformers_version().major >= 5


def require_supported_transformers() -> None:
    """Refuse a transformers release older than `TRANSFORMERS_FLOOR` (none installed: nothing to check)."""
    try:
        installed = transformers_version()
    except PackageNotFoundError:
        return
    if installed < TRANSFORMERS_FLOOR:
        raise SMPUnsupportedError(
            f"transformers=={installed} is not supported by smp2ds; allowed: transformers>={TRANSFORMERS_FLOOR} "
            "(the last 4.x line, 4.57, or 5.x)")


# ---- attention masks -----------------------------------------------------------------------------
def _bidirectional_mask_4x(config: Any, input_embeds: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
    """The encoder mask 4.57's ``BertModel.forward`` builds from a 2-D padding mask (no cache, no head mask,
    no attention outputs: the pipeline's calls): SDPA's ``None`` for "no padding" or its additive 4-D
    mask, else ``get_extended_attention_mask``'s additive mask broadcast over the queries."""
    from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask_for_sdpa

    if attention_mask is None:
        return None
    dtype = input_embeds.dtype
    if config._attn_implementation == "sdpa" and getattr(config, "position_embedding_type", "absolute") == "absolute":
        return _prepare_4d_attention_mask_for_sdpa(attention_mask, dtype, tgt_len=input_embeds.shape[1])
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def bidirectional_mask_builder() -> Callable[..., Any]:
    """transformers' ``create_bidirectional_mask`` (5.x), or the 4.57 model code's equivalent (keyword
    arguments ``config``, ``input_embeds``, ``attention_mask``)."""
    if is_transformers_5():
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask
    return _bidirectional_mask_4x


def layer_hidden(output: Any) -> Any:
    """The hidden states a transformers layer returned: alone (later 5.x) or first of a tuple (4.57, early 5.x)."""
    return output[0] if isinstance(output, tuple) else output


# ---- rotary embeddings ---------------------------------------------------------------------------
def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rotary settings spelled as 5.x's ``config.rope_parameters``: ``rope_type`` and, where the
    config has them, ``rope_theta``, ``partial_rotary_factor`` and the scaling keys. On 4.57 they are
    collected from the separate attributes (a ``rope_parameters`` keyword given to a 4.57 config is stored
    but ignored by its model, so it is ignored here too)."""
    if is_transformers_5():
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope.setdefault("rope_type", "default")
        return rope
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    # configs written before 4.36 name the scaling kind "type"
    rope = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
    for key, legacy in (("rope_theta", "rotary_emb_base"), ("partial_rotary_factor", "rotary_pct")):
        for name in (key, legacy):
            value = getattr(config, name, None)
            if value is not None:
                rope[key] = value
                break
    return rope


# 4.57 configs whose __init__ takes the rotary settings under other names (it overwrites the standard ones).
_ROPE_NAMES_4X = {"gpt_neox": ("rotary_emb_base", "rotary_pct")}


def rope_config_kwargs(model_type: str, rope_theta: float,
                       partial_rotary_factor: float | None = None) -> dict[str, Any]:
    """Keyword arguments giving a ``model_type`` config (``"llama"``, ``"gpt_neox"``, ...) these rotary settings
    on the installed release: ``rope_parameters`` on 5.x; on 4.57 ``rope_theta`` / ``partial_rotary_factor``,
    or GPT-NeoX's ``rotary_emb_base`` / ``rotary_pct``."""
    if is_transformers_5():
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
        if partial_rotary_factor is not None:
            rope["partial_rotary_factor"] = partial_rotary_factor
        return {"rope_parameters": rope}
    theta_name, factor_name = _ROPE_NAMES_4X.get(model_type, ("rope_theta", "partial_rotary_factor"))
    kwargs: dict[str, Any] = {theta_name: rope_theta}
    if partial_rotary_factor is not None:
        kwargs[factor_name] = partial_rotary_factor
    return kwargs
