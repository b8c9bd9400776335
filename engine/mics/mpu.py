"""The ``mpu`` object handed to ``deepspeed.initialize`` for MiCS.

DeepSpeed asks an mpu (Megatron-style "model parallel unit") for its data-parallel group and
partitions ZeRO-3 state over it. Answering with the *shard* group makes DeepSpeed's own ZeRO-3
shard inside the shard group only; model-parallel queries answer a one-rank group (size 1,
rank 0): without tensor parallelism there is no model parallelism (with it, :class:`TensorShardMPU`
answers the tensor-parallel group).
The object deliberately has no ``initialize_sequence_parallel`` / ``get_sequence_*`` methods:
DeepSpeed then falls back to the data-parallel answers (deepspeed/utils/groups.py).
"""

from __future__ import annotations

from typing import Any

from smp2ds.engine.core import comm
from smp2ds.engine.mics.shard_groups import MicsGroups
from smp2ds.engine.nn.parallel.group import TPGroup


class ShardGroupMPU:
    """Data parallel = this rank's shard group; model/tensor/pipeline parallel = just this rank."""

    def __init__(self, groups: MicsGroups) -> None:
        self._groups = groups

    # data parallel: the shard group
    def get_data_parallel_group(self) -> Any:
        return self._groups.shard_group

    def get_data_parallel_world_size(self) -> int:
        return self._groups.shard_size

    def get_data_parallel_rank(self) -> int:
        return comm.get_rank(self._groups.shard_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._groups.layout.shard_ranks)

    # model parallel (and its tensor / pipeline flavours): a group of one
    def get_model_parallel_group(self) -> Any:
        return self._groups.self_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_pipeline_model_parallel_group = get_model_parallel_group
    get_pipeline_model_parallel_world_size = get_model_parallel_world_size
    get_pipeline_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return comm.get_rank()


class TensorShardMPU(ShardGroupMPU):
    """Data parallel = this rank's shard group (inside its rdp group); model parallel = its tensor-parallel
    group, which DeepSpeed's gradient norm uses to count each shard once and replicated parameters once."""

    def __init__(self, groups: MicsGroups, tp: TPGroup) -> None:
        super().__init__(groups)
        self._tp = tp

    def get_model_parallel_group(self) -> Any:
        return self._tp.handle

    def get_model_parallel_world_size(self) -> int:
        return self._tp.size

    def get_model_parallel_rank(self) -> int:
        return self._tp.rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._tp.src
