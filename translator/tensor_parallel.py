"""Tensor parallelism: SMP ``tensor_parallel_degree`` -> DeepSpeed AutoTP or the engine's layers.

DeepSpeed AutoTP training (``tensor_parallel.autotp_size``) shards models it knows (LLaMA-style
``nn.Linear`` stacks, Hugging Face models with a ``base_model_tp_plan``) and refuses others (GPT-2's
Conv1D). The engine keeps AutoTP where it works and swaps in its own Megatron-style
column/row-parallel layers where it does not (design.md section 3); it removes ``autotp_size``
from the config it hands DeepSpeed in that case.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def tensor_parallel_block(params: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed ``tensor_parallel`` block; empty when there is no tensor parallelism."""
    tp = params.get("tensor_parallel_degree", 1)
    return {"autotp_size": tp} if tp > 1 else {}


def engine_tensor_parallel(params: Mapping[str, Any], seed: int | None = None) -> dict[str, Any]:
    """Engine settings for tensor parallelism (``seed``: SMP v2 ``random_seed`` overrides v1's seed)."""
    tp = params.get("tensor_parallel_degree", 1)
    return {
        "enabled": tp > 1,
        "degree": tp,
        "implementation": "deepspeed_autotp",
        "fallback": "smp2ds column/row-parallel layers (GPT-2 Conv1D, BERT)",
        "seed": params.get("tensor_parallel_seed", 0) if seed is None else seed,
        # SMP: with prescaled_batch false each TP rank brings its own batch; AutoTP needs the
        # group to see identical inputs, so the engine gathers the group's batches.
        "input_gather": tp > 1 and not params.get("prescaled_batch", False),
    }
