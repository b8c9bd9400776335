"""Activation checkpointing: ``smp.set_activation_checkpointing`` and ``smp.checkpoint``.

Both use PyTorch's non-reentrant ``torch.utils.checkpoint`` (module granularity, as in SMP).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import DistributedModelNotWrappedError, SMPInvalidArgumentError


def checkpoint(module: torch.nn.Module, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Run ``module(*args, **kwargs)`` without keeping its activations (recomputed in backward)."""
    return _torch_checkpoint(module, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def _wrap(module: torch.nn.Module, preserve_rng_state: bool) -> None:
    if getattr(module, "_smp2ds_checkpointed", False):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return _torch_checkpoint(original, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                 **kwargs)

    module.forward = forward
    module._smp2ds_checkpointed = True


def checkpoint_sequential(sequential: torch.nn.Sequential, input: Any, strategy: str = "each",
                          preserve_rng_state: bool = True, pack_args_as_tuple: bool = False) -> Any:
    """Checkpoint the layers of ``sequential`` in groups chosen by ``strategy``."""
    layers = list(sequential)
    size = _group_size(strategy, len(layers))
    x = input
    for start in range(0, len(layers), size):
        chunk = torch.nn.Sequential(*layers[start:start + size])
        x = checkpoint(chunk, x, preserve_rng_state=preserve_rng_state)
    return x


def _group_size(strategy: str, count: int) -> int:
    if strategy == "each":
        return 1
    if strategy == "contiguous":
        return max(1, count)
    if strategy.startswith("group_") and strategy[6:].isdigit() and int(strategy[6:]) > 0:
        return int(strategy[6:])
    raise SMPInvalidArgumentError(f"strategy must be 'each', 'contiguous' or 'group_<k>', got {strategy!r}")


def set_activation_checkpointing(module: torch.nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    """Checkpoint ``module`` (or the layers of an ``nn.Sequential``); call after ``DistributedModel``."""
    if state.model is None:
        raise DistributedModelNotWrappedError("smp.set_activation_checkpointing must be called after "
                                              "smp.DistributedModel(...)")
    state.module_manager.activation_checkpointing[module] = {"preserve_rng_state": preserve_rng_state,
                                                             "strategy": strategy}
    if isinstance(module, torch.nn.Sequential):
        size = _group_size(strategy, len(module))
        if size == 1:
            for layer in module:
                _wrap(layer, preserve_rng_state)
            return
        module.forward = functools.partial(_sequential_forward, module, size, preserve_rng_state)
        return
    _wrap(module, preserve_rng_state)


def _sequential_forward(module: torch.nn.Sequential, size: int, preserve_rng_state: bool, x: Any) -> Any:
    layers = list(module)
    for start in range(0, len(layers), size):
        chunk = torch.nn.Sequential(*layers[start:start + size])
        x = checkpoint(chunk, x, preserve_rng_state=preserve_rng_state) if torch.is_grad_enabled() else chunk(x)
    return x
