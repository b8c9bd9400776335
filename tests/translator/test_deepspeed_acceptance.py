"""Every DeepSpeed config the planner emits is accepted by DeepSpeed's own config classes.

DeepSpeed is imported here only (the translator never imports it). The pydantic blocks
(zero_optimization, fp16, bf16, tensor_parallel) use ``extra="forbid"``, so a misspelled key we
emit fails; DeepSpeedConfig runs the batch arithmetic and the removed-key check of 0.19.7+.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed.runtime import config as ds_runtime_config  # noqa: E402
from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError, get_pipeline_config  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402

from smp2ds.translator import ds_compat  # noqa: E402
from smp2ds.translator.normalize import normalize  # noqa: E402
from smp2ds.translator.plan_types import Layout  # noqa: E402
from smp2ds.translator.planner import plan  # noqa: E402
from smp2ds.translator.precision import fp16_block  # noqa: E402
from tests._dist import run_ranks  # noqa: E402

CASES: dict[str, tuple[dict[str, Any], int, int | None, int | None]] = {
    "single_fp32": ({}, 1, None, 4),
    "single_fp16": ({"fp16": True, "microbatches": 2}, 1, None, 4),
    "single_bf16_offload": ({"bf16": True, "offload_activations": True}, 1, None, 2),
    "ddp_unknown_batch": ({"ddp": True, "microbatches": 2}, 2, None, None),
    "zero1_fp16": ({"ddp": True, "shard_optimizer_state": True, "fp16": True, "microbatches": 2}, 4, None, 8),
    "sdp_bf16": (
        {
            "ddp": True,
            "sharded_data_parallel_degree": 2,
            "bf16": True,
            "sdp_reduce_bucket_size": 1000,
            "sdp_param_persistence_threshold": 10,
            "sdp_max_live_parameters": 100,
        },
        4,
        2,
        4,
    ),
    "sdp_fp16_all_ranks": ({"ddp": True, "sharded_data_parallel_degree": 4, "fp16": True}, 4, 2, 2),
    "pipeline": (
        {"partitions": 2, "microbatches": 4, "ddp": True, "shard_optimizer_state": True},
        4,
        None,
        8,
    ),
    "tensor": ({"tensor_parallel_degree": 2, "ddp": True, "fp16": True}, 4, None, 4),
    "tp_pp": (
        {
            "tensor_parallel_degree": 2,
            "pipeline_parallel_degree": 2,
            "ddp": True,
            "bf16": True,
            "microbatches": 2,
        },
        8,
        4,
        4,
    ),
    "v2_hybrid": ({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2}, 8, None, 2),
}


def make(name: str):
    params, world, gpus, batch = CASES[name]
    layout = Layout(world_size=world, gpus_per_node=gpus, batch_size=batch)
    return plan(normalize(params, layout), layout)


def world_one_view(ds: dict[str, Any]) -> dict[str, Any]:
    """The same config as DeepSpeed on one process would check it.

    Without a process group DeepSpeedConfig uses world size 1, so train_batch_size is dropped and
    DeepSpeed derives it; the real data-parallel size is checked in test_batch_rule_* and in the
    2-rank test below. An unknown batch gets micro-batch 1, which the engine fills at run time.
    """
    out = copy.deepcopy(ds)
    out.pop("train_batch_size", None)
    out.setdefault("train_micro_batch_size_per_gpu", 1)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_blocks_pass_deepspeeds_pydantic_models(name):
    ds = make(name).deepspeed
    zero = DeepSpeedZeroConfig(**ds["zero_optimization"])
    assert zero.stage == ds["zero_optimization"]["stage"]
    fp16 = DeepSpeedFP16Config(**ds["fp16"])
    bf16 = DeepSpeedBF16Config(**ds["bf16"])
    assert not (fp16.enabled and bf16.enabled)
    TPTrainingConfig(**ds.get("tensor_parallel", {}))
    assert set(ds["activation_checkpointing"]) <= set(ACT_CHKPT_DEFAULT)
    assert ds_compat.check_deepspeed_config(ds) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_config_passes_deepspeedconfig(name):
    ds = make(name).deepspeed
    cfg = DeepSpeedConfig(world_one_view(ds))
    assert cfg.gradient_accumulation_steps == ds["gradient_accumulation_steps"]
    assert cfg.gradient_clipping == ds["gradient_clipping"]  # explicit, not DeepSpeed's 1.0 default
    assert cfg.zero_optimization_stage == ds["zero_optimization"]["stage"]
    assert (
        cfg.activation_checkpointing_config.cpu_checkpointing
        == ds["activation_checkpointing"]["cpu_checkpointing"]
    )
    if "tensor_parallel" in ds:
        assert cfg.tensor_parallel_config.autotp_size == ds["tensor_parallel"]["autotp_size"]


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if CASES[n][3] is not None])
def test_batch_rule_holds_for_the_data_parallel_size_deepspeed_sees(name):
    p = make(name)
    ds = p.deepspeed
    dp = p.engine["batch"]["deepspeed_data_parallel_size"]
    assert (
        ds["train_batch_size"]
        == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * dp
    )


def test_single_process_plan_is_accepted_as_is():
    ds = make("single_fp16").deepspeed
    cfg = DeepSpeedConfig(copy.deepcopy(ds))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (4, 2)
    assert cfg.float16_config.initial_dynamic_scale() == 2**32


def test_zero3_aliases_are_read_not_dropped():
    zero = DeepSpeedZeroConfig(**make("sdp_bf16").deepspeed["zero_optimization"])
    assert (zero.reduce_bucket_size, zero.param_persistence_threshold, zero.max_live_parameters) == (
        1000,
        10,
        100,
    )
    assert zero.contiguous_gradients is False and zero.overlap_comm is True


def test_removed_key_lists_match_installed_deepspeed():
    assert set(ds_compat.REMOVED_TOP_LEVEL_KEYS) == set(ds_runtime_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert set(ds_compat.REMOVED_ZERO_KEYS) == set(ds_runtime_config._REMOVED_ZERO_CONFIG_KEYS)


@pytest.mark.parametrize("key", sorted(ds_compat.REMOVED_ZERO_KEYS))
def test_removed_zero_keys_are_rejected_by_both(key):
    ds = world_one_view(make("sdp_bf16").deepspeed)
    ds["zero_optimization"][key] = 2
    issues = ds_compat.check_deepspeed_config(ds)
    assert [i.pointer for i in issues] == [f"/deepspeed/zero_optimization/{key}"]
    with pytest.raises(DeepSpeedConfigError):
        DeepSpeedConfig(ds)


@pytest.mark.parametrize("key", sorted(ds_compat.REMOVED_TOP_LEVEL_KEYS))
def test_removed_top_level_keys_are_rejected_by_both(key):
    ds = world_one_view(make("single_fp32").deepspeed)
    ds[key] = {"enabled": True}
    assert [i.pointer for i in ds_compat.check_deepspeed_config(ds)] == [f"/deepspeed/{key}"]
    with pytest.raises(DeepSpeedConfigError):
        DeepSpeedConfig(ds)


def test_plain_dict_block_whitelists_match_deepspeed():
    assert ds_compat.ACTIVATION_CHECKPOINTING_KEYS == set(ACT_CHKPT_DEFAULT)
    assert set(get_pipeline_config({})) | {"use_reentrant"} == ds_compat.PIPELINE_KEYS
    typo = {"activation_checkpointing": {"cpu_checkpoint": True}}
    assert (
        ds_compat.check_deepspeed_config(typo)[0].pointer
        == "/deepspeed/activation_checkpointing/cpu_checkpoint"
    )


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"static_loss_scale": 128.0, "dynamic_loss_scale": False}, {"loss_scale": 128.0}),
        (
            {
                "dynamic_loss_scale": True,
                "dynamic_loss_args": {
                    "init_scale": 2.0**16,
                    "scale_window": 500,
                    "min_scale": 2,
                    "delayed_shift": 2,
                },
            },
            {
                "loss_scale": 0.0,
                "initial_scale_power": 16,
                "loss_scale_window": 500,
                "min_loss_scale": 2,
                "hysteresis": 2,
            },
        ),
    ],
)
def test_distributed_optimizer_loss_scale_args_become_an_accepted_fp16_block(kwargs, expected):
    block, remarks = fp16_block(**kwargs)
    parsed = DeepSpeedFP16Config(**block)
    assert remarks == []
    for field, value in expected.items():
        assert getattr(parsed, field) == value, field


def test_inexact_loss_scale_args_are_reported():
    block, remarks = fp16_block(
        dynamic_loss_args={"init_scale": 1000.0, "scale_factor": 3.0, "min_scale": 0.5}
    )
    DeepSpeedFP16Config(**block)
    assert block["initial_scale_power"] == 10 and block["min_loss_scale"] == 1
    assert len(remarks) == 3
    with pytest.raises(ValueError, match="unknown keys"):
        fp16_block(dynamic_loss_args={"init_scal": 2.0})


def _deepspeedconfig_on_real_ranks(tamper: bool) -> tuple[int, int]:
    import deepspeed
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=os.environ["SMP2DS_INIT_METHOD"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        layout = Layout(world_size=2, batch_size=4)
        ds = plan(
            normalize({"ddp": True, "shard_optimizer_state": True, "fp16": True, "microbatches": 2}, layout),
            layout,
        ).deepspeed
        ds = copy.deepcopy(dict(ds))
        if tamper:
            ds["train_batch_size"] += 1
        cfg = DeepSpeedConfig(ds)
        return cfg.world_size, cfg.train_batch_size
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_batch_triple_accepted_by_deepspeedconfig_on_two_real_ranks():
    assert run_ranks(_deepspeedconfig_on_real_ranks, 2, False, timeout_s=180) == [(2, 8), (2, 8)]
    # the check is live: a wrong train_batch_size fails on the same ranks
    with pytest.raises(Exception, match="Check batch related parameters"):
        run_ranks(_deepspeedconfig_on_real_ranks, 2, True, timeout_s=180)
