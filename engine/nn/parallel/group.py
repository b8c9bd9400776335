"""One rank's tensor-parallel group, as the layers and the backend see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smp2ds.engine.nn.parallel.rng import RngManager
from smp2ds.translator.tensor_parallel import TensorParallelSettings


def _default_stream() -> RngManager:
    return RngManager(TensorParallelSettings.seed)


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group of one rank: torch handle, this rank's index, size, global ranks, and the group's
    random stream."""

    handle: Any
    rank: int
    size: int
    ranks: tuple[int, ...]
    prescaled_batch: bool = TensorParallelSettings.prescaled_batch
    """True: the group shares one batch; False: every member brings its own (gathered per region)."""
    optimize: str = TensorParallelSettings.optimize
    """SMP's ``optimize``: 'memory' splits the distributed transformer's sequence over the group."""
    rng: RngManager = field(default_factory=_default_stream, compare=False, repr=False)
    """The group's random stream (SMP's ``tensor_parallel_seed``): regions' dropout masks and fresh weights of
    distributed modules; the same on every member."""

    @property
    def src(self) -> int:
        """Global rank of the group's first member (the source of broadcasts)."""
        return self.ranks[0]

    def __deepcopy__(self, memo: dict) -> TPGroup:
        # a group is the process's, not a module's: a copied model computes over the same group and stream
        return self


SINGLE = TPGroup(handle=None, rank=0, size=1, ranks=(0,), prescaled_batch=True)
"""No tensor parallelism (before ``smp.init`` or with ``tensor_parallel_degree`` 1)."""


def groups_of(module: Any) -> list[TPGroup]:
    """The tensor-parallel groups ``module`` holds: a region's (``_smp2ds_tp``), an ``smp.nn`` module's (``tp``)."""
    held = (module.__dict__.get(attr) for attr in ("_smp2ds_tp", "tp"))
    return [group for group in held if isinstance(group, TPGroup)]


def is_tensor_parallel(module: Any) -> bool:
    """True for a module whose forward runs collectives over a tensor-parallel group (a region, a
    sharded layer or an ``smp.nn`` distributed module at degree > 1): tracing keeps it whole."""
    return any(group.size > 1 for group in groups_of(module))
