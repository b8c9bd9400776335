"""Typed results of the translator: the validated `SMPConfig`, the world `Layout` and the `Plan`.

These are the contracts between schemas/validation, the planner, the CLI and the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Literal

from .engine_settings import EngineSettings
from .issues import Issue, SMPConfigError

SourceKind = Literal["parameters", "distribution", "estimator", "smp_v2"]
Strategy = Literal["modelparallel", "dataparallel"]
Fate = Literal["mapped", "engine", "ignored", "unsupported"]


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, kw_only=True)
class TopologySettings:
    """The Plan's ``/topology`` as the engine reads it: degrees, placement and the machine shape."""

    world_size: int
    pipeline_parallel_degree: int
    tensor_parallel_degree: int
    rdp_degree: int
    sharded_data_parallel_degree: int
    placement: str
    """Three letters, outermost axis first (``D`` data, ``P`` pipeline, ``T`` tensor)."""
    ranks_per_node: int
    nodes: int

    @classmethod
    def from_topology(cls, topology: Mapping[str, Any]) -> TopologySettings:
        """The typed form of a Plan's ``topology`` mapping (the JSON ``smp2ds convert`` prints)."""
        return cls(world_size=int(topology["world_size"]),
                   pipeline_parallel_degree=int(topology["pipeline_parallel_degree"]),
                   tensor_parallel_degree=int(topology["tensor_parallel_degree"]),
                   rdp_degree=int(topology["rdp_degree"]),
                   sharded_data_parallel_degree=int(topology["sharded_data_parallel_degree"]),
                   placement=str(topology["placement"]), ranks_per_node=int(topology["ranks_per_node"]),
                   nodes=int(topology["nodes"]))


@dataclass(frozen=True, kw_only=True)
class LauncherSettings:
    """The Plan's ``/launcher``: the job's hosts and ranks, and each launcher's command line, for the CLI's
    launch scripts and cluster files."""

    script: str
    hosts: tuple[str, ...]
    nodes: int
    ranks_per_node: int
    world_size: int
    master_addr: str
    master_port: int
    deepspeed: tuple[str, ...]
    torchrun: tuple[str, ...]
    mpirun: tuple[str, ...]
    hostfile: str
    env: Mapping[str, str]
    custom_mpi_options: str

    @classmethod
    def from_launcher(cls, launcher: Mapping[str, Any]) -> LauncherSettings:
        """The typed form of a Plan's ``launcher`` mapping."""
        return cls(script=str(launcher["script"]), hosts=tuple(launcher["hosts"]), nodes=int(launcher["nodes"]),
                   ranks_per_node=int(launcher["ranks_per_node"]), world_size=int(launcher["world_size"]),
                   master_addr=str(launcher["master_addr"]), master_port=int(launcher["master_port"]),
                   deepspeed=tuple(launcher["deepspeed"]), torchrun=tuple(launcher["torchrun"]),
                   mpirun=tuple(launcher["mpirun"]), hostfile=str(launcher["hostfile"]),
                   env=_frozen(launcher["env"]), custom_mpi_options=str(launcher["custom_mpi_options"]))

    def command(self, launcher: str) -> tuple[str, ...]:
        """The command line of ``launcher`` (``deepspeed``, ``torchrun`` or ``mpirun``)."""
        return {"deepspeed": self.deepspeed, "torchrun": self.torchrun, "mpirun": self.mpirun}[launcher]


@dataclass(frozen=True, kw_only=True)
class SMPConfig:
    """A validated SMP configuration with aliases resolved and every default filled in.

    Every canonical SMP v1 key (``pipeline_parallel_degree``, ``microbatches``, ``ddp``,
    ``fp16``, ...) is readable as an attribute, exactly as SMP scripts read
    ``smp.state.cfg.<key>``; ``params`` holds the same values as a mapping.
    """

    params: Mapping[str, Any]
    """All canonical v1 keys -> resolved value (user value, else SMP default)."""
    given: Mapping[str, Any] = field(default_factory=dict)
    """Canonical keys the user actually set, with their values (aliases already resolved)."""
    pointers: Mapping[str, str] = field(default_factory=dict)
    """Key as the user spelled it (e.g. ``partitions``) -> JSON pointer of it in the input."""
    kind: SourceKind = "parameters"
    """What the input document was: bare parameters, a distribution dict, an estimator spec, SMP v2."""
    strategy: Strategy = "modelparallel"
    """``smdistributed.modelparallel`` or ``smdistributed.dataparallel`` (plain data parallelism)."""
    smp_version: int = 1
    v2: Mapping[str, Any] = field(default_factory=dict)
    """SMP v2 keys with defaults filled (empty for v1 input)."""
    mpi: Mapping[str, Any] = field(default_factory=dict)
    """The distribution's ``mpi`` block (enabled, processes_per_host, custom_mpi_options)."""
    instance_type: str | None = None
    instance_count: int | None = None
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, Any] = field(default_factory=dict)
    """The estimator's ``environment`` dict (variables of the training container)."""

    def __post_init__(self) -> None:
        for name in ("params", "given", "pointers", "v2", "mpi", "hyperparameters", "environment"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def __getattr__(self, name: str) -> Any:
        params = object.__getattribute__(self, "params")
        if name in params:
            return params[name]
        raise AttributeError(f"SMP config has no key {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The canonical parameter dict (what ``SM_HP_MP_PARAMETERS`` would carry)."""
        return dict(self.params)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The machine layout a plan is made for; unknown fields come from the estimator spec."""

    world_size: int | None = None
    """Total processes; default instance_count x processes_per_host (or GPUs per instance)."""
    gpus_per_node: int | None = None
    """Processes per node; default mpi.processes_per_host, else GPUs of the instance type."""
    batch_size: int | None = None
    """Per-rank batch handed to the ``@smp.step`` function, when known."""


@dataclass(frozen=True, kw_only=True)
class KeyNote:
    """The fate of one input key: where it went, or why it went nowhere."""

    key: str
    """The key as the user spelled it."""
    pointer: str
    """JSON pointer of the key in the input document."""
    value: Any
    fate: Fate
    target: str | None = None
    """For ``mapped``: a pointer into the plan, e.g. ``/deepspeed/zero_optimization/stage``;
    for ``engine``: a pointer into ``/engine``."""
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "pointer": self.pointer,
            "value": self.value,
            "fate": self.fate,
            "target": self.target,
            "reason": self.reason,
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything needed to run an SMP configuration on DeepSpeed (see docs/internals.md#inputs-and-the-plan)."""

    topology: Mapping[str, Any]
    deepspeed: Mapping[str, Any]
    engine: Mapping[str, Any]
    """The engine's settings as JSON (what ``smp2ds convert`` prints); read them as :attr:`engine_settings`."""
    megatron: Mapping[str, Any]
    launcher: Mapping[str, Any]
    notes: tuple[KeyNote, ...]
    remarks: tuple[str, ...] = ()
    """Plan-level notes that belong to no single key (e.g. batch size unknown)."""

    @cached_property
    def topology_settings(self) -> TopologySettings:
        """:attr:`topology` typed, the form the engine reads (parsed once per Plan)."""
        return TopologySettings.from_topology(self.topology)

    @cached_property
    def launcher_settings(self) -> LauncherSettings:
        """:attr:`launcher` typed (parsed once per Plan)."""
        return LauncherSettings.from_launcher(self.launcher)

    @cached_property
    def engine_settings(self) -> EngineSettings:
        """:attr:`engine` as frozen dataclasses, the form the engine reads (parsed once per Plan)."""
        return EngineSettings.from_engine(self.engine)

    def raise_if_unsupported(self) -> None:
        """Refuse every key this plan reports ``unsupported``, with its reason (all at once).

        ``smp.init`` calls this, so what ``smp2ds explain`` calls unsupported is never accepted
        silently at run time and never left to fail later inside DeepSpeed.
        """
        refused = [Issue(n.pointer, f"{n.key} is not supported: {n.reason}", given=n.value)
                   for n in self.notes if n.fate == "unsupported"]
        if refused:
            raise SMPConfigError(refused)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; ``notes`` holds per-key fates and plan-level remarks."""
        return {
            "topology": dict(self.topology),
            "deepspeed": dict(self.deepspeed),
            "engine": dict(self.engine),
            "megatron": dict(self.megatron),
            "launcher": dict(self.launcher),
            "notes": {"keys": [n.to_dict() for n in self.notes], "remarks": list(self.remarks)},
        }
