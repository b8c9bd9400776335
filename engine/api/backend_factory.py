"""The composition root of the API floor (``tests/test_import_graph.py``: the parallelism packages never import
each other, only ``api/`` imports them all): the backend for a ``DistributedModel``, the one the Plan names (the
planner chooses, :mod:`smp2ds.translator.backend_choice`, so ``smp2ds explain`` shows what runs), and the few things
a parallelism package owns that the API needs before or besides it.

Here the parallelisms are composed, so that no parallelism package imports another: with tensor
parallelism the model first goes through :func:`smp2ds.engine.tensor_parallel.parallelize.parallelize`
(sharded in place; one path for every layout), and the backend that drives the DeepSpeed engine gets
the sharded model's view. Backends, by the Plan's ``/engine/backend/name``:

* ``pipeline``: :class:`smp2ds.engine.pipeline.backend.PipelineBackend` (DeepSpeed's pipeline engine;
  with tensor parallelism the whole model is sharded before the stages are cut);
* ``deepspeed-data-parallel``: :class:`smp2ds.engine.data_parallel.backend.DataParallelBackend` with
  :class:`~smp2ds.engine.data_parallel.replicated.ReplicatedParameters` (DDP, or ZeRO-1 for
  ``shard_optimizer_state``);
* ``tensor-parallel``: the same with the sharded model (DDP or ZeRO-1 over the reduced-data-parallel
  group, DeepSpeed's ``mpu`` from the view);
* ``mics``: :class:`~smp2ds.engine.data_parallel.backend.DataParallelBackend` with
  :class:`~smp2ds.engine.mics.sharding.MicsSharding` (ZeRO-3 inside shard groups);
* ``tensor-parallel+mics``: the same with the sharded model (shard groups inside the rdp group; a model
  born partitioned is sharded block by block, :mod:`smp2ds.engine.mics.born_partitioned`).

Besides: ``smp.init``'s set-up of the pipeline's partition registry and the MiCS shard groups
(:func:`prepare_groups`), SMP's distributed-transformer replacement of a wrapped model
(:func:`prepare_module`), and tensor parallelism's marks on parameters (:data:`parameter_roles`).

Backend modules are imported only when chosen (start-up time): the pipeline one pulls in
DeepSpeed's pipeline package, which plain data-parallel scripts never need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from smp2ds.engine.core.backend import Backend
from smp2ds.engine.core.launch_env import LaunchEnv
from smp2ds.engine.core.parameter_sharding import ParameterSharding
from smp2ds.engine.core.runtime import Runtime
from smp2ds.engine.core.tensor_parallel_view import TensorParallelView
from smp2ds.engine.exceptions import SMPInvalidArgumentError
from smp2ds.translator.plan_types import Plan
from smp2ds.translator.topology import Topology

if TYPE_CHECKING:  # the MiCS package is imported only when sharded data parallelism is on (start-up)
    from smp2ds.engine.mics.shard_groups import MicsGroups

# DistributedModel's is_distributed_* / is_scaled_batch_* queries read tensor parallelism's marks
# (false everywhere when nothing is marked); a light module (torch only), so imported at once.
from smp2ds.engine.nn.parallel import introspect as parameter_roles
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.translator.backend_choice import BACKENDS

__all__ = ["make_backend", "parameter_roles", "prepare_groups", "prepare_module"]


def make_backend(module: torch.nn.Module, runtime: Runtime) -> Backend:
    """The backend the Plan names (``/engine/backend/name``, the planner's choice that ``smp2ds explain`` shows),
    built from ``runtime`` (``smp.init``'s) alone: its Plan, process groups, tensor-parallel context and MiCS
    groups."""
    # Each return below is where mypy (.ci/typecheck) checks that backend class against the protocol.
    plan, groups, context = runtime.plan, runtime.groups, runtime.context
    choice = plan.engine_settings.backend
    if choice.name not in BACKENDS:
        raise SMPInvalidArgumentError(f"the Plan's /engine/backend/name is {choice.name!r}; this engine has the "
                                      f"backends {', '.join(BACKENDS)} (was the Plan made by another smp2ds version?)")
    settings = plan.engine_settings
    microbatches = settings.microbatches
    # Composed from the Plan's typed sections (the choice's name is what they add up to): which engine runs the
    # model, whether the model is sharded over tensor-parallel groups first, and where the parameters live.
    if settings.pipeline.enabled:
        from smp2ds.engine.pipeline.backend import PipelineBackend  # start-up: DeepSpeed's pipeline package

        return PipelineBackend(module, plan=plan, groups=groups, microbatches=microbatches,
                               tensor_parallel=_parallelize(module, context))
    from smp2ds.engine.data_parallel.backend import DataParallelBackend  # start-up: only when chosen

    plan_ds = dict(plan.deepspeed)
    sharding: ParameterSharding
    if settings.mics.enabled:
        from smp2ds.engine.mics.born_partitioned import sharding_around  # start-up: only when chosen
        from smp2ds.engine.mics.sharding import MicsSharding  # start-up: only when chosen

        mics_groups = runtime.mics_groups
        assert mics_groups is not None  # smp.init prepares them whenever the Plan enables MiCS (prepare_groups)

        view = None
        if settings.tensor_parallel.enabled:  # a model born partitioned is sharded block by block
            view = _parallelize(module, context,
                                around=sharding_around(module, plan_ds, microbatches, mics_groups))
        sharding = MicsSharding(mics_groups, view)
    else:
        from smp2ds.engine.data_parallel.replicated import ReplicatedParameters  # start-up: with that backend

        rdp = (groups.coords.rdp_rank, groups.topology.rdp)  # where ZeRO-1 partitions the optimizer state
        view = _parallelize(module, context) if settings.tensor_parallel.enabled else None
        sharding = ReplicatedParameters(rdp, mpu=view.deepspeed_mpu(groups) if view is not None else None,
                                        tensor_parallel=view)
    return DataParallelBackend(module, plan_ds, microbatches=microbatches, sharding=sharding)


def _parallelize(module: torch.nn.Module, context: ParallelContext, around: Any = None) -> TensorParallelView:
    """The tensor-parallel package's one entry: ``module`` sharded over ``context``'s group (nothing at degree 1)."""
    from smp2ds.engine.tensor_parallel.parallelize import parallelize  # start-up: only when a backend is built

    return parallelize(module, context, around=around)


def prepare_module(module: torch.nn.Module, context: ParallelContext) -> torch.nn.Module:
    """SMP's distributed transformer replaces marked Hugging Face models (any tp degree) before the
    backend is built, in ``context``; unmarked modules come back unchanged, without loading the replacement at
    all."""
    if all(marks.mark_of(m) is None for m in module.modules()):
        return module  # plain models (DDP, sdp, pipelines without smp.tensor_parallelism) have no mark
    # start-up: the replacement reads transformers' model classes
    from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked

    return replace_marked(module, context)


def prepare_groups(plan: Plan, topology: Topology, launch: LaunchEnv) -> MicsGroups | None:
    """``smp.init``'s share of the parallelism packages: the pipeline's partition registry learns
    the stage count (``smp.partition(i)`` then rejects ``i >= pp`` at once), and sharded data
    parallelism's shard/replica groups are created (collective), because
    ``smp.delay_param_initialization()`` needs them before the model is wrapped. Shard size, ranks
    per node and the hierarchical all-gather decision are the Plan's. Returns the MiCS groups, or None."""
    settings = plan.engine_settings  # smp2ds.translator.engine_settings.EngineSettings
    if settings.pipeline.enabled:
        from smp2ds.engine.pipeline import manual  # start-up: pipeline scripts only

        manual.configure(topology.pp)
    mics = settings.mics
    if not mics.enabled:
        return None
    from smp2ds.engine.mics.shard_groups import MicsGroups  # start-up: sharded data parallelism only

    return MicsGroups.create(
        topology,
        mics.shard_size,
        rank=launch.rank,
        ranks_per_node=plan.topology_settings.ranks_per_node,
        hierarchical=mics.hierarchical_allgather,
    )
