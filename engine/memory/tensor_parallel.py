"""One tensor-parallel rank of a model, cut by the engine's own code, on fake tensors.

The engine shards a marked model at ``smp.DistributedModel`` (``tensor_parallel.registry.apply``: Hugging Face
blocks in place, other ``nn.Linear`` / ``nn.Embedding`` replaced by ``smp.nn`` modules) over this rank's
tensor-parallel group. Here the group is one of PyTorch's ``fake`` process-group backend: its collectives
return tensors of the right shapes without peers, so the traced step of rank 0 is the step every rank of
the group runs (the ranks hold equal shapes), all-gathered batches and all-reduced outputs included.

Covered: the families whose blocks the engine shards in place (GPT-2, LLaMA, Mistral, BERT, RoBERTa,
GPT-NeoX, GPT-J, GPT-Neo, ...: ``tensor_parallel.families.RULES``). Layers replaced by ``smp.nn`` modules take
their group from a running ``smp.init`` and are not estimated yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.marks import set_tensor_parallelism
from smp2ds.engine.tensor_parallel import registry
from smp2ds.engine.tensor_parallel.families import RULES, blocks


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


def shard(model: nn.Module, handle: object, size: int, prescaled_batch: bool) -> None:
    """Mark the whole model and shard it as ``smp.DistributedModel`` would; ValueError when nothing is cut."""
    group = TPGroup(handle=handle, rank=0, size=size, ranks=tuple(range(size)), prescaled_batch=prescaled_batch)
    if not list(blocks(model)):
        raise ValueError(f"the memory estimate under tensor parallelism covers models whose blocks the engine shards "
                         f"in place ({', '.join(sorted(RULES))}); {type(model).__name__} has none")
    set_tensor_parallelism(model)
    registry.apply(model, group)
