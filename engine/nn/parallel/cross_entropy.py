"""Vocab-parallel cross-entropy (Megatron-LM's): the loss of logits whose vocabulary is split over the
tensor-parallel group, without ever joining the logits.

Rank ``r`` holds logits ``z[..., v]`` for ``v`` in ``[r*V/tp, (r+1)*V/tp)``. Per token, three all-reduces
of one number each give the full softmax's pieces: the maximum (for stability), the sum of
``exp(z - max)``, and the target's logit (held by one rank, zero elsewhere). The loss is
``log(sum exp(z - max)) - (z_target - max)``, on every rank. Backward is local:
``d loss / d z_v = softmax_v - [v == target]`` on this rank's slice, times the incoming gradient.
Targets outside ``[0, V)`` (``ignore_index`` -100) fall outside every slice: their loss is
``log(sum exp)`` and must be masked by the caller, which zeroes their gradient too.
"""

from __future__ import annotations

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.nn.parallel.group import TPGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp: TPGroup) -> torch.Tensor:  # type: ignore[override]
        rows = logits.shape[-1]
        start = tp.rank * rows
        top = logits.max(dim=-1).values
        comm.all_reduce(top, op=comm.ReduceOp.MAX, group=tp.handle)
        shifted = logits - top.unsqueeze(-1)
        outside = (target < start) | (target >= start + rows)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(picked, group=tp.handle)
        exp = shifted.exp_()  # shifted is ours: reuse its memory
        total = exp.sum(dim=-1)
        comm.all_reduce(total, group=tp.handle)
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        softmax, local_target, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return g.mul_(grad.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Per-token cross-entropy of vocab-split ``logits`` [..., V/tp] against ``target`` [...] (global ids;
    ``tp.size`` > 1)."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp)
