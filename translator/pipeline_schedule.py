"""Which DeepSpeed pipeline schedule runs an SMP training step (pure; the engine obeys it).

SMP's ``pipeline`` (``interleaved`` / ``simple``) and ``active_microbatches`` decide it; the
Plan carries the decision in ``/engine/pipeline`` (:class:`PipelineSection`) so the engine derives
nothing itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

ScheduleKind = Literal["1f1b", "gpipe"]


@dataclass(frozen=True, kw_only=True)
class ScheduleChoice:
    """Which DeepSpeed `PipeSchedule` runs a training step, and why.

    ``kind`` is ``"1f1b"`` (DeepSpeed's `TrainSchedule`) or ``"gpipe"`` (our all-forwards-then-
    all-backwards schedule, run over groups of ``group_size`` micro-batches). ``max_in_flight``
    is the most micro-batches whose activations one stage holds at once under that schedule.
    """

    kind: ScheduleKind
    group_size: int
    max_in_flight: int
    note: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class PartitionSettings:
    """How modules are split over the stages (the Plan's ``/engine/pipeline/partition``)."""

    auto: bool = True
    """SMP's ``auto_partition``."""
    memory_weight: float = 0.8
    """w in cost = w * memory + (1 - w) * compute (SMP's ``memory_weight``)."""
    default_partition: int | None = None
    """Stage of modules not assigned with ``smp.partition`` when ``auto`` is off."""


@dataclass(frozen=True, kw_only=True)
class PipelineSection:
    """The Plan's ``/engine/pipeline`` (defaults here are the only ones: no pipeline). A Section, not
    Settings: the runner's own view of it is ``smp2ds.engine.pipeline.settings.PipelineSettings``."""

    enabled: bool = False
    stages: int = 1
    """``pipeline_parallel_degree`` (alias ``partitions``)."""
    schedule: str = "1f1b"
    """``schedule_choice.kind``, or ``forward_only`` for SMP's internal ``_only_forward``."""
    schedule_choice: ScheduleChoice = field(default_factory=lambda: choose_schedule("interleaved", 1, 1, 1))
    microbatches: int = 1
    active_microbatches: int = 1
    partition: PartitionSettings = field(default_factory=PartitionSettings)


def choose_schedule(pipeline: str, microbatches: int, active: int, pp: int) -> ScheduleChoice:
    """Map SMP's ``pipeline`` / ``active_microbatches`` onto a DeepSpeed schedule (SMP semantics).

    * ``simple`` with ``active_microbatches == microbatches``: GPipe over all micro-batches.
    * ``simple`` otherwise: SMP itself forces ``interleaved`` (its config loader does), so do we.
    * ``interleaved``: DeepSpeed's 1F1B keeps at most ``min(pp - stage, microbatches)`` micro-
      batches in flight on a stage, i.e. at most ``min(pp, microbatches)``; when
      ``active_microbatches`` allows that many, 1F1B honours the cap as is. A smaller cap cannot
      be met by 1F1B, so the step runs GPipe over groups of ``active_microbatches`` micro-batches
      (never more in flight; same gradients, a larger bubble).
    """
    m, a = microbatches, active
    if pipeline == "simple" and a == m:
        return ScheduleChoice(kind="gpipe", group_size=m, max_in_flight=m,
                              note=f"simple: all {m} forwards, then all {m} backwards (GPipe)")
    forced = ""
    if pipeline == "simple":
        forced = (f"pipeline 'simple' forced to 'interleaved' because active_microbatches({a}) != "
                  f"microbatches({m}), as SMP does; ")
    need = min(pp, m)
    if a >= need:
        return ScheduleChoice(kind="1f1b", group_size=m, max_in_flight=need,
                              note=forced + f"interleaved: DeepSpeed 1F1B, at most {need} micro-batches in "
                              f"flight per stage (active_microbatches={a} honoured)")
    return ScheduleChoice(kind="gpipe", group_size=a, max_in_flight=a,
                          note=forced + f"interleaved with active_microbatches({a}) < {need}: 1F1B would hold "
                          f"{need} in flight, so GPipe runs in groups of {a} micro-batches")
