"""Tensor-parallel sharding of a model born partitioned over MiCS shard groups (``smp.model_creation`` /
``delay_param_initialization`` under ``delayed_parameter_initialization``, with tensor parallelism).

No rank may hold the whole model: ``parallelize`` reads one block at a time through the ``around`` made here,
inside which the block's parameters are gathered whole; on exit the parameters sharding made (this rank's
pieces, still ordinary tensors) are partitioned over the shard group at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from smp2ds.engine.core.deepspeed_config import engine_config
from smp2ds.engine.core.partitioned_params import Around, gathered_whole, is_partitioned
from smp2ds.engine.mics.mpu import ShardGroupMPU
from smp2ds.engine.mics.shard_groups import MicsGroups
from smp2ds.engine.mics.zero3 import shard_ds_config


def sharding_around(module: torch.nn.Module, plan_ds: Mapping[str, Any], microbatches: int,
                    groups: MicsGroups) -> Around | None:
    """The ``around`` for ``parallelize`` when ``module`` was born partitioned, else None."""
    if not is_partitioned(module):
        return None
    import deepspeed  # start-up: only for models born partitioned

    cfg = shard_ds_config(engine_config(plan_ds, microbatches=microbatches), groups)

    @contextlib.contextmanager
    def around(block: torch.nn.Module) -> Iterator[None]:
        with gathered_whole(block):
            yield
        if any(not hasattr(p, "ds_tensor") for p in block.parameters()):
            deepspeed.zero.Init(module=block, data_parallel_group=groups.shard_group, config_dict_or_path=cfg,
                                mpu=ShardGroupMPU(groups))

    return around
