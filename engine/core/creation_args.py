"""Checks of ``smp.model_creation``'s arguments (SMP's keywords: which are accepted, which refused)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.core.deepspeed_config import precision
from smp2ds.engine.exceptions import SMPInvalidArgumentError

TENSOR_PARALLEL_CONFIG_KEYS = frozenset({
    # smp.nn.DistributedTransformer* / DistributedAttentionLayer / FlashAttentionLayer init arguments
    "num_layers", "num_attention_heads", "attention_head_size", "hidden_size", "intermediate_size",
    "vocab_size", "num_positions", "attention_dropout_prob", "hidden_dropout_prob", "activation",
    "layernorm_epsilon", "num_token_types", "causal_mask_size", "add_cross_attention", "add_lm_head",
    "initializer_range", "use_normal_initialization", "pre_layernorm", "post_layernorm",
    "embedding_dropout_prob", "mask_value", "attention_in_fp32", "query_key_layer_scaling",
    "fp32_residual_addition", "fused_softmax", "fused_bias_gelu", "fused_dropout", "distribute_embedding",
    "rotary_dim", "rotary_emb_base", "rotary_pct", "gpt_neox_type_rotary", "use_positional_embedding",
    "parallel_attn_output", "use_lm_head_bias", "attention_layers_type", "use_qkv_bias",
    "use_attn_dense_bias", "window_size", "final_layernorm", "tie_input_output_embedding",
    "single_pre_layernorm", "scale_attention_scores", "scale_attn_by_layer_idx", "use_alibi",
    "alibi_bias_max", "flash_attention", "triton_flash_attention",
})
"""``model_creation(**tensor_parallel_config)`` keys SMP passes to its distributed modules
(docs/smp-semantics.md#tensor-parallelism and the SMP example scripts). They only act on modules marked for
tensor parallelism."""

_TRAINING_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _is_flag(value: Any) -> bool:
    """bool, or 0/1 (scripts pass ``args.x > 0`` as often as ``args.x``)."""
    return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))


def check(tensor_parallelism: Any, dtype: Any, zero_init: Any, config: dict[str, Any]) -> None:
    """Raise ``SMPInvalidArgumentError`` naming the argument, its value and what is allowed."""
    if not _is_flag(tensor_parallelism):
        raise SMPInvalidArgumentError(
            f"model_creation(tensor_parallelism=...) must be a bool, got {tensor_parallelism!r}")
    if zero_init is not None and not _is_flag(zero_init):
        raise SMPInvalidArgumentError(f"model_creation(zero_init=...) must be True, False or None, got {zero_init!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise SMPInvalidArgumentError(
            f"model_creation(dtype=...) must be a floating-point torch.dtype (torch.float32, torch.float16, "
            f"torch.bfloat16) or None, got {dtype!r}")
    unknown = sorted(set(config) - TENSOR_PARALLEL_CONFIG_KEYS)
    if unknown:
        raise SMPInvalidArgumentError(
            f"model_creation got unknown keyword argument(s) {unknown}; accepted: tensor_parallelism, dtype, "
            f"zero_init and the tensor-parallel module settings {sorted(TENSOR_PARALLEL_CONFIG_KEYS)}")


def check_partitioned_dtype(dtype: torch.dtype, ds_config: Mapping[str, Any]) -> None:
    """Partitioned creation makes parameters in the training precision: refuse another ``dtype``."""
    training = _TRAINING_DTYPES[precision(ds_config)]
    if dtype != training:
        raise SMPInvalidArgumentError(
            f"model_creation(dtype={dtype}) with parameters partitioned at creation (sharded data parallelism, "
            f"zero_init/delayed_parameter_initialization): DeepSpeed creates them in the training precision "
            f"{training}; pass dtype={training} (or None), or zero_init=False to create the model in {dtype}")
