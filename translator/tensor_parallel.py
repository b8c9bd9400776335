"""Tensor parallelism: SMP ``tensor_parallel_degree``.

The engine does not run tensor parallelism yet, so a plan with ``tensor_parallel_degree > 1``
reports the key ``unsupported`` (reason: :data:`TP_UNSUPPORTED`) and ``smp.init`` refuses it with
the same words. The Megatron section still shows the layout such a run would use. The DeepSpeed
``tensor_parallel`` block stays empty: emitting AutoTP settings the engine does not honour would
be a claim the runtime cannot keep.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TP_UNSUPPORTED = (
    "tensor parallelism is not implemented by smp2ds yet; use tensor_parallel_degree 1 "
    "(data parallelism, sharded_data_parallel_degree or pipeline_parallel_degree)"
)
"""Why ``tensor_parallel_degree > 1`` is refused: the keymap's reason and ``smp.init``'s message."""


def tensor_parallel_block(params: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed ``tensor_parallel`` block: empty (the engine does not run tensor parallelism)."""
    return {}


def engine_tensor_parallel(params: Mapping[str, Any], seed: int | None = None) -> dict[str, Any]:
    """Engine settings for tensor parallelism (``seed``: SMP v2 ``random_seed`` overrides v1's seed)."""
    tp = params.get("tensor_parallel_degree", 1)
    return {
        "enabled": tp > 1,
        "degree": tp,
        "implementation": None,
        "unsupported": TP_UNSUPPORTED if tp > 1 else None,
        "seed": params.get("tensor_parallel_seed", 0) if seed is None else seed,
        "prescaled_batch": bool(params.get("prescaled_batch", False)),
    }
