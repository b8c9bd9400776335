"""Megatron-Core / Megatron-LM / Megatron-DeepSpeed equivalents of an SMP layout.

Rank order (docs/internals.md#rank-order): SMP's ``placement_strategy`` letters put the fastest
axis right-most; Megatron's order string puts it left-most (``tp-dp-pp`` is its default) and
DeepSpeed's ``ProcessTopology`` lists axes slowest first. So ``cluster`` = ``DPT`` becomes
Megatron ``tp-pp-dp`` (``--use-tp-pp-dp-mapping``) and DeepSpeed axes ``[data, pipe, model]``.
Megatron's ``dp`` is SMP's reduced data parallelism ``rdp`` (it excludes tensor-parallel peers).
"""

from __future__ import annotations

from typing import Any

from .batch import BatchPlan
from .precision import Dtype, torch_dtype_name

_MEGATRON_AXIS = {"T": "tp", "P": "pp", "D": "dp"}
_DEEPSPEED_AXIS = {"T": "model", "P": "pipe", "D": "data"}
MEGATRON_DEFAULT_ORDER = "tp-dp-pp"
MEGATRON_TP_PP_DP = "tp-pp-dp"


def megatron_order(letters: str) -> str:
    """Megatron-Core ``order`` string (left = fastest) for SMP placement letters (right = fastest)."""
    return "-".join(_MEGATRON_AXIS[letter] for letter in reversed(letters))


def same_order(order_a: str, order_b: str, sizes: dict[str, int]) -> bool:
    """Whether two Megatron order strings place ranks identically for these axis sizes.

    Axes of size 1 do not affect rank placement, so only the relative order of the others counts.
    """

    def effective(order: str) -> list[str]:
        return [axis for axis in order.split("-") if sizes.get(axis, 1) > 1]

    return effective(order_a) == effective(order_b)


def deepspeed_axes(letters: str) -> list[str]:
    """DeepSpeed ``ProcessTopology`` axes (last = fastest) for SMP placement letters."""
    return [_DEEPSPEED_AXIS[letter] for letter in letters]


def megatron_section(
    *,
    pp: int,
    tp: int,
    rdp: int,
    letters: str,
    dtype: Dtype,
    fp16: dict[str, Any],
    clipping: float,
    zero_stage: int,
    shard_size: int,
    batch: BatchPlan,
    offload_activations: bool,
    schedule: str,
) -> tuple[dict[str, Any], list[str]]:
    """The plan's ``megatron`` section and remarks about what Megatron cannot express."""
    remarks: list[str] = []
    order = megatron_order(letters)
    dims = {"T": tp, "P": pp, "D": rdp}
    model_parallel_config: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": None,
        "sequence_parallel": False,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "fp16": dtype == "fp16",
        "bf16": dtype == "bf16",
        "params_dtype": torch_dtype_name(dtype),
        # Megatron-Core requires a pipeline dtype as soon as there is more than one stage.
        "pipeline_dtype": torch_dtype_name(dtype),
    }
    common = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if batch.deepspeed_micro_batch is not None and batch.global_batch_size is not None:
        common += ["--micro-batch-size", str(batch.deepspeed_micro_batch)]
        common += ["--global-batch-size", str(batch.deepspeed_micro_batch * batch.microbatches * rdp)]
    else:
        remarks.append("Megatron batch arguments omitted: the per-rank batch size is unknown")
    precision = _precision_args(dtype, fp16)

    sizes = {"tp": tp, "pp": pp, "dp": rdp}
    use_tp_pp_dp = not same_order(order, MEGATRON_DEFAULT_ORDER, sizes) and same_order(
        order, MEGATRON_TP_PP_DP, sizes
    )
    lm = common + precision + ["--clip-grad", repr(float(clipping))]
    if use_tp_pp_dp:
        lm.append("--use-tp-pp-dp-mapping")
    elif not same_order(order, MEGATRON_DEFAULT_ORDER, sizes):
        remarks.append(
            f"Megatron-LM's flags express only the rank orders {MEGATRON_DEFAULT_ORDER} and "
            f"{MEGATRON_TP_PP_DP}; "
            f"placement {letters} needs Megatron-Core initialize_model_parallel(order='{order}')"
        )
    if zero_stage == 3:
        replicas = max(1, rdp // shard_size)
        lm += ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", str(replicas)]
        remarks.append(
            "Megatron-LM approximation of sharded data parallelism: a distributed optimizer with one "
            f"instance per replica ({replicas}) shards optimizer state in groups of {shard_size}, but "
            "parameters and gradients stay replicated (MiCS shards all three)"
        )
    elif zero_stage == 1:
        lm.append("--use-distributed-optimizer")
    if pp > 1 and schedule == "gpipe":
        remarks.append("Megatron has no all-forward-then-all-backward (SMP 'simple') schedule; it runs 1F1B")

    mds = common + ["--deepspeed", "--deepspeed_config", "ds_config.json", "--zero-stage", str(zero_stage)]
    mds += precision
    if pp == 1:
        # Megatron-DeepSpeed otherwise wraps the model in a PipelineModule, which refuses ZeRO-2/3.
        mds.append("--no-pipeline-parallel")
    if offload_activations:
        mds += ["--deepspeed-activation-checkpointing", "--checkpoint-in-cpu"]
    # Megatron-DeepSpeed's PipeModelDataParallelTopology is pipe-data-model = Megatron tp-dp-pp.
    if not same_order(order, MEGATRON_DEFAULT_ORDER, sizes):
        remarks.append(
            f"Megatron-DeepSpeed lays ranks out pipe-data-model (PDT); SMP placement {letters} puts ranks "
            "differently (same numerics, different locality)"
        )

    section = {
        "model_parallel_config": model_parallel_config,
        "rank_order": order,
        "use_tp_pp_dp_mapping": use_tp_pp_dp,
        "deepspeed_topology": {"axes": deepspeed_axes(letters), "dims": [dims[letter] for letter in letters]},
        "megatron_lm_args": lm,
        "megatron_deepspeed_args": mds,
    }
    return section, remarks


def _precision_args(dtype: Dtype, fp16: dict[str, Any]) -> list[str]:
    if dtype == "bf16":
        return ["--bf16"]
    if dtype != "fp16":
        return []
    if fp16.get("loss_scale", 0):
        return ["--fp16", "--loss-scale", repr(float(fp16["loss_scale"]))]
    return [
        "--fp16",
        "--initial-loss-scale",
        str(2 ** int(fp16["initial_scale_power"])),
        "--min-loss-scale",
        str(fp16["min_loss_scale"]),
        "--loss-scale-window",
        str(fp16["loss_scale_window"]),
        "--hysteresis",
        str(fp16["hysteresis"]),
    ]
