"""The runtime ``smp.init`` builds: one frozen object per process, passed to what composes a model's backend.

``smp.init`` translates the config into a Plan, detects the launch, creates the process groups, installs the
tensor-parallel context and, with sharded data parallelism, the MiCS shard groups. Those facts do not change until
the process ends (``smp.reset`` restarts the tensor-parallel random streams: a new runtime with the new context,
:meth:`Runtime.with_context`). The composition root (``api/backend_factory.make_backend``) takes the runtime as
an argument; ``smp.state`` exposes it (``smp.state.runtime``) and reads its fields for SMP's own attributes
(``smp.state.cfg``, ``smp.state.rng_manager``, the process groups).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from smp2ds.engine.core.launch_env import LaunchEnv
from smp2ds.translator.plan_types import Plan, SMPConfig
from smp2ds.translator.topology import Topology

if TYPE_CHECKING:  # annotations only: the runtime holds what the packages above build, and imports none of them
    from smp2ds.engine.core.process_groups import ProcessGroups
    from smp2ds.engine.mics.shard_groups import MicsGroups
    from smp2ds.engine.nn.parallel.context import ParallelContext


@dataclass(frozen=True)
class Runtime:
    """Everything ``smp.init`` built for this process."""

    config: SMPConfig
    """The validated SMP config (``smp.state.cfg`` reads it)."""
    plan: Plan
    """The translator's Plan this run follows."""
    launch: LaunchEnv
    """Ranks, world and rendezvous as the launcher gave them."""
    groups: ProcessGroups
    """The topology's process groups (world, dp, rdp, pp, tp, mp)."""
    context: ParallelContext
    """What ``smp.nn``'s building blocks are built in: the tensor-parallel group with its random stream."""
    mics_groups: MicsGroups | None
    """The shard and replica groups of sharded data parallelism; None without it."""
    backend_name: str
    """The collective backend (gloo, nccl, mpi)."""
    compile_model: bool
    """``SMP2DS_COMPILE=1`` as ``smp.init`` read it: DeepSpeed's ``engine.compile()`` before the first step."""

    @property
    def topology(self) -> Topology:
        return self.groups.topology

    def with_context(self, context: ParallelContext) -> Runtime:
        """This runtime with another tensor-parallel context (``smp.reset``'s restarted random streams)."""
        return dataclasses.replace(self, context=context)
