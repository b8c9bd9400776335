"""Activation checkpointing: ``smp.set_activation_checkpointing`` and ``smp.checkpoint``.

Both use PyTorch's non-reentrant ``torch.utils.checkpoint`` (module granularity, as in SMP).

With the SMP config key ``offload_activations: true`` every checkpointed call (the
``set_activation_checkpointing`` wrappers, ``smp.checkpoint``, ``smp.checkpoint_sequential``) runs
under the offload hooks of :mod:`smp2ds.engine.core.activation_offload`: the inputs it keeps for
recomputation live in CPU memory until backward, which prefetches them back
``activation_loading_horizon`` activations ahead. The setting is read from the running plan
(``state.plan.engine_settings.activation_checkpointing``) at each call; :func:`offload_activations`
overrides it for a block of code (tests, or use without ``smp.init``). Without offloading the calls
are exactly plain non-reentrant checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from smp2ds.engine.core.activation_offload import _check_horizon, get_offloader
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import DistributedModelNotWrappedError, SMPInvalidArgumentError

_OVERRIDES: list[int | None] = []
"""Stack of :func:`offload_activations` settings: a horizon, or None for "offloading off"."""


@contextlib.contextmanager
def offload_activations(horizon: int = 4, enabled: bool = True) -> Iterator[None]:
    """Within this block, checkpointed calls offload (``enabled``) with this loading horizon, or
    do not offload (``enabled=False``), whatever the running config says. Process-wide; nests."""
    _OVERRIDES.append(_check_horizon(horizon) if enabled else None)
    try:
        yield
    finally:
        _OVERRIDES.pop()


def offload_horizon() -> int | None:
    """The activation loading horizon checkpointed calls use now, or None when they do not offload."""
    if _OVERRIDES:
        return _OVERRIDES[-1]
    if not state.initialized or state.plan is None:
        return None
    settings = state.plan.engine_settings.activation_checkpointing
    return settings.loading_horizon if settings.offload else None


def _run_checkpointed(fn: Any, args: tuple, kwargs: dict, preserve_rng_state: bool) -> Any:
    horizon = offload_horizon()
    if horizon is None:
        return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
    with get_offloader().call(horizon):
        return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def checkpoint(module: torch.nn.Module, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Run ``module(*args, **kwargs)`` without keeping its activations (recomputed in backward)."""
    return _run_checkpointed(module, args, kwargs, preserve_rng_state)


CHECKPOINT_INSIDE = "_smp2ds_checkpoint_inside"
"""A module that has this attribute (None until checkpointed) runs its own body through the
function stored there instead of having its whole ``forward`` checkpointed from outside.

Tensor-parallel regions use it: they draw dropout from their group's random stream, which they
enter inside their ``forward``. Checkpointed from outside, the recomputation would restore the
script's stream and re-enter the group's stream at a later state (other masks, wrong gradients);
checkpointed inside the region, PyTorch saves and restores the group's stream itself. A module
that contains such regions is checkpointed region by region for the same reason."""


def _wrap(module: torch.nn.Module, preserve_rng_state: bool) -> None:
    if getattr(module, "_smp2ds_checkpointed", False):
        return
    if hasattr(module, CHECKPOINT_INSIDE):
        setattr(module, CHECKPOINT_INSIDE,
                lambda fn, *args, **kwargs: _run_checkpointed(fn, args, kwargs, preserve_rng_state))
        module._smp2ds_checkpointed = True
        return
    regions = [m for m in module.modules() if m is not module and hasattr(m, CHECKPOINT_INSIDE)]
    if regions:
        for region in regions:
            _wrap(region, preserve_rng_state)
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return _run_checkpointed(original, args, kwargs, preserve_rng_state)

    module.forward = forward
    module._smp2ds_checkpointed = True


def checkpoint_forward(module: torch.nn.Module, preserve_rng_state: bool = True) -> None:
    """Checkpoint every later call of ``module`` as ``smp.set_activation_checkpointing`` does, without a
    ``DistributedModel`` (the memory estimate checkpoints the blocks of a model it traces)."""
    _wrap(module, preserve_rng_state)


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
