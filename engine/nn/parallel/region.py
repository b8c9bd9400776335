"""A tensor-parallel region: a module (a transformer block, a distributed layer) whose tensor-
parallel ranks compute together.

``prescaled_batch: false`` (SMP's default): every tensor-parallel rank brings its own batch. On
entry the region joins the group's batches (every tensor argument with at least two dimensions
whose first dimension is this rank's batch size), runs the module once on the joined batch, and
hands each rank back its own rows of every output. ``prescaled_batch: true``: the group shares
one batch and the region passes tensors through.

Inside a region dropout must draw the same mask on every rank of the group (the activations
between column- and row-parallel layers are replicated), so the region runs on the group's own
random stream (``TPGroup.rng``, :mod:`smp2ds.engine.nn.parallel.rng`), seeded from ``tensor_parallel_seed``.
A region that is activation-checkpointed (``smp.set_activation_checkpointing``) checkpoints its
body inside the group's stream (:data:`~smp2ds.engine.core.activation_checkpointing.CHECKPOINT_INSIDE`),
so the recomputation in backward restores that stream and draws the masks of the first forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.core.activation_checkpointing import CHECKPOINT_INSIDE
from smp2ds.engine.nn.parallel.collectives import gather_batch, slice_batch
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.layers import swap_class


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor inside tuples, lists and dicts (other leaves unchanged)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(tree_map(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, v) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, tree_map(fn, v)) for k, v in obj.items()) if type(obj) is dict else \
            _map_mapping(fn, obj)
    return obj


def _map_mapping(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    for key in list(obj.keys()):
        obj[key] = tree_map(fn, obj[key])
    return obj


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor found in ``obj`` (depth first), or None."""
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if not found else None, obj)
    return found[0] if found else None


def join_batches(args: tuple, kwargs: dict, tp: TPGroup) -> tuple[tuple, dict, int]:
    """Gather the group's batches in every batch-shaped tensor argument; returns the local batch size."""
    first = first_tensor(args) if args else first_tensor(kwargs)
    if first is None or first.dim() == 0:
        return args, kwargs, 0
    local = first.shape[0]

    def join(t: torch.Tensor) -> torch.Tensor:
        return gather_batch(t, tp) if t.dim() >= 2 and t.shape[0] == local else t

    return tree_map(join, args), tree_map(join, kwargs), local


def own_rows(output: Any, local: int, tp: TPGroup) -> Any:
    """This rank's rows of every batch-shaped output tensor of a region that ran on joined batches."""
    joined = local * tp.size

    def own(t: torch.Tensor) -> torch.Tensor:
        return slice_batch(t, tp) if t.dim() >= 1 and t.shape[0] == joined else t

    return tree_map(own, output)


def run_region(tp: TPGroup, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``forward`` as a tensor-parallel region (batch joining and the group's random stream)."""
    if tp.size == 1:
        return forward(*args, **kwargs)
    local = 0
    if not tp.prescaled_batch:
        args, kwargs, local = join_batches(args, kwargs, tp)
    with tp.rng.region_stream():
        out = forward(*args, **kwargs)
    return own_rows(out, local, tp) if local else out


class _Region:
    """forward of a module turned into a tensor-parallel region (mixed in front of its class)."""

    _smp2ds_tp: TPGroup

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        body = super().forward
        checkpointed = getattr(self, CHECKPOINT_INSIDE)
        if checkpointed is not None and torch.is_grad_enabled():
            body = functools.partial(checkpointed, body)
        return run_region(self._smp2ds_tp, body, args, kwargs)


def make_region(module: torch.nn.Module, tp: TPGroup) -> None:
    """Turn ``module`` into a tensor-parallel region in place and mark its parameters as seeing
    the group's joined batch (their gradients already sum the group's samples)."""
    module._smp2ds_tp = tp
    setattr(module, CHECKPOINT_INSIDE, None)
    swap_class(module, _Region)
    mark_scaled_batch(module)


SCALED = "_smp2ds_scaled_batch"


def mark_scaled_batch(module: torch.nn.Module) -> None:
    for p in module.parameters():
        setattr(p, SCALED, True)


def is_scaled_batch(p: torch.Tensor) -> bool:
    """True for parameters whose gradient covers the whole tensor-parallel group's batch."""
    return bool(getattr(p, SCALED, False))
