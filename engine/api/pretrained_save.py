"""``DistributedModel.save_pretrained``: a Hugging Face directory that ``from_pretrained`` loads, from a model that
tensor parallelism, pipelines or sharded data parallelism split, and that SMP's distributed transformer may have
replaced.

The full state dict is gathered on every rank (a collective), renamed to Hugging Face's names by the registered
``smp_to_hf`` functions, and rank 0 hands it to transformers' own ``save_pretrained``: the wrapped module's when
it is still a Hugging Face model (blocks sharded in place, a replaced BERT encoder), otherwise that of an empty
shell of the replaced class built on the ``meta`` device from the model's ``config`` (GPT-2, GPT-Neo, GPT-NeoX
and GPT-J replaced by ``DistributedTransformerLMHead``), so no second copy of the weights is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.core import object_collectives as collectives
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import SMPUnsupportedError


def to_hf_names(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` through every registered ``smp_to_hf`` (unchanged when nothing was replaced)."""
    out = dict(state_dict)
    for smp_to_hf, _ in state.module_manager.translate_functions:
        out = smp_to_hf(out)
    return out


def hf_model_for(module: torch.nn.Module) -> Any:
    """The Hugging Face model whose ``save_pretrained`` writes ``module``'s weights: ``module`` itself, or a meta
    shell of the class SMP's distributed transformer replaced."""
    if hasattr(module, "save_pretrained"):
        return module
    replaced, config = getattr(module, "_smp2ds_replaced", None), getattr(module, "config", None)
    if replaced is None or config is None:
        raise SMPUnsupportedError(f"save_pretrained: the wrapped {type(module).__name__} is not a Hugging Face model "
                                  "(it has no save_pretrained); save its state_dict() instead")
    import transformers  # start-up: only for saving a replaced model

    with torch.device("meta"):
        return getattr(transformers, replaced)(config)


def save_pretrained(model: Any, save_directory: str, **kwargs: Any) -> None:
    """Gather ``model`` (a ``DistributedModel``) and write it in Hugging Face's format from rank 0; collective."""
    given = kwargs.pop("state_dict", None)
    full = to_hf_names(given if given is not None else model.state_dict())
    if state.groups.rank == 0:
        kwargs.setdefault("is_main_process", True)
        hf_model_for(model.get_module()).save_pretrained(save_directory, state_dict=full, **kwargs)
    collectives.barrier()
