"""The engine's part of the Plan as frozen dataclasses: :class:`EngineSettings` and its sections.

The planner builds an :class:`EngineSettings` and stores its :meth:`~EngineSettings.to_dict` as
``Plan.engine`` (the JSON that ``smp2ds convert`` / ``explain`` print); the engine reads
``Plan.engine_settings``, the same settings parsed back once. Every default lives in a dataclass
field of this module or of the section's own module (tensor_parallel, sharded_data, batch,
pipeline_schedule, precision, activation, backend_choice); no reader supplies one of its own.
Pure: no torch.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

from .activation import ActivationSettings
from .backend_choice import BackendChoice, choose_backend
from .batch import BatchSettings, plan_batch
from .pipeline_schedule import PipelineSection
from .precision import PrecisionSettings
from .sharded_data import MicsSettings
from .tensor_parallel import TensorParallelSettings
from .topology import placement_order

Section = TypeVar("Section")


@dataclass(frozen=True, kw_only=True)
class PlacementSettings:
    """The Plan's ``/engine/placement``: SMP's ``placement_strategy`` and the rank order it means."""

    strategy: str = "cluster"
    order: str = placement_order("cluster")
    """Three letters, outermost axis first (``D`` data, ``P`` pipeline, ``T`` tensor)."""


@dataclass(frozen=True, kw_only=True)
class ProcessGroupSettings:
    """The Plan's ``/engine/process_group``: SMP's ``ddp_dist_backend`` and ``ddp_port``."""

    backend: str = "auto"
    """``auto`` (nccl with CUDA, else gloo), ``nccl`` or ``gloo``."""
    port: int | None = None
    """Rendezvous port; None: the launcher's."""


@dataclass(frozen=True, kw_only=True)
class DataParallelSettings:
    """The Plan's ``/engine/data_parallel``: replicas are data-parallel whatever SMP flag asked for them."""

    enabled: bool = False
    rdp_degree: int = 1
    """Reduced data-parallel degree: world / (pp x tp)."""
    dp_degree: int = 1
    """Data-parallel degree: world / pp (tensor-parallel peers count)."""
    ddp_api: bool = False
    """SMP's ``ddp: true``: ``DistributedModel.module`` is its data-parallel wrapper and the data-parallel process
    groups are exposed (``smp.get_dp_process_group()`` ...); without it SMP refuses them."""


def _no_batch() -> BatchSettings:
    return BatchSettings.of(plan_batch(per_rank_batch=None, microbatches=1, tp=1, rdp=1),
                            prescaled_batch=False, source=None)


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Everything the engine takes from the Plan (``/engine``), one typed section per concern.

    The defaults describe one process with no parallelism and no known batch.
    """

    backend: BackendChoice = field(
        default_factory=lambda: choose_backend(pipeline=False, tensor_parallel=False, mics=False)
    )
    smp_version: int = 1
    strategy: str = "modelparallel"
    """``modelparallel`` (SMP) or ``dataparallel`` (``smdistributed.dataparallel``)."""
    microbatches: int = 1
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    process_group: ProcessGroupSettings = field(default_factory=ProcessGroupSettings)
    data_parallel: DataParallelSettings = field(default_factory=DataParallelSettings)
    batch: BatchSettings = field(default_factory=_no_batch)
    zero_stage: int = 0
    mics: MicsSettings = field(default_factory=MicsSettings)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    tensor_parallel: TensorParallelSettings = field(default_factory=TensorParallelSettings)
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    activation_checkpointing: ActivationSettings = field(default_factory=ActivationSettings)
    delayed_parameter_initialization: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``Plan.engine`` (sections as objects in field order, groups as lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_engine(cls, engine: Mapping[str, Any]) -> EngineSettings:
        """The settings of a Plan's ``engine`` mapping; a missing key takes its default, an
        unknown one (a Plan of another smp2ds version) raises ValueError naming it."""
        return _section(cls, engine, "/engine")


def _plain(value: Any) -> Any:
    """Dataclasses as dicts in field order, tuples as lists: exactly the Plan's JSON values."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def _section(cls: type[Section], value: Any, pointer: str) -> Section:
    """``cls`` from its JSON object at ``pointer``; fields typed as dataclasses are read the same way."""
    if not isinstance(value, Mapping):
        raise ValueError(f"the Plan's {pointer} is {value!r}; an object with the keys of {cls.__name__} is expected")
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]  # cls is a dataclass
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"the Plan's {pointer} has the keys {unknown}, which this smp2ds does not know; "
                         f"{cls.__name__} has {known} (was the Plan made by another smp2ds version?)")
    hints = typing.get_type_hints(cls)
    return cls(**{key: _section(hints[key], item, f"{pointer}/{key}") if is_dataclass(hints[key]) else item
                  for key, item in value.items()})
