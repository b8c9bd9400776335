"""This rank's tensor-parallel group, as the layers and the backend see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smp2ds.engine.core.state import state
from smp2ds.translator.tensor_parallel import TensorParallelSettings


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group of one rank: torch handle, this rank's index, size, global ranks."""

    handle: Any
    rank: int
    size: int
    ranks: tuple[int, ...]
    prescaled_batch: bool = TensorParallelSettings.prescaled_batch
    """True: the group shares one batch; False: every member brings its own (gathered per region)."""
    optimize: str = TensorParallelSettings.optimize
    """SMP's ``optimize``: 'memory' splits the distributed transformer's sequence over the group."""

    @property
    def src(self) -> int:
        """Global rank of the group's first member (the source of broadcasts)."""
        return self.ranks[0]


SINGLE = TPGroup(handle=None, rank=0, size=1, ranks=(0,), prescaled_batch=True)
"""No tensor parallelism (before ``smp.init`` or with ``tensor_parallel_degree`` 1)."""


def current() -> TPGroup:
    """The running process's tensor-parallel group (``SINGLE`` without tensor parallelism)."""
    if not state.initialized or state.groups.topology.tp == 1:
        return SINGLE
    tp = state.plan.engine_settings.tensor_parallel
    return TPGroup(handle=state.groups.group("tp"), rank=state.groups.coords.tp_rank,
                   size=state.groups.topology.tp, ranks=tuple(state.groups.ranks["tp"]),
                   prescaled_batch=tp.prescaled_batch, optimize=tp.optimize)


def is_tensor_parallel(module: Any) -> bool:
    """True for a module whose forward runs collectives over a tensor-parallel group (a region, a
    sharded layer or an ``smp.nn`` distributed module at degree > 1): tracing keeps it whole."""
    for attr in ("_smp2ds_tp", "tp"):
        group = module.__dict__.get(attr)
        if isinstance(group, TPGroup) and group.size > 1:
            return True
    return False
