"""Every difference between the transformers releases smp2ds supports, kept in one place.

Supported: 4.41 to 4.57 (from 4.41.0) and 5.x. The rest of smp2ds calls these helpers instead of asking which
release is installed. What differs, and who needs it:

* Attention masks (the pipeline's layers). ``transformers.masking_utils`` exists from 4.53 on
  (`has_masking_utils`); before it each model's forward builds its mask, in the base model's
  ``_update_causal_mask`` or with ``modeling_attn_mask_utils``, and `legacy_causal_mask` builds the same one
  the same way. ``create_bidirectional_mask`` (BERT's encoder) exists from 5.0 on; 4.x's ``BertModel.forward``
  builds the encoder mask itself, which `bidirectional_mask_builder` reproduces there.
* The causal-LM loss: ``model.loss_function`` from 4.46 on, the forward's own shifted cross entropy before
  (`causal_lm_loss`).
* A transformer layer (``BertLayer`` in 4.x, ``GPT2Block`` in early 5.x) returns ``(hidden, ...)``;
  later releases return the hidden states alone (`layer_hidden`).
* Rotary settings: 5.x configs hold them in ``config.rope_parameters`` (``rope_type``,
  ``rope_theta``, ``partial_rotary_factor``); 4.x configs in ``rope_theta`` (GPT-NeoX:
  ``rotary_emb_base``), ``partial_rotary_factor`` (GPT-NeoX: ``rotary_pct``) and ``rope_scaling``
  (`rope_parameters`, `rope_config_kwargs`); 4.x's GPT-NeoX config takes only its own names.
* ``TrainingArguments._setup_devices`` is transformers' own ``cached_property`` up to 4.50 and
  ``functools.cached_property`` later (`cached_property_getter`), which the Trainer repairs replace.
* Logging: older Trainers log the learning rate after the scheduler stepped (`trainer_logs_step_learning_rate`).
* Resuming: older Trainers load their RNG checkpoint with a plain ``torch.load``, which torch >= 2.6 refuses
  for numpy's RNG state; later ones allowlist numpy's types (`rng_checkpoint_globals`).

Older releases are refused by name (`require_supported_transformers`, run by ``import
smdistributed.modelparallel.torch``): from 4.39 down their Trainer hands ``Accelerator`` arguments that
accelerate 1.0 removed, and transformers 5 needs accelerate >= 1.3; 4.40's Trainer refuses fp16 on the CPU.
Apart from the cached property and the RNG checkpoint, the Hugging Face Trainer's SMP path needs no version
switch: the same repairs (`hf_trainer_repairs`) fit 4.41 to 5.x. The version is read from the installed
distribution's metadata, so importing this module does not import transformers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from packaging.version import Version

from smp2ds.engine.exceptions import SMPUnsupportedError

__all__ = [
    "TRANSFORMERS_FLOOR",
    "bidirectional_mask_builder",
    "cached_property_getter",
    "causal_lm_loss",
    "rng_checkpoint_globals",
    "trainer_logs_step_learning_rate",
    "has_masking_utils",
    "legacy_causal_mask",
    "is_transformers_5",
    "layer_hidden",
    "require_supported_transformers",
    "rope_config_kwargs",
    "rope_parameters",
    "transformers_version",
]

TRANSFORMERS_FLOOR = Version("4.41.0")
"""The oldest transformers release smp2ds supports (pyproject.toml declares the same floor): 4.39 and older
hand ``Accelerator`` the ``dispatch_batches`` / ``split_batches`` arguments accelerate 1.0 removed (and
transformers 5 needs accelerate >= 1.3); 4.40's Trainer refuses fp16 on the CPU."""


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
            f"(4.x from {TRANSFORMERS_FLOOR.major}.{TRANSFORMERS_FLOOR.minor}, and 5.x): "
            f"pip install 'transformers>={TRANSFORMERS_FLOOR}'")


# ---- attention masks -----------------------------------------------------------------------------
def _bidirectional_mask_4x(config: Any, input_embeds: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
    """The encoder mask 4.x's ``BertModel.forward`` builds from a 2-D padding mask (no cache, no head mask,
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
    """transformers' ``create_bidirectional_mask`` (5.x), or the 4.x model code's equivalent (keyword
    arguments ``config``, ``input_embeds``, ``attention_mask``)."""
    if is_transformers_5():
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask
    return _bidirectional_mask_4x


def cached_property_getter(descriptor: Any) -> Callable[[Any], Any]:
    """The function behind a ``TrainingArguments`` cached property: ``functools.cached_property`` (later
    releases) keeps it in ``func``, transformers' own ``utils.generic.cached_property`` (a ``property``; 4.50
    and older) in ``fget``."""
    getter = getattr(descriptor, "func", None) or getattr(descriptor, "fget", None)
    if getter is None:
        raise TypeError(f"{type(descriptor).__name__} is not a cached property")
    return getter


@functools.cache
def has_masking_utils() -> bool:
    """Whether the installed transformers has ``transformers.masking_utils`` (4.53 on). Older releases build
    the attention masks inside each model's forward; `legacy_causal_mask` rebuilds them there."""
    return importlib.util.find_spec("transformers.masking_utils") is not None


# Models whose forward, before masking_utils, hands its blocks only the padding mask under eager attention
# (their attention applies causality itself, from a lower-triangular buffer).
_PADDING_ONLY_EAGER = frozenset({"gpt2"})
# Models whose forward, before ``_update_causal_mask``, gives the mask helpers ``config.sliding_window`` (4.41).
_WINDOWED = frozenset({"mistral", "mixtral", "qwen2", "qwen2_moe", "starcoder2"})
# Models whose forward, before ``_update_causal_mask``, hands its blocks the 4-D mask as booleans (True: masked).
_BOOLEAN_MASK = frozenset({"bloom"})
# Models whose stacks, before ``_update_causal_mask``, use the base class's ``get_extended_attention_mask``.
_EXTENDED_MASK = frozenset({"t5", "mt5"})


def _own_causal_mask(owner: Any, hidden: torch.Tensor, mask: torch.Tensor) -> Any:
    """``owner._update_causal_mask(...)`` for a cache-free forward, its arguments bound by name (the method's
    signature differs between models and releases: ``use_cache`` in Mistral's, for instance)."""
    method = owner._update_causal_mask
    given = {"attention_mask": mask, "input_tensor": hidden, "inputs_embeds": hidden,
             "cache_position": torch.arange(hidden.shape[1], device=hidden.device),
             "past_key_values": None, "use_cache": False, "output_attentions": False,
             "past_seen_tokens": 0,  # 4.40's and 4.41's spelling of "no cache"
             "head_mask": None, "alibi": None}  # Falcon's (4.50), which the pipeline never sets
    params = inspect.signature(method).parameters
    missing = [name for name, p in params.items() if name not in given and p.default is inspect.Parameter.empty
               and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if missing:
        raise TypeError(f"{type(owner).__name__}._update_causal_mask takes {missing}, which a cache-free call "
                        "cannot supply")
    return method(**{name: given[name] for name in params if name in given})


def legacy_causal_mask(owner: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor) -> Any:
    """The causal (or, where that release's model applies it there, sliding-window) mask a model's own forward
    hands its blocks on a release without ``masking_utils``, for a cache-free call with the 2-D padding mask
    ``mask``.

    ``owner`` is the module whose forward builds the mask (the base model, a T5 stack). Llama-style decoders
    (and T5 stacks up to 4.57) build it in ``owner._update_causal_mask``, which is called; T5 stacks of 4.44 in
    ``get_extended_attention_mask``; the others (GPT-2, GPT-NeoX, Falcon and OPT in 4.44; BLOOM, Mistral and
    Qwen2 in 4.41 too) call ``modeling_attn_mask_utils``: SDPA's 4-D mask (``None`` without padding), else the
    additive 4-D causal mask (with Mistral's window; BLOOM's as booleans), or for GPT-2 the additive padding
    mask alone."""
    # lazy: transformers is imported only by the model code that asks for a mask
    from transformers.modeling_attn_mask_utils import (
        _prepare_4d_causal_attention_mask,
        _prepare_4d_causal_attention_mask_for_sdpa,
    )

    if owner is not None and hasattr(owner, "_update_causal_mask"):
        return _own_causal_mask(owner, hidden, mask)
    model_type = getattr(config, "model_type", None)
    if owner is not None and model_type in _EXTENDED_MASK:
        return owner.get_extended_attention_mask(mask, tuple(mask.shape))
    shape = (hidden.shape[0], hidden.shape[1])
    window = {"sliding_window": config.sliding_window} if model_type in _WINDOWED else {}
    if getattr(config, "_attn_implementation", "eager") == "sdpa":
        return _prepare_4d_causal_attention_mask_for_sdpa(mask, shape, hidden, 0, **window)
    if model_type in _PADDING_ONLY_EAGER:
        return (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
    causal = _prepare_4d_causal_attention_mask(mask, shape, hidden, 0, **window)
    return causal.bool() if model_type in _BOOLEAN_MASK else causal


def rng_checkpoint_globals() -> contextlib.AbstractContextManager[Any]:
    """What the Trainer's ``_load_rng_state`` needs around its ``torch.load`` of ``rng_state*.pth`` (which holds
    numpy's RNG state): later releases allowlist numpy's types themselves (``trainer.safe_globals``), so nothing;
    older ones (4.41, 4.44) load without it and fail under torch's ``weights_only`` default (torch >= 2.6), so the
    same allowlist."""
    # lazy: transformers' Trainer module is imported only by the Trainer repair that asks
    import numpy as np
    import transformers.trainer as trainer_module

    if hasattr(trainer_module, "safe_globals"):
        return contextlib.nullcontext()
    np_core = np._core if hasattr(np, "_core") else np.core
    return torch.serialization.safe_globals([np_core.multiarray._reconstruct, np.ndarray, np.dtype,
                                             type(np.dtype(np.uint32))])


def trainer_logs_step_learning_rate() -> bool:
    """Whether the Trainer logs the learning rate its optimizer step used (later releases hand it to
    ``_maybe_log_save_evaluate``). Older ones (4.41 to 4.50, measured) log the scheduler's rate after it stepped:
    the next step's, the same schedule one step ahead (training itself uses the same rates)."""
    # lazy: transformers' Trainer module is imported only by those who ask
    from transformers import Trainer

    return "learning_rate" in inspect.signature(Trainer._maybe_log_save_evaluate).parameters


def causal_lm_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss as its ``forward`` computes it: ``model.loss_function`` (4.46 on), or on older releases
    the cross entropy of the logits (in fp32) shifted one token against the labels, mean over labels not -100."""
    loss_function = getattr(model, "loss_function", None)
    if loss_function is not None:
        return loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
    shift_logits = logits.float()[..., :-1, :].contiguous()
    shift_labels = labels.to(logits.device)[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


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
