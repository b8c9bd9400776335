"""How the data-parallel backend's DeepSpeed engine holds the parameters: the contract between that backend
(``smp2ds.engine.data_parallel.backend``, the micro-batch loop and the DeepSpeed calls) and the packages that
decide where parameters live, which may not import it:

* ``smp2ds.engine.data_parallel.replicated``: every rank holds the whole model (DDP; ZeRO-1 partitions the
  optimizer state over the reduced-data-parallel group);
* ``smp2ds.engine.mics.sharding``: ZeRO-3 inside MiCS shard groups, replicated across them.

The backend factory builds one and hands it to the backend, which asks it instead of subclassing.
"""

from __future__ import annotations

from typing import Any, Protocol

from smp2ds.engine.core.tensor_parallel_view import TensorParallelView


class ParameterSharding(Protocol):
    """Where parameters live and what follows from it (``backend`` below is the data-parallel backend)."""

    name: str
    """The backend's name as the planner names it (``deepspeed-data-parallel``, ``mics``, with ``tensor-parallel``)."""
    collective_state_dict: bool
    """True when ``state_dict()`` is a collective (shards joined or partitions gathered)."""
    clips_in_step: bool
    """True when DeepSpeed clips inside the step at the configured value (``clip_master_grads`` refused)."""
    tensor_parallel: TensorParallelView | None
    """The model as ``parallelize`` sharded it (None without tensor parallelism)."""
    reduces_in_backward: bool
    """True when DeepSpeed reduces gradients inside every ``backward`` (ZeRO-3): nothing is left to reduce after
    the micro-batches, and the step's last backward runs as DeepSpeed's accumulation boundary."""

    def initialize(self, *, model: Any, optimizer: Any, config: dict) -> tuple:
        """``deepspeed.initialize`` for this placement: (engine, optimizer, ...)."""

    def optimizer_state_is_sharded(self, zero_stage: int) -> bool:
        """True when every rank holds a different part of the optimizer state (one file per rank)."""

    def optimizer_partition(self) -> tuple[int, int]:
        """(index, count) of this rank's optimizer-state partition."""

    def param_shard_rank(self) -> int: ...
    def param_shard_size(self) -> int: ...

    def full_state_dict(self, backend: Any, prefix: str, keep_vars: bool) -> dict:
        """Every tensor whole under its original name."""

    def local_state_dict(self, backend: Any, prefix: str, keep_vars: bool) -> dict:
        """What this rank's partial checkpoint holds."""

    def load_module_state_dict(self, backend: Any, state_dict: dict, strict: bool) -> Any:
        """Load full tensors or this rank's shards."""
