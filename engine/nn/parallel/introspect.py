"""Answers to ``smp.DistributedModel``'s tensor-parallel questions, read from what the engine did.

* distributed modules: ``smp.nn`` modules (``DistributedLinear``, ``DistributedEmbedding``, the
  distributed transformer, user ``tp_register`` classes) and the modules sharded in place (Hugging
  Face blocks turned into tensor-parallel regions, and their column/row-parallel linears);
* distributed parameters/buffers: those cut into shards (a :class:`~shards.ShardSpec` rides on them);
* scaled-batch parameters: those computed on the tensor-parallel group's joined batch (inside a
  region, :func:`region.is_scaled_batch`). SMP all-reduces their gradients over the
  reduced-data-parallel group; every other parameter's over the whole data-parallel group
  (``dp = tp x rdp``), which is what :mod:`grads` reproduces before DeepSpeed's rdp reduction.
  Buffers are scaled-batch when they belong to a distributed module and tp > 1.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from smp2ds.engine.nn.parallel.modules import DistributedModule
from smp2ds.engine.nn.parallel.region import is_scaled_batch
from smp2ds.engine.nn.parallel.shards import spec_of


def is_distributed_module(module: torch.nn.Module) -> bool:
    """An ``smp.nn`` module, or a module the engine made tensor-parallel in place."""
    return isinstance(module, DistributedModule) or "_smp2ds_tp" in vars(module)


def distributed_modules(root: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every distributed module under ``root`` (depth first, as ``modules()`` orders them)."""
    return (m for m in root.modules() if is_distributed_module(m))


def is_distributed(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is this rank's shard of a larger tensor (split over the tp group)."""
    return spec_of(tensor) is not None


def scaled_batch_buffers(root: torch.nn.Module, tp_size: int) -> set[int]:
    """``id`` of every buffer of a distributed module (none when tp is 1: there is no joined batch)."""
    if tp_size <= 1:
        return set()
    return {id(b) for m in distributed_modules(root) for b in m.buffers()}


def split_by_reducer(root: torch.nn.Module) -> tuple[list, list]:
    """``(default, scaled_batch)``: ``root``'s named parameters split by the group that reduces them."""
    default, scaled = [], []
    for name, p in root.named_parameters():
        (scaled if is_scaled_batch(p) else default).append((name, p))
    return default, scaled
