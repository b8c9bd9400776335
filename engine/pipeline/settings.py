"""The pipeline settings the runner uses: the translator's decisions, read from the Plan.

The engine derives nothing the translator owns: stages, micro-batches, the schedule (see
:mod:`smp2ds.translator.pipeline_schedule`) and the partition rules come from
``plan.engine_settings.pipeline``. Pure Python: no torch, no process groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smp2ds.translator import normalize
from smp2ds.translator.issues import Issue, SMPConfigError
from smp2ds.translator.pipeline_schedule import PipelineSection, ScheduleChoice, choose_schedule
from smp2ds.translator.plan_types import Layout, Plan
from smp2ds.translator.planner import plan as make_plan

__all__ = ["PipelineSettings", "ScheduleChoice", "choose_schedule", "plan_for"]


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """The pipeline decisions of the Plan (``/engine/pipeline``), as the runner uses them."""

    pp: int
    """``pipeline_parallel_degree`` (alias ``partitions``): number of stages."""
    microbatches: int
    """Micro-batches per step = DeepSpeed ``gradient_accumulation_steps``."""
    active_microbatches: int
    """SMP's cap on micro-batches in flight (default ``pp + 2`` clamped to ``microbatches``)."""
    auto_partition: bool
    default_partition: int | None
    memory_weight: float
    """w in cost = w * memory + (1 - w) * compute."""
    schedule: ScheduleChoice

    @classmethod
    def from_plan(cls, plan: Plan) -> PipelineSettings:
        """Read the translator's decisions; refuse a DeepSpeed ZeRO stage the pipeline engine cannot run."""
        pipe: PipelineSection = plan.engine_settings.pipeline
        issues = _zero_issues(plan.deepspeed)
        if issues:
            raise SMPConfigError(issues)
        part = pipe.partition
        return cls(pp=pipe.stages, microbatches=pipe.microbatches, active_microbatches=pipe.active_microbatches,
                   auto_partition=part.auto, default_partition=part.default_partition,
                   memory_weight=float(part.memory_weight), schedule=pipe.schedule_choice)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], ds_overrides: Mapping[str, Any] | None = None,
                    world_size: int | None = None) -> PipelineSettings:
        """Plan an SMP parameter dict with the translator, then :meth:`from_plan` (tests, benchmarks).

        Configuration errors are the translator's (every problem, with pointers); keys it reports
        as unsupported are refused as ``smp.init`` refuses them. ``ds_overrides`` are merged into
        the planned DeepSpeed config (a user's DeepSpeed-only settings).
        """
        return cls.from_plan(plan_for(cfg, world_size, ds_overrides))


def plan_for(cfg: Mapping[str, Any], world_size: int | None = None,
             ds_overrides: Mapping[str, Any] | None = None) -> Any:
    """The translator's Plan for an SMP parameter dict on ``world_size`` ranks (default: pp x tp)."""

    if world_size is None:
        pp = cfg.get("pipeline_parallel_degree", cfg.get("partitions", 1))
        world_size = int(pp) * int(cfg.get("tensor_parallel_degree", 1))
    layout = Layout(world_size=world_size, gpus_per_node=world_size)
    config = normalize(dict(cfg), layout)
    result = make_plan(config, layout)
    result.raise_if_unsupported()
    if ds_overrides:
        result = dataclasses.replace(result, deepspeed={**result.deepspeed, **ds_overrides})
    return result


def _zero_issues(ds_config: Mapping[str, Any]) -> list[Issue]:
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage >= 2:
        return [Issue("/deepspeed/zero_optimization/stage",
                      f"ZeRO stage {stage} cannot run with DeepSpeed's pipeline engine (it partitions gradients)",
                      given=stage, allowed="0 or 1 with pipeline_parallel_degree > 1",
                      hint="drop the override or use shard_optimizer_state: true (ZeRO-1)")]
    return []
