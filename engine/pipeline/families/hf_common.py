"""Shared pieces of the Hugging Face layer lists: call binding, masks, outputs.

The user's ``model(...)`` call is bound against the model's own ``forward`` signature, so
positional and keyword spellings both work; arguments the pipeline cannot carry between stages
(caches, ``inputs_embeds``, ...) are rejected with the list of what is supported.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smp2ds.engine.integrations.transformers_compat import (
    bidirectional_mask_builder,
    has_masking_utils,
    legacy_causal_mask,
)
from smp2ds.engine.pipeline.layers import UnsupportedModelError

# Arguments that may be present as long as they ask for nothing the pipeline cannot give.
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "use_cache": lambda v: v in (None, False),
    "output_attentions": lambda v: v in (None, False),
    "output_hidden_states": lambda v: v in (None, False),
    "return_dict": lambda v: v in (None, True, False),
    "past_key_values": lambda v: v is None,
    "logits_to_keep": lambda v: v in (0, None),
}


def bind_call(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (extra ``**kwargs`` flattened in)."""
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise UnsupportedModelError(f"{type(model).__name__}(...) call does not match its forward(): {exc}") from None
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def check_call(model: nn.Module, bound: dict[str, Any], supported: tuple[str, ...]) -> None:
    """Reject arguments the pipelined model cannot honour, naming them and the supported ones."""
    bad = []
    for name, value in bound.items():
        if name in supported or value is None:
            continue
        if name in _HARMLESS and _HARMLESS[name](value):
            continue
        bad.append(name)
    if bad:
        raise UnsupportedModelError(
            f"pipelined {type(model).__name__} does not support the argument(s) {sorted(bad)}; supported: "
            f"{', '.join(supported)} (plus use_cache=False, return_dict)")
    if bound.get("input_ids") is None:
        raise UnsupportedModelError(f"pipelined {type(model).__name__} needs input_ids")


def long_mask(mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """A 2-D integer padding mask (all ones when the call gave none).

    Masks cross stages as integers so DeepSpeed does not expect gradients for them; an all-ones
    mask yields the same attention mask as no mask in the transformers mask builders.
    """
    if mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    return mask.to(torch.long)


def positions(hidden: torch.Tensor) -> torch.Tensor:
    """``position_ids`` the Hugging Face models compute when none are given (no cache)."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def finish(output: Any, bound: dict[str, Any], config: Any) -> Any:
    """Return a `ModelOutput`, or its tuple when the call (or config) asked for ``return_dict=False``."""
    return_dict = bound.get("return_dict")
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    return output if return_dict else output.to_tuple()


def _mask_call(builder: Callable[..., Any], config: Any, hidden: torch.Tensor, mask: torch.Tensor,
               **extra: Any) -> Any:
    """Call a ``transformers.masking_utils`` builder with the spelling the installed release takes.

    Earlier 5.x releases name the embeddings ``input_embeds`` and require ``cache_position`` and
    ``past_key_values``; later ones name them ``inputs_embeds`` and require ``cache`` instead.
    All build the same mask for a cache-free call.
    """
    params = inspect.signature(builder).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": mask, **extra}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    for cache_arg in ("past_key_values", "cache"):  # no cache: the spelling differs by release
        if cache_arg in params:
            kwargs[cache_arg] = None
    return builder(**kwargs)


def causal_mask(config: Any, hidden: torch.Tensor, mask: torch.Tensor,
                position_ids: torch.Tensor | None = None, owner: nn.Module | None = None) -> Any:
    """transformers' own causal attention mask for a cache-free forward (any supported release).

    ``owner``: the module whose forward builds the mask (the base model); releases without
    ``masking_utils`` build it there (`legacy_causal_mask`).
    """
    if not has_masking_utils():
        return legacy_causal_mask(owner, config, hidden, mask)
    # lazy: masking_utils exists only on the releases checked above
    from transformers.masking_utils import create_causal_mask

    extra = {} if position_ids is None else {"position_ids": position_ids}
    return _mask_call(create_causal_mask, config, hidden, mask, **extra)


def sliding_window_mask(config: Any, hidden: torch.Tensor, mask: torch.Tensor,
                        position_ids: torch.Tensor | None = None, owner: nn.Module | None = None) -> Any:
    """transformers' own sliding-window causal mask (``config.sliding_window``) for a cache-free forward.

    Releases without ``masking_utils`` apply the window where their model code does (Mistral-style
    ``_update_causal_mask``, Gemma2's layers): the mask is then ``owner``'s own (`legacy_causal_mask`).
    """
    if not has_masking_utils():
        return legacy_causal_mask(owner, config, hidden, mask)
    # lazy: masking_utils exists only on the releases checked above
    from transformers.masking_utils import create_sliding_window_causal_mask

    extra = {} if position_ids is None else {"position_ids": position_ids}
    return _mask_call(create_sliding_window_causal_mask, config, hidden, mask, **extra)


def accepted(module: nn.Module, given: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``given`` that ``module``'s forward takes by name: a block's signature differs between
    transformers releases (GPT-2's takes ``position_ids`` only later). A class mixed in front with
    ``forward(*args, **kwargs)`` (as tensor-parallel regions are) hides the names; they are read from the first
    class in the MRO that names any (all of ``given`` when that forward also takes ``**kwargs``, or none names any).
    """
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        if cls is nn.Module or forward is None:
            continue
        params = list(inspect.signature(forward).parameters.values())[1:]  # without self
        if any(p.kind not in var for p in params):
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                return given
            names = {p.name for p in params}
            return {name: value for name, value in given.items() if name in names}
    return given


def bidirectional_mask(config: Any, hidden: torch.Tensor, mask: torch.Tensor) -> Any:
    """transformers' own bidirectional (encoder) attention mask (any supported release)."""
    return _mask_call(bidirectional_mask_builder(), config, hidden, mask)
