"""Pipeline parallelism (SMP ``pipeline_parallel_degree > 1``) on DeepSpeed's pipeline engine.

Integration surface for the engine core (``smp.init`` / ``DistributedModel`` / ``smp.step`` /
``DistributedOptimizer``)::

    from smp2ds.engine import pipeline

    # smp.init: let smp.partition(i) reject indices >= pp immediately
    pipeline.configure_partitions(cfg.pipeline_parallel_degree)

    # DistributedModel(module) when pp > 1 (collective over the world: creates groups)
    runner = pipeline.build_pipeline(module, plan, topology)
    #   plan: the translator's Plan (pipeline.plan_for(cfg_dict) for tests)
    #   topology: smp2ds.translator.topology.Topology
    #   -> raises SMPConfigError (ZeRO-2/3 override), UnsupportedModelError (a model torch.fx cannot
    #      trace or cut; the named families and nn.Sequential always have a layer list)

    # DistributedOptimizer(opt): keep this stage's parameters; before the first step
    runner.attach_optimizer(opt)
    runner.optimizer                 # the optimizer DeepSpeed steps (ZeRO-1 wrapper if sharded)

    # smp.step: split inputs into micro-batches, then
    per_mb = runner.run_step(fn, [(args_i, kwargs_i) for each micro-batch], reduce_grads=True)
    #   -> list (one entry per micro-batch) of fn's return values, detached, identical on every
    #      rank of the pipeline; build StepOutput from it. runner.last_losses: per-micro-batch
    #      losses given to model.backward, also on every pipeline rank.

    # inside fn: DistributedModel.__call__ -> runner(*a, **k); DistributedModel.backward -> runner.backward(loss)
    # optimizer.step() -> runner.optimizer_step();  optimizer.zero_grad() -> runner.zero_grad()
    # model.train()/eval() -> runner.train(mode)
    # state: runner.state_dict() (full; collective over the pipeline group), runner.local_state_dict(),
    #        runner.load_state_dict(sd, strict), runner.local_named_parameters(), runner.local_modules()
    # explain/log: runner.partition.describe() (one line), runner.partition.to_dict(),
    #              runner.settings.schedule.note (which schedule, active_microbatches' fate)

Supported step functions: ``out = model(...)`` then a loss computed from ``out`` (any code) or
taken from it (Hugging Face ``labels`` -> ``out.loss``), then ``model.backward(loss)``; one
model call per step function. As in SMP the step runs with the first stage's arguments (scripts
may pass dummies on the other stages; `step_inputs`). Models: the families in ``families/`` and
any other module whose forward ``torch.fx`` traces (``families/traced``, `fx_trace`,
`fx_segments`). See `runner` for what runs where.
"""

from __future__ import annotations

import torch

from smp2ds.engine.pipeline import families  # noqa: F401  (registers the built-in layer lists)
from smp2ds.engine.pipeline.layers import SUPPORTED, LayerList, PipeLayer, UnsupportedModelError, build_layer_list
from smp2ds.engine.pipeline.manual import clear as clear_partitions
from smp2ds.engine.pipeline.manual import configure as configure_partitions
from smp2ds.engine.pipeline.manual import partition, set_partition
from smp2ds.engine.pipeline.partition_plan import PartitionPlan, StageInfo, plan_partition
from smp2ds.engine.pipeline.runner import PipelineRunner
from smp2ds.engine.pipeline.settings import PipelineSettings, ScheduleChoice, choose_schedule, plan_for
from smp2ds.translator.plan_types import Plan
from smp2ds.translator.topology import Topology

__all__ = [
    "SUPPORTED",
    "LayerList",
    "PartitionPlan",
    "PipeLayer",
    "PipelineRunner",
    "PipelineSettings",
    "ScheduleChoice",
    "StageInfo",
    "UnsupportedModelError",
    "build_layer_list",
    "build_pipeline",
    "choose_schedule",
    "clear_partitions",
    "configure_partitions",
    "partition",
    "plan_for",
    "plan_partition",
    "set_partition",
]


def build_pipeline(model: torch.nn.Module, plan: Plan, topology: Topology) -> PipelineRunner:
    """Split ``model`` into pipeline stages and return the runner that trains it.

    Must be called on every rank at the same point (it creates process groups). ``plan`` is the
    translator's Plan (``PipelineSettings.plan_for(cfg_dict, world_size)`` makes one from an SMP
    parameter dict): the stages, schedule and partition rules come from ``plan.engine_settings.pipeline``
    and the DeepSpeed config from ``plan.deepspeed``; its batch keys are filled in at the first
    step, when the micro-batch size is known.
    """
    settings = PipelineSettings.from_plan(plan)
    return PipelineRunner(model, settings, topology, dict(plan.deepspeed))
