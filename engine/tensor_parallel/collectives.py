"""Tensor-parallel collectives as autograd functions (Megatron's conjugate pairs).

Each function's backward is the forward of its partner, so the gradient of what the tensor-
parallel group computes together is exact:

* ``copy_to_tp`` (identity / all-reduce) enters a column-parallel layer: every rank uses the
  whole input, so the input's gradient is the sum of every rank's partial gradient;
* ``reduce_from_tp`` (all-reduce / identity) leaves a row-parallel layer: partial products are
  summed, and every rank already holds the whole output gradient;
* ``gather_last_dim`` (all-gather features / keep own features) joins sharded features;
* ``gather_batch`` / ``slice_batch`` (all-gather rows / keep own rows, and the reverse) implement
  ``prescaled_batch: false``: a tensor-parallel region computes on the group's joined batch and
  hands each rank back its own rows.

All traffic goes through :mod:`smp2ds.engine.core.comm`.
"""

from __future__ import annotations

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.tensor_parallel.group import TPGroup


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone(), group=tp.handle)


def _gather(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    return torch.cat(comm.all_gather(x, group=tp.handle), dim=dim)


def _own(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    size = x.shape[dim] // tp.size
    return x.narrow(dim, tp.rank * size, size).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _GatherDim(torch.autograd.Function):
    """Forward: join every rank's piece along ``dim``; backward: keep this rank's piece."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.tp = dim, tp
        return _gather(x, dim, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _own(grad, ctx.dim, ctx.tp), None, None


class _OwnDim(torch.autograd.Function):
    """Forward: keep this rank's piece along ``dim``; backward: join every rank's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.tp = dim, tp
        return _own(x, dim, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _gather(grad, ctx.dim, ctx.tp), None, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over the tensor-parallel group."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Join the group's feature shards (last dimension)."""
    return x if tp.size == 1 else _GatherDim.apply(x, x.dim() - 1, tp)


def gather_batch(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Join the group's batches along dimension 0 (rank order)."""
    return x if tp.size == 1 else _GatherDim.apply(x, 0, tp)


def slice_batch(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's rows of a joined batch (gradients of all rows are joined in backward)."""
    return x if tp.size == 1 else _OwnDim.apply(x, 0, tp)
