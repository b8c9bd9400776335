"""The SMP keys the pipeline reads, validated once, plus the schedule decision.

`PipelineSettings.from_config` accepts the translator's `SMPConfig` (attribute access) or a plain
mapping of canonical SMP v1 keys, so the pipeline can be built and tested without `smp.init`.
Everything here is pure Python: no torch, no process groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from smp2ds.translator.issues import Issue, SMPConfigError

ScheduleKind = Literal["1f1b", "gpipe"]

_DEFAULTS: dict[str, Any] = {
    "pipeline_parallel_degree": 1,
    "tensor_parallel_degree": 1,
    "microbatches": 1,
    "active_microbatches": None,
    "pipeline": "interleaved",
    "auto_partition": True,
    "default_partition": None,
    "memory_weight": 0.8,
    "placement_strategy": "cluster",
    "sharded_data_parallel_degree": 1,
}


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


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """SMP pipeline keys with defaults resolved (see smp-config.md section 2.1)."""

    pp: int
    """``pipeline_parallel_degree`` (alias ``partitions``): number of stages."""
    microbatches: int
    """Micro-batches per step = DeepSpeed ``gradient_accumulation_steps``."""
    active_microbatches: int
    """SMP's cap on micro-batches in flight (default ``pp + 2`` clamped to ``microbatches``)."""
    pipeline: str
    """``interleaved`` (1F1B) or ``simple`` (GPipe)."""
    auto_partition: bool
    default_partition: int | None
    memory_weight: float
    """w in cost = w * memory + (1 - w) * compute."""
    placement_strategy: str
    tensor_parallel_degree: int
    schedule: ScheduleChoice

    @classmethod
    def from_config(cls, cfg: Any, ds_config: Mapping[str, Any] | None = None) -> PipelineSettings:
        """Read the pipeline keys from an `SMPConfig` or a mapping; raise `SMPConfigError` on misuse.

        ``ds_config`` (the DeepSpeed config the engine will use) is checked for a ZeRO stage the
        pipeline engine cannot run with (2 and 3).
        """
        get = _getter(cfg)
        pp, m = get("pipeline_parallel_degree"), get("microbatches")
        active = get("active_microbatches")
        if active is None:
            active = max(1, min(pp + 2, m))
        issues = _check(cfg, get, pp, m, active, ds_config or {})
        if issues:
            raise SMPConfigError(issues)
        return cls(
            pp=pp, microbatches=m, active_microbatches=active, pipeline=get("pipeline"),
            auto_partition=bool(get("auto_partition")), default_partition=get("default_partition"),
            memory_weight=float(get("memory_weight")), placement_strategy=get("placement_strategy"),
            tensor_parallel_degree=get("tensor_parallel_degree"),
            schedule=choose_schedule(get("pipeline"), m, active, pp),
        )


def _getter(cfg: Any):
    def get(key: str) -> Any:
        if isinstance(cfg, Mapping):
            value = cfg.get(key, _DEFAULTS[key])
            if key == "pipeline_parallel_degree" and key not in cfg:
                value = cfg.get("partitions", value)
            return value
        try:
            return getattr(cfg, key)
        except AttributeError:
            return _DEFAULTS[key]

    return get


def _pointer(cfg: Any, key: str) -> str:
    pointers = getattr(cfg, "pointers", None) or {}
    if key == "pipeline_parallel_degree" and key not in pointers and "partitions" in pointers:
        return pointers["partitions"]
    return pointers.get(key, f"/{key}")


def _check(cfg: Any, get, pp: int, m: int, active: int, ds_config: Mapping[str, Any]) -> list[Issue]:
    issues: list[Issue] = []
    at = lambda key: _pointer(cfg, key)
    if not isinstance(pp, int) or pp < 2:
        issues.append(Issue(at("pipeline_parallel_degree"), "the pipeline engine needs at least 2 stages",
                            given=pp, allowed="2 or more", hint="with 1 stage the engine uses plain data parallelism"))
    if get("pipeline") == "_only_forward":
        issues.append(Issue(at("pipeline"), "'_only_forward' (an undocumented SMP mode) is not supported",
                            given="_only_forward", allowed="interleaved, simple",
                            hint="train with 'interleaved'; evaluate after model.eval(), which runs forward only"))
    elif get("pipeline") not in ("interleaved", "simple"):
        issues.append(Issue(at("pipeline"), "unknown pipeline schedule", given=get("pipeline"),
                            allowed="interleaved, simple"))
    if not 1 <= active <= m:
        issues.append(Issue(at("active_microbatches"), f"must be between 1 and microbatches({m})", given=active,
                            allowed=f"1..{m}"))
    if get("tensor_parallel_degree") != 1:
        issues.append(Issue(at("tensor_parallel_degree"),
                            "tensor parallelism inside pipeline stages is not supported by smp2ds yet",
                            given=get("tensor_parallel_degree"), allowed="1 when pipeline_parallel_degree > 1",
                            hint="use pipeline x data parallelism, or tensor parallelism without a pipeline"))
    if not get("auto_partition"):
        dp_ = get("default_partition")
        if dp_ is None or not (isinstance(dp_, int) and 0 <= dp_ < pp):
            issues.append(Issue(at("default_partition"), "auto_partition: false needs a default_partition",
                                given=dp_, allowed=f"0..{pp - 1}"))
    w = get("memory_weight")
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.0 <= float(w) <= 1.0:
        issues.append(Issue(at("memory_weight"), "must be a number in [0, 1]", given=w, allowed="0.0..1.0"))
    issues += _zero_issues(cfg, get, ds_config)
    return issues


def _zero_issues(cfg: Any, get, ds_config: Mapping[str, Any]) -> list[Issue]:
    sdp = get("sharded_data_parallel_degree")
    if isinstance(sdp, int) and sdp > 1:
        return [Issue(_pointer(cfg, "sharded_data_parallel_degree"),
                      "sharded data parallelism (ZeRO-3) cannot be combined with pipeline parallelism",
                      given=sdp, allowed="1 when pipeline_parallel_degree > 1",
                      hint="use shard_optimizer_state: true (ZeRO-1) with a pipeline")]
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage >= 2:
        return [Issue("/deepspeed/zero_optimization/stage",
                      f"ZeRO stage {stage} cannot run with DeepSpeed's pipeline engine (it partitions gradients)",
                      given=stage, allowed="0 or 1 with pipeline_parallel_degree > 1",
                      hint="drop the override or use shard_optimizer_state: true (ZeRO-1)")]
    return []
