"""Parameters partitioned by DeepSpeed ZeRO-3 (sharded data parallelism, delayed initialisation): whether a
module has them, and reading them whole for a while."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

Around = Callable[[torch.nn.Module], contextlib.AbstractContextManager]
"""``around(module)``: a context in which ``module``'s parameters can be read and replaced whole (tensor
parallelism shards a model born partitioned block by block inside it)."""


def is_partitioned(module: torch.nn.Module) -> bool:
    """True when ``module``'s parameters were created partitioned (ZeRO-3 ``ds_tensor``)."""
    return any(hasattr(p, "ds_tensor") for p in module.parameters())


@contextlib.contextmanager
def gathered_whole(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s partitioned parameters gathered whole while the context lasts (every rank of the
    partitioning group enters it); nothing happens when none is partitioned. SMP's distributed-transformer
    replacement reads a Hugging Face model born partitioned through it: this gathers the whole model once,
    for the time it takes to build the replacement."""
    params = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
    if not params:
        yield
        return
    import deepspeed  # start-up: only for models born partitioned

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield
