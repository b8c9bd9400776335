"""The weights a module holds when tensor parallelism replaces it by its distributed class, and carrying them
into the replacement's shards.

SMP gave every replaced module fresh weights and told users to load theirs after ``smp.DistributedModel``.
Scripts that fine-tune load the pretrained model first (``from_pretrained`` inside ``smp.model_creation``), so
that rule would train a random model without a word. smp2ds keeps what a module holds instead:

* a parameter of a Hugging Face model (a ``PreTrainedModel`` and everything below it) is kept when transformers
  loaded or initialised it, and drawn fresh otherwise: the marks :func:`smp2ds.engine.nn.huggingface.fresh.
  initialised` reads, the same rule as SMP's distributed transformer (scripts that skip Hugging Face's init,
  ``PreTrainedModel.init_weights = lambda x: None``, get the distributed module's own init, as in SMP);
* a parameter of any other module is kept (it holds the values its constructor, or the script, gave it);
* a parameter on the ``meta`` device holds nothing and is drawn fresh.

"Kept" means the replacement's shard is cut from the full tensor (:mod:`smp2ds.engine.nn.parallel.shards`), so
the gathered ``state_dict()`` after wrapping equals the one before. A replacement whose parameters cannot be cut
from the module's (a registered class with other names or shapes) is refused when the module held kept weights
of a Hugging Face model; other modules then start from the registered class's own init, with a warning that
says how to load weights after wrapping.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface.fresh import initialised
from smp2ds.engine.nn.parallel.shards import spec_of

LOAD_AFTER = ("load the weights after smp.DistributedModel wraps the model (model.load_state_dict(full_state_dict) "
              "cuts whole tensors into this rank's shards), as SMP's scripts do")


def is_hf_model(module: torch.nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` (told by class name, so transformers need not be imported)."""
    return any(klass.__name__ == "PreTrainedModel" for klass in type(module).__mro__)


def hf_marks(root: torch.nn.Module) -> dict[int, bool]:
    """``id(parameter)`` -> whether transformers loaded or initialised it, for every parameter inside a Hugging
    Face model under ``root`` (parameters outside any are absent)."""
    marks: dict[int, bool] = {}
    covered: set[int] = set()  # modules of an outer Hugging Face model (BertForMaskedLM holds a BertModel)
    for module in root.modules():
        if id(module) in covered or not is_hf_model(module):
            continue
        covered.update(id(m) for m in module.modules())
        flags = initialised(module)
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for name, param in owner._parameters.items():
                if param is not None and id(param) not in marks:
                    key = f"{prefix}.{name}" if prefix else name
                    marks[id(param)] = flags.get(key, False)
    return marks


def held(module: torch.nn.Module, marks: Mapping[int, bool]) -> dict[str, torch.Tensor]:
    """The full values of ``module``'s own parameters that are kept (see the module docstring), by name.
    Call it where the parameters are whole (inside ``around`` for a model born partitioned)."""
    out = {}
    for name, param in module.named_parameters():
        if param.is_meta or not marks.get(id(param), True):
            continue
        out[name] = param.detach().clone()
    return out


def _fits(target: torch.Tensor, value: torch.Tensor) -> bool:
    spec = spec_of(target)
    full = spec.full_shape if spec is not None else tuple(target.shape)
    return tuple(value.shape) == tuple(full)


def carry_into(new: torch.nn.Module, values: Mapping[str, torch.Tensor], rank: int, *, path: str,
               from_hf_model: bool) -> bool:
    """Write ``values`` (full tensors by parameter name) into ``new``'s parameters, each cut to this rank's
    shard. Returns False, writing nothing, when ``new``'s parameters do not match them by name and full shape:
    refused for a Hugging Face model's weights, warned about otherwise."""
    if not values:
        return True
    own = dict(new.named_parameters())
    mismatched = sorted(n for n, v in values.items() if n not in own or not _fits(own[n], v))
    if mismatched:
        reason = (f"{path}: its replacement {type(new).__name__} has no parameter of the same name and full shape "
                  f"for {', '.join(mismatched)}, so the weights it holds cannot be cut into shards")
        if from_hf_model:
            raise SMPUnsupportedError(f"{reason}. Tensor parallelism would throw away loaded weights; {LOAD_AFTER}, "
                                      "or build the model without smp.tensor_parallelism for this module")
        warnings.warn(f"{reason}; it starts from {type(new).__name__}'s own initialisation. To keep them, "
                      f"{LOAD_AFTER}", stacklevel=3)
        return False
    with torch.no_grad():
        for name, value in values.items():
            target = own[name]
            spec = spec_of(target)
            piece = spec.local(value, rank) if spec is not None else value
            target.copy_(piece.to(dtype=target.dtype, device=target.device))
    return True
