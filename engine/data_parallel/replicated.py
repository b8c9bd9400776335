"""Every rank holds the whole model (or, with tensor parallelism, its group's shards whole): DDP, and ZeRO-1
partitioning only the optimizer state over the reduced-data-parallel group. The
:class:`~smp2ds.engine.core.parameter_sharding.ParameterSharding` of plain data parallelism."""

from __future__ import annotations

from typing import Any

from smp2ds.engine.core.tensor_parallel_view import TensorParallelView


class ReplicatedParameters:
    """Parameters replicated over the data-parallel group. ``rdp``: this rank's index in the reduced-data-parallel
    group and the group's size (where ZeRO-1 partitions the optimizer state); ``mpu``: DeepSpeed's view of the
    groups with tensor parallelism (its data-parallel group is rdp), None without."""

    clips_in_step = False
    reduces_in_backward = False

    def __init__(self, rdp: tuple[int, int] = (0, 1), mpu: Any = None,
                 tensor_parallel: TensorParallelView | None = None) -> None:
        self._rdp = rdp
        self._mpu = mpu
        self.tensor_parallel = tensor_parallel if tensor_parallel is not None and tensor_parallel.size > 1 else None
        self.name = "deepspeed-data-parallel" if self.tensor_parallel is None else "tensor-parallel"
        self.collective_state_dict = self.tensor_parallel is not None

    def initialize(self, *, model: Any, optimizer: Any, config: dict) -> tuple:
        import deepspeed  # start-up: DeepSpeed is imported when the first engine is built

        return deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=self._mpu)

    def optimizer_state_is_sharded(self, zero_stage: int) -> bool:
        return zero_stage >= 1

    def optimizer_partition(self) -> tuple[int, int]:
        """DeepSpeed's data-parallel group is rdp: this rank's index in it and its size."""
        return self._rdp

    def param_shard_rank(self) -> int:
        """SMP's ``param_shard_rank``: 0 when parameters are not sharded."""
        return 0

    def param_shard_size(self) -> int:
        """SMP's ``param_shard_size``: 1 when parameters are not sharded."""
        return 1

    def full_state_dict(self, backend: Any, prefix: str, keep_vars: bool) -> dict:
        """The whole module's state dict; tensor-parallel shards joined (a collective over the group)."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel.join(backend.module.state_dict(prefix=prefix, keep_vars=True), keep_vars)
        return backend.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def local_state_dict(self, backend: Any, prefix: str, keep_vars: bool) -> dict:
        """The whole module, or its tensor-parallel shards, under the original names."""
        return backend.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_module_state_dict(self, backend: Any, state_dict: dict, strict: bool) -> Any:
        """Load full tensors (cut to this rank's tensor-parallel shard) or this rank's shards."""
        if self.tensor_parallel is not None:
            state_dict = self.tensor_parallel.cut(backend.module.state_dict(keep_vars=True), state_dict)
        return backend.module.load_state_dict(state_dict, strict=strict)
