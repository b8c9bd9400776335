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
