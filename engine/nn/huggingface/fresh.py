"""Which weights of a Hugging Face model transformers really initialised or loaded, and fresh weights in
place of the others, for the model's replacement by SMP's distributed transformer.

SMP's example scripts skip Hugging Face's weight init before building a model SMP replaces
(``PreTrainedModel.init_weights = lambda x: None``): SMP's distributed transformer initialises its
own weights. In transformers 5 that leaves the model's tensors as allocated (``torch.empty``-like
memory, or torch's default init at best) and its head untied from the embedding. Copying them into
the distributed transformer would train from garbage, so such weights are not copied: the replacement
draws its own instead.

The rule (transformers 5 ``modeling_utils``), per parameter: a parameter holds real values when
transformers marked it or the module that owns it.

* ``PreTrainedModel._initialize_weights`` sets ``module._is_hf_initialized = True`` on every module it
  initialised (``post_init`` -> ``init_weights`` -> ``initialize_weights``, for a model built
  normally; also under ``delayed_parameter_initialization``, where smp2ds runs it on gathered
  parameters, :mod:`smp2ds.engine.mics.param_creation`);
* ``from_pretrained`` marks every loaded parameter (``param._is_hf_initialized``) and initialises the
  missing ones through ``initialize_weights`` (called directly, so even with ``init_weights`` patched
  out every module ends marked);
* with ``init_weights`` patched out, ``post_init`` initialises nothing and marks nothing.

A parameter with neither mark gets a fresh value: the distributed transformer's own initialisation,
N(0, ``initializer_range``) for weight matrices and embeddings, zeros for biases, ones for layer-norm
weights (``use_normal_initialization`` has no effect: fresh weights are normal, as SMP's Hugging Face
replacements asked). Values are drawn whole, in the Hugging Face model's parameter order, from a
generator seeded with ``tensor_parallel_seed`` and the tensor-parallel stream's count of replaced models (which
``smp.reset`` restarts with the stream), so every rank and every tensor-parallel degree starts from the same full
tensors. Values written into
such a model with a plain ``load_state_dict`` leave no mark and are not seen: load weights after
``smp.DistributedModel`` through the translate functions (as SMP's example does), or keep the init.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.nn.parallel.rng import RngManager


def initialised(model: torch.nn.Module) -> dict[str, bool]:
    """State-dict name -> whether transformers initialised or loaded that parameter (the rule above).
    Names of tied parameters appear once per owner, as in ``state_dict()``."""
    flags: dict[str, bool] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        module_done = bool(getattr(module, "_is_hf_initialized", False))
        for name, param in module._parameters.items():
            if param is not None:
                key = f"{prefix}.{name}" if prefix else name
                flags[key] = module_done or bool(getattr(param, "_is_hf_initialized", False))
    return flags


def layer_norm_weights(model: torch.nn.Module) -> set[str]:
    """State-dict names of ``model``'s layer-norm weights (fresh ones are ones)."""
    return {f"{prefix}.weight" if prefix else "weight" for prefix, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith(("LayerNorm", "RMSNorm"))}


def fill_fresh(target: torch.Tensor, key: str, initializer_range: float, gen: torch.Generator,
               layer_norm: bool) -> None:
    """Write parameter ``key``'s fresh value into ``target`` in place: ones for a layer norm's weight, zeros for a
    bias, N(0, ``initializer_range``) drawn from ``gen`` otherwise (the same numbers for any contiguous fp32
    CPU ``target`` of the shape)."""
    if layer_norm:
        target.fill_(1.0)
    elif key.rsplit(".", 1)[-1] == "bias":
        target.zero_()
    else:
        target.normal_(0.0, initializer_range, generator=gen)


def fresh_value(key: str, like: torch.Tensor, initializer_range: float, gen: torch.Generator,
                layer_norm: bool) -> torch.Tensor:
    """A fresh full tensor for parameter ``key`` shaped and typed like ``like`` (on the CPU when ``like`` is on the
    meta device)."""
    value = torch.empty(like.shape)  # drawn in fp32 on the CPU: the same numbers whatever the model's dtype and device
    fill_fresh(value, key, initializer_range, gen, layer_norm)
    return value.to(device=None if like.is_meta else like.device, dtype=like.dtype)


def with_fresh_weights(model: torch.nn.Module, state_dict: Mapping[str, Any], initializer_range: float,
                       rng: RngManager) -> tuple[dict[str, Any], list[str]]:
    """``state_dict`` (the model's, Hugging Face names) with every parameter transformers neither
    initialised nor loaded replaced by a fresh value drawn from ``rng``'s next fresh-weight stream
    (:meth:`~smp2ds.engine.nn.parallel.rng.RngManager.fresh_generator`), and the names replaced (empty: nothing
    drawn, no stream used)."""
    flags = initialised(model)
    skipped = [k for k in state_dict if not flags.get(k, True)]  # buffers are kept as they are
    if not skipped:
        return dict(state_dict), []
    gen, norms = rng.fresh_generator(), layer_norm_weights(model)
    out = dict(state_dict)
    for key in skipped:
        out[key] = fresh_value(key, state_dict[key], initializer_range, gen, key in norms)
    return out, skipped
