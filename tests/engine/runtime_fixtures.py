"""A one-rank ``smp.init`` runtime built in the test process, for unit tests of code that reads ``smp.state``."""

from __future__ import annotations

from typing import Any

from smp2ds.engine.core import launch_env
from smp2ds.engine.core.process_groups import ProcessGroups
from smp2ds.engine.core.runtime import Runtime
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan as make_plan
from smp2ds.translator.topology import Topology


def single_rank_runtime(params: dict[str, Any] | None = None, context: ParallelContext | None = None) -> Runtime:
    """What ``smp.init(params)`` builds on one rank (the config, its Plan, the launch, the topology's
    coordinates), without process groups: nothing here sends a collective."""
    layout = Layout(world_size=1, gpus_per_node=1)
    config = normalize(params or {}, layout)
    topology = Topology.for_world(1)
    return Runtime(config=config, plan=make_plan(config, layout), launch=launch_env.detect({}),
                   groups=ProcessGroups(topology=topology, rank=0, coords=topology.coords(0)),
                   context=context or ParallelContext(), mics_groups=None, backend_name="gloo", compile_model=False)
