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
  hands each rank back its own rows;
* ``gather_sequence`` / ``reduce_scatter_sequence`` (all-gather along the sequence / reduce-scatter
  of the gradient, and the reverse) implement ``optimize: memory``'s sequence parallelism: between
  sublayers each rank holds its own tokens; ``gather_sequence_linear`` is one or more column-parallel
  projections of sequence-split input that keeps only this rank's tokens for backward (gathered again there);
  ``scatter_sequence`` / ``join_sequence`` enter and leave the sequence-split stretch from replicated
  activations (keep own tokens / all-gather, and the reverse in backward).

The reduce-scatter is one ``reduce_scatter_tensor`` over the group (the split dimension moved to
the front for it), so it moves half an all-reduce's bytes.

All traffic goes through :mod:`smp2ds.engine.core.comm`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from smp2ds.engine.core import comm
from smp2ds.engine.nn.parallel.group import TPGroup


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return comm.all_reduce(x.contiguous().clone(), group=tp.handle)


def _gather(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    return torch.cat(comm.all_gather(x.contiguous(), group=tp.handle), dim=dim)


def _own(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    size = x.shape[dim] // tp.size
    # a copy, never a view: autograd forbids in-place updates of a custom Function's view output, and blocks such
    # as Falcon's add into a region's output in place (``mlp_output += attention_output``)
    return x.narrow(dim, tp.rank * size, size).clone(memory_format=torch.contiguous_format)


def _reduce_scatter(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()  # the collective splits dim 0
    out = front.new_empty((front.shape[0] // tp.size, *front.shape[1:]))
    return comm.reduce_scatter_tensor(out, front, group=tp.handle).movedim(0, dim).contiguous()


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


def _dim_pair(name: str, forward: Callable[..., torch.Tensor], backward: Callable[..., torch.Tensor],
              doc: str) -> type[torch.autograd.Function]:
    """An autograd function ``(x, dim, tp)`` running ``forward`` on the tensor and ``backward`` on its
    gradient (each called as ``fn(tensor, dim, tp)``)."""

    def fwd(ctx, x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
        ctx.dim, ctx.tp = dim, tp
        return forward(x, dim, tp)

    def bwd(ctx, grad: torch.Tensor):
        return backward(grad, ctx.dim, ctx.tp), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd),
                                                   "__doc__": doc})


_GatherDim = _dim_pair("_GatherDim", _gather, _own,
                       "Forward: join every rank's piece along ``dim``; backward: keep this rank's piece.")
_OwnDim = _dim_pair("_OwnDim", _own, _gather,
                    "Forward: keep this rank's piece along ``dim``; backward: join every rank's gradient.")
_GatherReduceScatter = _dim_pair(
    "_GatherReduceScatter", _gather, _reduce_scatter,
    "Forward: all-gather along ``dim``; backward: reduce-scatter (the ranks' partial gradients of the joined "
    "tensor are summed and each keeps its own piece).")
_ReduceScatterGather = _dim_pair("_ReduceScatterGather", _reduce_scatter, _gather,
                                 "Forward: reduce-scatter along ``dim``; backward: all-gather the gradient.")


class _GatherLinear(torch.autograd.Function):
    """``F.linear(all_gather(x, dim), w_i, b_i)`` for every ``(w_i, b_i)`` pair given flat after ``x``, ``dim``
    and ``tp`` (one gather for all of them), saving only this rank's ``x`` for backward, which gathers it
    again (Megatron's sequence-parallel column projection); the input gradient is reduce-scattered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, tp: TPGroup, *params: torch.Tensor | None):  # type: ignore[override]
        ctx.dim, ctx.tp, ctx.has_bias = dim, tp, [b is not None for b in params[1::2]]
        weights = params[0::2]
        ctx.save_for_backward(x, *weights)
        full = _gather(x, dim, tp)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, params[1::2]))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        full = _gather(x, ctx.dim, ctx.tp)
        flat_full = full.reshape(-1, full.shape[-1])
        grad_full = sum(g.matmul(w) for g, w in zip(grads, weights))
        out: list[torch.Tensor | None] = [_reduce_scatter(grad_full, ctx.dim, ctx.tp), None, None]
        for g, has_bias in zip(grads, ctx.has_bias):
            flat = g.reshape(-1, g.shape[-1])
            out += [flat.t().matmul(flat_full), flat.sum(0) if has_bias else None]
        return tuple(out)


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


def gather_sequence(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """All-gather the group's tokens along ``dim``; backward reduce-scatters (sequence parallelism)."""
    return x if tp.size == 1 else _GatherReduceScatter.apply(x, dim, tp)


def reduce_scatter_sequence(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """Sum the group's partial tensors and keep this rank's tokens along ``dim``; backward all-gathers."""
    return x if tp.size == 1 else _ReduceScatterGather.apply(x, dim, tp)


def gather_sequence_linear(x: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor | None]], tp: TPGroup,
                           dim: int = 1) -> tuple[torch.Tensor, ...]:
    """Column-parallel ``linear`` of the group's joined tokens for each ``(weight, bias)`` of ``pairs`` (one
    all-gather for all), keeping only this rank's tokens for backward."""
    if tp.size == 1:
        return tuple(F.linear(x, w, b) for w, b in pairs)
    return _GatherLinear.apply(x, dim, tp, *(t for pair in pairs for t in pair))


def scatter_sequence(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a replicated tensor; backward all-gathers (enter the sequence-split stretch)."""
    return x if tp.size == 1 else _OwnDim.apply(x, dim, tp)


def join_sequence(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """All-gather the tokens into a replicated tensor; backward keeps own tokens (leave the stretch)."""
    return x if tp.size == 1 else _GatherDim.apply(x, dim, tp)
