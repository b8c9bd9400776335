"""Tensor parallelism: SMP ``tensor_parallel_degree``, ``tensor_parallel_seed``, ``prescaled_batch``.

The engine runs its own Megatron-style sharding (``smp2ds.engine.tensor_parallel``): column- and
row-parallel layers made in place from the model's own modules, with DeepSpeed running data
parallelism over the reduced-data-parallel group and, with ``pipeline_parallel_degree`` > 1, the
pipeline stages (its topology's model axis is the tensor-parallel group), or ZeRO-3 / MiCS over
shard groups with ``sharded_data_parallel_degree`` > 1. One combination is not implemented and is
refused (the keymap's reason and ``smp.init``'s message): tensor parallelism with sharded data
parallelism and ``prescaled_batch: false``. The DeepSpeed ``tensor_parallel`` (AutoTP) block stays
empty: the engine's sharding is not DeepSpeed's AutoTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

TP_ENGINE = (
    "Megatron-style tensor parallelism by the smp2ds engine: modules marked with smp.tensor_parallelism / "
    "model_creation(tensor_parallelism=True) are sharded in place (column/row-parallel linears, Hugging Face "
    "blocks by structure, smp.nn.DistributedLinear/DistributedEmbedding); DeepSpeed runs data parallelism over "
    "the reduced-data-parallel group through an mpu whose model-parallel group is the tensor-parallel group, and "
    "pipeline stages (pipeline_parallel_degree > 1) on a topology whose model axis is the tensor-parallel group"
)
TP_WITH_SDP_UNSUPPORTED = (
    "tensor parallelism combined with sharded_data_parallel_degree > 1 needs prescaled_batch: true (SMP 1.15's "
    "requirement for this combination); smp2ds does not implement it with prescaled_batch false, where every "
    "tensor-parallel rank brings its own batch; set prescaled_batch: true (the tensor-parallel group shares one "
    "batch, sharded by rdp_rank)"
)


def refusal(params: Mapping[str, Any]) -> str | None:
    """Why this tensor-parallel layout is refused, or None when the engine runs it."""
    if params.get("tensor_parallel_degree", 1) <= 1:
        return None
    if params.get("sharded_data_parallel_degree", 1) > 1 and not params.get("prescaled_batch", False):
        return TP_WITH_SDP_UNSUPPORTED
    return None


def runs(params: Mapping[str, Any]) -> bool:
    """True when the engine runs tensor parallelism for these parameters."""
    return params.get("tensor_parallel_degree", 1) > 1 and refusal(params) is None


def tensor_parallel_block(params: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed ``tensor_parallel`` block: empty (the engine shards; DeepSpeed's AutoTP is not used)."""
    return {}


@dataclass(frozen=True, kw_only=True)
class TensorParallelSettings:
    """The engine's tensor-parallel settings (the Plan's ``/engine/tensor_parallel``). The defaults
    here are the only ones: the engine reads them as ``Plan.engine_settings.tensor_parallel``."""

    enabled: bool = False
    degree: int = 1
    implementation: str | None = None
    unsupported: str | None = None
    seed: int = 0
    prescaled_batch: bool = False
    optimize: str = "speed"
    """SMP's ``optimize``: 'memory' splits the distributed transformer's sequence over the group."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def engine_tensor_parallel(params: Mapping[str, Any], seed: int | None = None) -> TensorParallelSettings:
    """Engine settings for tensor parallelism (``seed``: SMP v2 ``random_seed`` overrides v1's seed)."""
    tp = params.get("tensor_parallel_degree", TensorParallelSettings.degree)
    return TensorParallelSettings(
        enabled=tp > 1,
        degree=tp,
        implementation="smp2ds-megatron" if runs(params) else None,
        unsupported=refusal(params),
        seed=params.get("tensor_parallel_seed", TensorParallelSettings.seed) if seed is None else seed,
        prescaled_batch=bool(params.get("prescaled_batch", TensorParallelSettings.prescaled_batch)),
        # memory: smp.nn's distributed transformer splits the sequence over the group (sequence parallelism)
        optimize=str(params.get("optimize") or TensorParallelSettings.optimize),
    )
