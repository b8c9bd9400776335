"""The fate of every SMP key: a data table, one row list per key.

Each key has rules ``Rule(fate, target, reason, when)``; the first rule whose condition holds for
the resolved configuration decides the key's fate:

* ``mapped``: the value lands in a DeepSpeed/Megatron/launcher setting; ``target`` is a JSON
  pointer into the Plan (``/deepspeed/zero_optimization/stage``);
* ``engine``: DeepSpeed cannot express it, smp2ds's engine does it; ``target`` points into
  ``/engine``;
* ``ignored``: it has no effect here, and ``reason`` says why;
* ``unsupported``: it asks for something smp2ds does not do, and ``reason`` says why.

Conditions are named so the table stays plain data; every key's last rule is unconditional.
tests/translator/test_keymap.py checks that the table and ``schemas/smp_v1.schema.json`` /
``smp_v2.schema.json`` cover the same keys and that every target exists in real plans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .bf16_settings import bf16_note, bf16_path
from .plan_types import Fate, KeyNote, SMPConfig
from .tensor_parallel import TP_ENGINE, TP_WITH_SDP_UNSUPPORTED, runs
from .world_layout import params_pointer

Condition = Callable[[Mapping[str, Any], Any], bool]

CONDITIONS: dict[str, Condition] = {
    "always": lambda p, v: True,
    "true": lambda p, v: v is True,
    "not_null": lambda p, v: v is not None,
    "gt1": lambda p, v: isinstance(v, int) and not isinstance(v, bool) and v > 1,
    "sdp": lambda p, v: p.get("sharded_data_parallel_degree", 1) > 1,
    "pipeline": lambda p, v: p.get("pipeline_parallel_degree", 1) > 1,
    "forward_only": lambda p, v: p.get("pipeline_parallel_degree", 1) > 1 and v == "_only_forward",
    "tp": lambda p, v: p.get("tensor_parallel_degree", 1) > 1,
    "tp_sdp": lambda p, v: p.get("tensor_parallel_degree", 1) > 1 and p.get("sharded_data_parallel_degree", 1) > 1
    and not p.get("prescaled_batch", False),
    "tp_runs": lambda p, v: runs(p),
    "offload": lambda p, v: p.get("offload_activations") is True,
    "bf16_zero1": lambda p, v: v is True and bf16_path(p) == "zero1",
    "bf16_zero3": lambda p, v: v is True and bf16_path(p) == "zero3",
    "bf16_pipeline": lambda p, v: v is True and bf16_path(p) == "pipeline",
}


@dataclass(frozen=True)
class Rule:
    """One possible fate of a key; ``when`` names a CONDITIONS entry."""

    fate: Fate
    target: str | None
    reason: str
    when: str = "always"


def _r(fate: Fate, target: str | None, reason: str, when: str = "always") -> Rule:
    return Rule(fate, target, reason, when)


_NO_SDP = _r("ignored", None, "SMP reads the sdp_* keys only when sharded_data_parallel_degree > 1")
_NO_PIPE = _r("ignored", None, "only matters with pipeline_parallel_degree > 1; this plan has one stage")
_TF_ONLY = "TensorFlow-only option of SMP; SMP for PyTorch ignored it as well"

# fmt: off
_PP_RULES = (
    _r("engine", "/engine/pipeline/stages",
       "pipeline stages are built by the engine as a DeepSpeed PipelineModule(num_stages=...): DeepSpeed "
       "parses pipeline.stages but never reads it", "pipeline"),
    _r("mapped", "/topology/pipeline_parallel_degree", "1 = no pipeline parallelism; nothing to emit"),
)

KEYMAP_V1: dict[str, tuple[Rule, ...]] = {
    # --- degrees, pipeline, partitioning -------------------------------------------------------
    "pipeline_parallel_degree": _PP_RULES,
    "partitions": _PP_RULES,
    "tensor_parallel_degree": (
        _r("unsupported", None, TP_WITH_SDP_UNSUPPORTED, "tp_sdp"),
        _r("engine", "/engine/tensor_parallel/degree", TP_ENGINE, "tp"),
        _r("ignored", None, "1 = no tensor parallelism; nothing to emit"),
    ),
    "sharded_data_parallel_degree": (
        _r("engine", "/engine/mics/shard_size",
           "MiCS-style sharding: DeepSpeed ZeRO-3 inside shard groups of this size, replica all-reduce "
           "by the engine (DeepSpeed >= 0.19.7 removed mics_shard_size); with tensor_parallel_degree > 1 the "
           "shard groups lie inside the reduced-data-parallel group and partition each rank's tensor-parallel "
           "shards", "sdp"),
        _r("engine", "/engine/mics/shard_size", "1 = no sharded data parallelism"),
    ),
    "microbatches": (
        _r("mapped", "/deepspeed/gradient_accumulation_steps",
           "smp.step splits the per-rank batch into this many micro-batches and accumulates their "
           "gradients: DeepSpeed gradient accumulation (pipeline micro-batches when pp > 1)"),
    ),
    "active_microbatches": (
        _r("engine", "/engine/pipeline/active_microbatches",
           "cap on micro-batches in flight: 1F1B already keeps at most min(pp, microbatches) in flight, so a cap "
           "at or above that is met as is; a smaller cap runs all-forward-then-backward groups of that size "
           "(exact cap, larger bubble)", "pipeline"),
        _NO_PIPE,
    ),
    "pipeline": (
        _r("unsupported", "/engine/pipeline/schedule",
           "'_only_forward' is an undocumented SMP mode; DeepSpeed's pipeline has no forward-only training "
           "schedule (use model.eval() for inference)", "forward_only"),
        _r("engine", "/engine/pipeline/schedule",
           "interleaved = 1F1B (DeepSpeed's TrainSchedule), simple = all forwards then all backwards "
           "(GPipe); "
           "the engine picks the schedule", "pipeline"),
        _NO_PIPE,
    ),
    "placement_strategy": (
        _r("engine", "/engine/placement/order",
           "rank order (right-most letter fastest); DeepSpeed's default is PDT, so the engine builds the "
           "process groups from this order; Megatron gets the matching order string"),
    ),
    "optimize": (
        _r("engine", "/engine/tensor_parallel/optimize",
           "the layout of SMP's distributed transformer (smp.nn.DistributedTransformer*, also what "
           "model_creation(tensor_parallelism=True) replaces GPT-2, GPT-J, GPT-NeoX and BERT by): speed keeps "
           "the hidden states whole on every tensor-parallel rank; memory splits them along the sequence "
           "between sublayers (Megatron-style sequence parallelism: layer norms, dropout and residual adds on "
           "1/tp of the tokens, all-gather before and reduce-scatter after the split projections; the sequence "
           "length must be divisible by tensor_parallel_degree; explain's tensor-parallel traffic figures are the "
           "speed layout's). Hugging Face blocks sharded in place under their own names (a warning says so "
           "when memory is asked for) and smp.nn.DistributedLinear run the speed layout whatever the value",
           "tp_runs"),
        _r("ignored", None, "only matters with tensor parallelism, and this plan runs none "
           "(tensor_parallel_degree is 1 or refused)"),
    ),
    "auto_partition": (
        _r("engine", "/engine/pipeline/partition/auto",
           "automatic vs manual (smp.partition) stage assignment", "pipeline"),
        _NO_PIPE,
    ),
    "default_partition": (
        _r("engine", "/engine/pipeline/partition/default_partition",
           "stage for modules outside any smp.partition context", "pipeline"),
        _NO_PIPE,
    ),
    "memory_weight": (
        _r("engine", "/engine/pipeline/partition/memory_weight",
           "partition cost = w*memory + (1-w)*compute, balanced by the engine", "pipeline"),
        _NO_PIPE,
    ),
    "contiguous": (_r("ignored", None, _TF_ONLY),),
    "load_partition": (_r("ignored", None, _TF_ONLY),),
    "partition_file": (_r("ignored", None, _TF_ONLY),),
    "skip_tracing": (
        _r("ignored", None,
           "switches off SMP's tracing pass before auto-partitioning; smp2ds has no tracing pass"),
    ),
    "deterministic_server": (
        _r("ignored", None,
           "ordering switch for SMP's pipeline execution server; DeepSpeed's pipeline schedule is static and "
           "identical on every data-parallel rank"),
    ),
    "fast_mode": (
        _r("ignored", None, "internal shortcut of SMP's pipeline server (direct stage-to-stage transfers); "
           "DeepSpeed's pipeline always sends activations point to point"),
    ),
    "static_mode": (
        _r("ignored", None, "internal shortcut of SMP's pipeline server for static graphs; DeepSpeed's "
           "pipeline schedule is static already"),
    ),
    # --- data parallelism and process groups ---------------------------------------------------
    "ddp": (
        _r("engine", "/engine/data_parallel/enabled",
           "data parallelism over the reduced-data-parallel ranks; DeepSpeed always all-reduces across the "
           "data-parallel group the engine gives it"),
    ),
    "horovod": (
        _r("unsupported", None,
           "Horovod was SMP's TensorFlow data-parallel backend; smp2ds runs PyTorch on DeepSpeed (use ddp)",
           "true"),
        _r("ignored", None, "false: Horovod (TensorFlow) not requested"),
    ),
    "ddp_port": (
        _r("engine", "/engine/process_group/port", "rendezvous port (also the launchers' master port)",
           "not_null"),
        _r("ignored", None, "unset: MASTER_PORT from the launcher, else 29760 as in SMP"),
    ),
    "ddp_dist_backend": (
        _r("engine", "/engine/process_group/backend",
           "'auto' means SMDDP AllGather where available, else NCCL; smp2ds uses NCCL with CUDA and "
           "gloo on CPU"),
    ),
    "herring": (
        _r("unsupported", None, "internal SMP flag marked 'not functional yet'", "true"),
        _r("ignored", None, "internal SMP flag, off"),
    ),
    "overlapping_allreduce": (
        _r("ignored", None,
           "an smp.DistributedModel argument, not an SMP config key (SMP 1.7/1.12 rejected it here); "
           "DeepSpeed "
           "schedules its own gradient all-reduce"),
    ),
    # --- memory features -----------------------------------------------------------------------
    "shard_optimizer_state": (
        _r("mapped", "/deepspeed/zero_optimization/stage",
           "ZeRO stage 1 (optimizer state partitioned across data-parallel ranks) when true and sharded data "
           "parallelism is off; stage 3 when sharded data parallelism is on", "always"),
    ),
    "offload_activations": (
        _r("engine", "/engine/activation_checkpointing/offload",
           "checkpointed modules (smp.set_activation_checkpointing, smp.checkpoint) keep their saved inputs in "
           "CPU memory until backward; /deepspeed/activation_checkpointing/cpu_checkpointing carries the same "
           "setting for DeepSpeed's own checkpointing API", "true"),
        _r("ignored", None, "false: checkpointed activations stay on the device"),
    ),
    "activation_loading_horizon": (
        _r("engine", "/engine/activation_checkpointing/loading_horizon",
           "backward prefetches at most this many offloaded activations ahead of their use", "offload"),
        _r("ignored", None, "only matters with offload_activations"),
    ),
    "task_level_activation_loading_horizon": (
        _r("ignored", None,
           "internal per-pipeline-task variant of activation_loading_horizon for SMP's pipeline "
           "server; no counterpart in DeepSpeed's schedule"),
    ),
    "_shard_offloaded_activations": (
        _r("ignored", None,
           "internal: lets one tensor-parallel rank offload activations shared by the group; "
           "DeepSpeed offloads per rank"),
    ),
    "delayed_parameter_initialization": (
        _r("engine", "/engine/delayed_parameter_initialization",
           "smp.model_creation / delay_param_initialization: with sharded data parallelism parameters are "
           "created already sharded (deepspeed.zero.Init in the shard group); without it, a model SMP's "
           "distributed transformer replaces is built on the meta device and each rank materialises only "
           "its shards"),
    ),
    "prescaled_batch": (
        _r("engine", "/engine/tensor_parallel/prescaled_batch",
           "false: every tensor-parallel rank brings its own batch and each tensor-parallel region joins the "
           "group's batches and hands every rank its own rows back; true: the group shares one batch "
           "(data sharded by rdp_rank)", "tp_runs"),
        _r("ignored", None, "only matters with tensor parallelism, and this plan runs none "
           "(tensor_parallel_degree is 1 or refused)"),
    ),
    "checkpoint_attentions": (
        _r("ignored", None,
           "internal: checkpoints the attention scores inside SMP's DistributedTransformer, which "
           "smp2ds does not have; use smp.set_activation_checkpointing on the attention module"),
    ),
    # --- precision -----------------------------------------------------------------------------
    "fp16": (
        _r("mapped", "/deepspeed/fp16/enabled", "fp16 with dynamic loss scaling; smp.DistributedOptimizer's "
           "loss-scale arguments replace the scaler settings at run time"),
    ),
    "bf16": (
        _r("mapped", "/deepspeed/bf16/check_grad_overflow", bf16_note({"bf16": True, "shard_optimizer_state": True}),
           "bf16_zero1"),
        _r("mapped", "/deepspeed/bf16/check_grad_overflow",
           bf16_note({"bf16": True, "sharded_data_parallel_degree": 2}), "bf16_zero3"),
        _r("mapped", "/deepspeed/bf16/check_grad_overflow", bf16_note({"bf16": True, "pipeline_parallel_degree": 2}),
           "bf16_pipeline"),
        _r("mapped", "/deepspeed/bf16/check_grad_overflow", bf16_note({"bf16": True}), "true"),
        _r("mapped", "/deepspeed/bf16/enabled", "false: no bf16"),
    ),
    "fp16_params": (
        _r("mapped", "/deepspeed/fp16/enabled",
           "deprecated since SMP 1.12 in favour of fp16; treated as fp16", "true"),
        _r("mapped", "/deepspeed/fp16/enabled", "false: precision follows fp16/bf16"),
    ),
    "_fp32_grad_accumulation": (
        _r("unsupported", None,
           "DeepSpeed accumulates micro-batch gradients in the fp16 parameters' dtype; it refuses "
           "data_types.grad_accum_dtype=fp32 with fp16 parameters ('unsupported mix'), so accumulation "
           "stays fp16",
           "true"),
        _r("ignored", None, "false: default accumulation"),
    ),
    "tensor_parallel_seed": (
        _r("engine", "/engine/tensor_parallel/seed",
           "seeds the fresh weights of smp.nn distributed modules (the same full tensor on every rank and "
           "degree) and the dropout stream tensor-parallel regions share", "tp_runs"),
        _r("ignored", None, "no tensor parallelism runs in this plan"),
    ),
    # --- sharded data parallelism --------------------------------------------------------------
    "sdp_reduce_bucket_size": (
        _r("mapped", "/deepspeed/zero_optimization/reduce_bucket_size", "ZeRO-3 gradient bucket (elements)",
           "sdp"),
        _NO_SDP,
    ),
    "sdp_param_persistence_threshold": (
        _r("mapped", "/deepspeed/zero_optimization/stage3_param_persistence_threshold",
           "parameters smaller than this are not partitioned", "sdp"),
        _NO_SDP,
    ),
    "sdp_max_live_parameters": (
        _r("mapped", "/deepspeed/zero_optimization/stage3_max_live_parameters",
           "cap on gathered parameters in flight", "sdp"),
        _NO_SDP,
    ),
    "sdp_hierarchical_allgather": (
        _r("engine", "/engine/mics/hierarchical_allgather",
           "two-stage parameter all-gather (across nodes, then within the node), used only when a shard "
           "group "
           "spans nodes", "sdp"),
        _NO_SDP,
    ),
    "sdp_gradient_clipping": (
        _r("mapped", "/deepspeed/gradient_clipping",
           "SMP clipped gradients inside optimizer.step() with sharded data parallelism", "sdp"),
        _NO_SDP,
    ),
    "_sharded_data_parallelism_config": (
        _r("unsupported", None,
           "internal SMP path to a JSON file of raw DeepSpeed settings; the translator reads no files: pass "
           "DeepSpeed-only settings as an explicit override instead", "not_null"),
        _r("ignored", None, "null: nothing to merge"),
    ),
    "_match_weights": (
        _r("ignored", None,
           "debug switch that copied weights into SMP's DistributedTransformer; smp2ds keeps the "
           "user's modules"),
    ),
}

KEYMAP_V2: dict[str, tuple[Rule, ...]] = {
    "hybrid_shard_degree": (
        _r("engine", "/engine/mics/shard_size",
           "SMP v2 scale-aware sharding (FSDP HYBRID_SHARD): 0 = shard over all data-parallel ranks, 1 = no "
           "sharding, n = shard over n ranks and replicate; the engine's MiCS-style sharding has this "
           "meaning"),
    ),
    "tensor_parallel_degree": KEYMAP_V1["tensor_parallel_degree"],
    "context_parallel_degree": (
        _r("unsupported", None, "context parallelism (splitting the sequence across ranks) has no SMP v1 "
           "counterpart and the engine does not implement it", "gt1"),
        _r("ignored", None, "1 = no context parallelism"),
    ),
    "expert_parallel_degree": (
        _r("unsupported", None,
           "expert parallelism applies to SMP v2's own MoE modules; the engine does not implement it", "gt1"),
        _r("ignored", None, "1 = no expert parallelism"),
    ),
    "sm_activation_offloading": (
        _r("ignored", None,
           "chooses SMP v2's prefetching offload implementation over PyTorch's; smp2ds has one "
           "implementation (SMP v1's offload_activations)"),
    ),
    "activation_loading_horizon": (
        _r("ignored", None,
           "SMP v2 applies it to its own activation offloading, which the engine does not run for v2 "
           "configurations (the engine implements the SMP v1 API)"),
    ),
    "fsdp_cache_flush_warnings": (
        _r("ignored", None, "PyTorch FSDP allocator warnings; the plan runs on DeepSpeed, not FSDP"),
    ),
    "allow_empty_shards": (
        _r("ignored", None, "FSDP checkpointing workaround; DeepSpeed ZeRO pads partitions instead"),
    ),
    "random_seed": (
        _r("ignored", None, "seeds SMP v2's tensor-parallel modules; smp2ds does not run tensor parallelism "
           "yet"),
    ),
}

# fmt: on

ALIASES: dict[str, str] = {"partitions": "pipeline_parallel_degree"}

META_KEYS: dict[str, Rule] = {
    "$schema": _r("ignored", None, "names the JSON Schema for editors; not an SMP setting"),
}
"""Keys a document may carry for tooling; schemas may list them, they are never SMP settings."""


def keymap(version: int = 1) -> Mapping[str, tuple[Rule, ...]]:
    """The table for SMP ``version`` 1 or 2."""
    return KEYMAP_V2 if version == 2 else KEYMAP_V1


def fate_of(key: str, params: Mapping[str, Any], value: Any, version: int = 1) -> Rule | None:
    """The rule deciding ``key``'s fate for a resolved config, or None for a key not in the table."""
    for rule in keymap(version).get(key, ()):
        if CONDITIONS[rule.when](params, value):
            return rule
    return META_KEYS.get(key)


def fate_counts(version: int = 1) -> dict[str, int]:
    """How many keys have each fate under their first (feature-active) rule, for reports."""
    counts = {"mapped": 0, "engine": 0, "ignored": 0, "unsupported": 0}
    for rules in keymap(version).values():
        counts[rules[0].fate] += 1
    return counts


def key_notes(config: SMPConfig, params: Mapping[str, Any]) -> tuple[KeyNote, ...]:
    """One KeyNote per key the user gave, as spelled, with its pointer, sorted by pointer."""
    spelled: dict[str, str] = dict(config.pointers)
    covered = {ALIASES.get(key, key) for key in spelled}
    for key in config.given:
        if key not in covered:
            spelled[key] = params_pointer(config, key)
    notes = []
    for key, pointer in spelled.items():
        canonical = ALIASES.get(key, key)
        value = config.given[canonical] if canonical in config.given else config.v2.get(key)
        rule = fate_of(key, params, value, config.smp_version)
        if rule is None:
            rule = Rule("ignored", None, "not an SMP parameter; the plan does not use it")
        notes.append(
            KeyNote(
                key=key, pointer=pointer, value=value, fate=rule.fate, target=rule.target, reason=rule.reason
            )
        )
    return tuple(sorted(notes, key=lambda n: n.pointer))
