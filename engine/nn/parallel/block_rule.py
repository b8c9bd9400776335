"""How one Hugging Face transformer block class is sharded Megatron-style in place: the data each model
family's module declares (``smp2ds.engine.nn.huggingface``) and the tensor-parallel package applies."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockRule:
    """How to shard one transformer block class."""

    family: str
    column: tuple[str, ...]
    """Projections that become column-parallel (query, key, value, the MLP's up/gate)."""
    row: tuple[str, ...]
    """Projections that become row-parallel (attention output, MLP down)."""
    heads: tuple[str, ...]
    """``path.attr`` of per-rank sizes the attention reads (head counts, split sizes); divided by tp."""
    fused: dict[str, int] = field(default_factory=dict)
    """Column projections holding several equal blocks (q, k, v) side by side."""
    conv1d: bool = False
    """The projections are transformers' ``Conv1D`` (weight stored input features first), not ``nn.Linear``."""
