"""Which engine backend runs a configuration: decided once, here, by the planner.

The Plan carries the choice (``/engine/backend``), ``smp2ds explain`` shows it, and the engine's
composition root (``engine/api/backend_factory.py``, ``make_backend``) builds exactly the backend it names, so
what ``explain`` says and what runs cannot disagree. Pure: names only, the engine maps each to its class.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

BackendName = Literal["pipeline", "tensor-parallel+mics", "tensor-parallel", "mics", "deepspeed-data-parallel"]

BACKENDS: tuple[BackendName, ...] = (
    "pipeline",
    "tensor-parallel+mics",
    "tensor-parallel",
    "mics",
    "deepspeed-data-parallel",
)
"""Every backend the engine has, in the order the choice tries them."""


@dataclass(frozen=True, kw_only=True)
class BackendChoice:
    """The backend for one Plan and why (one sentence for people). A name only: the parallelisms it composes are the
    Plan's own sections (``EngineSettings.pipeline`` / ``tensor_parallel`` / ``mics``), which the engine reads."""

    name: BackendName
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_backend(*, pipeline: bool, tensor_parallel: bool, mics: bool) -> BackendChoice:
    """The backend for a Plan whose engine enables these parallelisms (the planner's flags)."""
    if pipeline:
        return BackendChoice(name="pipeline", reason=(
            "pipeline_parallel_degree > 1: DeepSpeed's pipeline engine (stages sharded over their "
            "tensor-parallel group when tensor_parallel_degree > 1)"))
    if tensor_parallel and mics:
        return BackendChoice(name="tensor-parallel+mics", reason=(
            "tensor_parallel_degree > 1 with sharded_data_parallel_degree > 1: tensor-parallel shards, "
            "ZeRO-3 over shard groups inside the reduced-data-parallel group"))
    if tensor_parallel:
        return BackendChoice(name="tensor-parallel", reason=(
            "tensor_parallel_degree > 1: tensor-parallel shards, DeepSpeed DDP or ZeRO-1 over the "
            "reduced-data-parallel group"))
    if mics:
        return BackendChoice(name="mics", reason=(
            "sharded_data_parallel_degree > 1: ZeRO-3 inside shard groups, replicated across them (MiCS)"))
    return BackendChoice(name="deepspeed-data-parallel", reason=(
        "no model parallelism: one DeepSpeed engine, DDP (ZeRO-1 with shard_optimizer_state)"))
