"""One tensor-parallel rank of a model, cut by the engine's own code, on fake tensors.

The engine shards a marked model at ``smp.DistributedModel`` (``tensor_parallel.registry.apply``: Hugging Face
blocks in place, other ``nn.Linear`` / ``nn.Embedding`` replaced by ``smp.nn`` modules) over this rank's
tensor-parallel group. Here the group is one of PyTorch's ``fake`` process-group backend: its collectives
return tensors of the right shapes without peers, so the traced step of rank 0 is the step every rank of
the group runs (the ranks hold equal shapes), all-gathered batches and all-reduced outputs included.

Covered: the families whose blocks the engine shards in place (GPT-2, LLaMA, Mistral, BERT, RoBERTa,
GPT-NeoX, GPT-J, GPT-Neo, ...: ``tensor_parallel.families.RULES``), and every other model through the
replacement of its ``nn.Linear`` / ``nn.Embedding`` layers by ``smp.nn.DistributedLinear`` /
``DistributedEmbedding`` (Qwen2, Falcon, ...). The cut runs in a parallel context of its own around the fake
group (:mod:`smp2ds.engine.nn.parallel.context`), with its own random stream: the process's context and
stream are not touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock  # nn.Module.to only, for fake parameters (below)

import torch
from torch import nn

from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.marks import set_tensor_parallelism
from smp2ds.engine.tensor_parallel import registry


@contextlib.contextmanager
def fake_group(size: int) -> Iterator[object]:
    """A process group of ``size`` ranks in this process alone (``torch.distributed``'s fake backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("the memory estimate under tensor parallelism runs in a process without "
                         "torch.distributed (its collectives are faked)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def shard(model: nn.Module, handle: object, size: int, prescaled_batch: bool) -> registry.Report:
    """Mark the whole model and shard or replace its layers as ``smp.DistributedModel`` would; ValueError when
    nothing is cut."""
    group = TPGroup(handle=handle, rank=0, size=size, ranks=tuple(range(size)), prescaled_batch=prescaled_batch)
    set_tensor_parallelism(model)
    original_to = nn.Module.to

    def same_place_to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        # The replacement moves each new module to its predecessor's device and dtype; both are already this
        # step's (fake CPU, built under the step's default dtype), and torch cannot swap a fake parameter
        # (``Module._apply`` swaps FakeTensors, which FakeTensorMode holds weak references to).
        target = torch._C._nn._parse_to(*args, **kwargs)
        held = [*module.parameters(), *module.buffers()]
        if all(t.device == (target[0] or t.device) and (target[1] is None or t.dtype == target[1]) for t in held):
            return module
        return original_to(module, *args, **kwargs)

    with mock.patch.object(nn.Module, "to", same_place_to):
        report = registry.apply(model, ParallelContext(tp=group))
    if not report.sharded_blocks and not report.replaced:
        raise ValueError(f"tensor parallelism cuts nothing of {type(model).__name__}: no block the engine shards in "
                         "place and no nn.Linear / nn.Embedding it replaces")
    return report
