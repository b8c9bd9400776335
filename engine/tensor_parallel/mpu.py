"""The ``mpu`` handed to ``deepspeed.initialize`` under tensor parallelism.

DeepSpeed reduces gradients, broadcasts initial weights and partitions ZeRO-1 state over the
mpu's data-parallel group: here the reduced-data-parallel (rdp) group, the ranks holding the
same shard. Its model-parallel group is the tensor-parallel group, which DeepSpeed uses to
count sharded parameters (marked ``tensor_model_parallel``) once per shard and replicated ones
once in gradient norms. No ``initialize_sequence_parallel`` method: DeepSpeed then falls back to
the data-parallel answers.
"""

from __future__ import annotations

from typing import Any

from smp2ds.engine.core.process_groups import ProcessGroups


class TensorParallelMPU:
    """Data parallel = this rank's rdp group; model (tensor) parallel = its tp group."""

    def __init__(self, groups: ProcessGroups) -> None:
        self._groups = groups

    def get_data_parallel_group(self) -> Any:
        return self._groups.group("rdp")

    def get_data_parallel_world_size(self) -> int:
        return self._groups.topology.rdp

    def get_data_parallel_rank(self) -> int:
        return self._groups.coords.rdp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._groups.ranks["rdp"])

    def get_model_parallel_group(self) -> Any:
        return self._groups.group("tp")

    def get_model_parallel_world_size(self) -> int:
        return self._groups.topology.tp

    def get_model_parallel_rank(self) -> int:
        return self._groups.coords.tp_rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._groups.ranks["tp"][0]

    def get_pipeline_model_parallel_group(self) -> Any:
        return self._groups.group("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._groups.topology.pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._groups.coords.pp_rank
