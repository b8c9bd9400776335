"""Everything the translator knows about specific DeepSpeed versions, in one place.

The rest of the translator emits DeepSpeed settings by name; this module says which names the
supported DeepSpeed releases (>= 0.19.7) refuse or never read, so a plan can be checked before it
reaches ``deepspeed.initialize``. Facts come from DeepSpeed 0.19.8's ``runtime/config.py``
(``_REMOVED_TOP_LEVEL_CONFIG_KEYS``, ``_REMOVED_ZERO_CONFIG_KEYS``), ``runtime/zero/config.py``
(deprecated fields), ``runtime/activation_checkpointing/config.py`` and
``runtime/pipe/engine.py``; tests/translator/test_deepspeed_acceptance.py pins them against the
installed DeepSpeed so a new release that changes them fails loudly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .issues import Issue

MIN_DEEPSPEED = "0.19.7"
"""First release without MiCS (``mics_shard_size``); the plans target it and later."""

REMOVED_FEATURES_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

# Top-level blocks DeepSpeed >= 0.19.7/0.19.8 rejects with DeepSpeedConfigError.
REMOVED_TOP_LEVEL_KEYS: dict[str, str] = {
    "nebula": "Nebula checkpointing was removed",
    "compression_training": "the compression library was removed",
    "amp": "the NVIDIA Apex AMP integration was removed; use fp16, bf16 or torch_autocast",
    "quantize_training": "Mixture-of-Quantization was removed",
    "sparse_gradients": "sparse embedding-gradient compression was removed",
    "eigenvalue": "eigenvalue-based MoQ was removed",
    "sparse_attention": "Sparse Attention was removed",
    "elasticity": "elastic training was removed; set the batch keys directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "legacy curriculum_learning was removed; use data_efficiency",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}

# zero_optimization keys DeepSpeed >= 0.19.7 rejects (MiCS left in 0.19.7, LoCo in 0.19.8).
REMOVED_ZERO_KEYS: dict[str, str] = {
    "mics_shard_size": "MiCS ZeRO-3 sharding was removed (smp2ds's engine implements it)",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding was removed (smp2ds's engine implements it)",
    "zeropp_loco_param": "LoCo-ZeRO++ was removed",
}

# Spellings DeepSpeed still accepts but deprecates; we never emit them.
DEPRECATED_ZERO_KEYS: dict[str, str] = {
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "cpu_offload_use_pin_memory": "offload_param / offload_optimizer",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

# Plain-dict blocks that DeepSpeed reads key by key without rejecting typos, so we check them.
ACTIVATION_CHECKPOINTING_KEYS: frozenset[str] = frozenset(
    {
        "partition_activations",
        "contiguous_memory_optimization",
        "cpu_checkpointing",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    }
)
PIPELINE_KEYS: frozenset[str] = frozenset(
    {
        # parsed by get_pipeline_config; only the last four are read by PipelineEngine
        "stages",
        "partition",
        "seed_layers",
        "activation_checkpoint_interval",
        "pipe_partitioned",
        "grad_partitioned",
        "use_reentrant",
    }
)

CLIPPING_DEFAULT_NOTE = (
    "DeepSpeed >= 0.19.3 clips gradients at 1.0 unless gradient_clipping is set, while SMP did not clip "
    "(except with sharded data parallelism), so the plan always sets it"
)


def check_deepspeed_config(config: Mapping[str, Any], base: str = "/deepspeed") -> list[Issue]:
    """Every key in ``config`` that supported DeepSpeed releases refuse or silently drop.

    Returns issues whose pointers are rooted at ``base`` (``/deepspeed`` inside a plan). An empty
    list means the dict uses no removed, deprecated or misspelled key that we know of; the
    pydantic-checked blocks (zero_optimization, fp16, bf16) are checked by DeepSpeed itself in tests.
    """
    issues: list[Issue] = []
    for key, why in REMOVED_TOP_LEVEL_KEYS.items():
        if key in config:
            issues.append(_removed(f"{base}/{key}", key, why))
    zero = config.get("zero_optimization")
    if isinstance(zero, Mapping):
        for key, why in REMOVED_ZERO_KEYS.items():
            if key in zero:
                issues.append(_removed(f"{base}/zero_optimization/{key}", key, why))
        for key, new in DEPRECATED_ZERO_KEYS.items():
            if key in zero:
                issues.append(
                    Issue(
                        f"{base}/zero_optimization/{key}",
                        f"deprecated DeepSpeed key {key!r}",
                        hint=f"use {new}",
                    )
                )
    for block, known in (
        ("activation_checkpointing", ACTIVATION_CHECKPOINTING_KEYS),
        ("pipeline", PIPELINE_KEYS),
    ):
        section = config.get(block)
        if isinstance(section, Mapping):
            for key in sorted(set(section) - known):
                issues.append(
                    Issue(
                        f"{base}/{block}/{key}",
                        f"DeepSpeed does not read {block}.{key} (it would be silently ignored)",
                        allowed=", ".join(sorted(known)),
                    )
                )
    return issues


def _removed(pointer: str, key: str, why: str) -> Issue:
    return Issue(
        pointer,
        f"DeepSpeed >= {MIN_DEEPSPEED} rejects {key!r}: {why}",
        hint=f"remove it; see {REMOVED_FEATURES_ISSUE}",
    )
