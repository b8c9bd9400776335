"""Gradient bookkeeping that tensor parallelism adds to data parallelism.

With ``prescaled_batch: false`` every rank of a tensor-parallel group brings its own batch and
its loss covers only those samples, while SMP's reference is data parallelism over all
``dp = tp x rdp`` ranks. Before DeepSpeed averages over the rdp group:

* parameters inside a tensor-parallel region saw the group's joined batch, so their gradient
  already sums the group's tp losses: divide by tp;
* every other parameter saw only this rank's batch: sum over the tensor-parallel group (one
  all-reduce of all such gradients, flattened) and divide by tp.

With ``prescaled_batch: true`` the group shares one batch and nothing is needed.

Gradient norms count each shard of a sharded parameter once (summed over the group) and each
replicated parameter once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.region import is_scaled_batch
from smp2ds.engine.nn.parallel.shards import spec_of


def combine_group_batches(params: Iterable[torch.nn.Parameter], tp: TPGroup) -> None:
    """Turn per-rank gradients into the gradient of the group's mean loss (see module docstring)."""
    own_batch: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        if is_scaled_batch(p):
            p.grad.div_(tp.size)
        else:
            own_batch.append(p.grad)
    if not own_batch:
        return
    for dtype in sorted({g.dtype for g in own_batch}, key=str):
        same = [g for g in own_batch if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        comm.all_reduce(flat, group=tp.handle)
        flat.div_(tp.size)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def install_group_batch_hooks(params: Iterable[torch.nn.Parameter], tp: TPGroup) -> list:
    """The same correction applied to every micro-batch's gradient as autograd produces it.

    For optimizers that move each backward's gradients into their own buffers at once (DeepSpeed's
    bf16 optimizer), so that ``p.grad`` after the micro-batch loop is no longer what gets reduced.
    Costs one all-reduce per parameter and micro-batch for parameters outside regions."""

    def scaled(g: torch.Tensor) -> torch.Tensor:
        return g / tp.size

    def own_batch(g: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(g.clone(), group=tp.handle).div_(tp.size)

    return [p.register_hook(scaled if is_scaled_batch(p) else own_batch) for p in params if p.requires_grad]


def grad_norm(params: Iterable[torch.nn.Parameter], tp: TPGroup, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of the model's gradients across the tensor-parallel group (shards summed, replicas once)."""
    sharded, replicated = [], []
    for p in params:
        if p.grad is not None:
            (sharded if spec_of(p) is not None else replicated).append(p.grad.detach().float())
    # the collective's tensor is born where the group communicates (a rank may hold no shard's gradient)
    device = comm.tensor_device(tp.handle)
    if norm_type == float("inf"):
        zero = torch.zeros((), dtype=torch.float32, device=device)
        local = torch.stack([g.abs().max() for g in sharded]).max().to(device) if sharded else zero
        local = local.clone()
        comm.all_reduce(local, op=comm.ReduceOp.MAX, group=tp.handle)
        rep = torch.stack([g.abs().max() for g in replicated]).max().to(device) if replicated else zero
        return torch.maximum(local, rep)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in sharded:
        total = total + g.abs().pow(norm_type).sum()
    comm.all_reduce(total, group=tp.handle)
    for g in replicated:
        total = total + g.abs().pow(norm_type).sum()
    return total.pow(1.0 / norm_type)
