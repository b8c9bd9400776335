"""The bf16 switches per layout (smp2ds.translator.bf16_settings), checked by DeepSpeed's own config model."""

from __future__ import annotations

import pytest
from deepspeed.runtime.precision_config import DeepSpeedBF16Config

from smp2ds.translator.bf16_settings import bf16_block, bf16_choice, bf16_note
from smp2ds.translator.keymap import fate_of

LAYOUTS = {
    "zero0": ({"bf16": True}, True),
    "zero1": ({"bf16": True, "shard_optimizer_state": True}, False),
    "zero1 pipeline": ({"bf16": True, "shard_optimizer_state": True, "pipeline_parallel_degree": 2}, False),
    "zero3": ({"bf16": True, "sharded_data_parallel_degree": 2}, True),
    "pipeline": ({"bf16": True, "pipeline_parallel_degree": 2}, True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_block_per_layout_is_valid_deepspeed(name):
    params, check = LAYOUTS[name]
    block = bf16_block(params)
    assert block == {"enabled": True, "check_grad_overflow": check, "immediate_grad_update": False}
    config = DeepSpeedBF16Config(**block)
    assert config.check_grad_overflow is check and config.immediate_grad_update is False


def test_no_bf16_writes_only_enabled_false():
    assert bf16_block({"fp16": True}) == {"enabled": False}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fate_note_gives_the_layouts_reason(name):
    params, check = LAYOUTS[name]
    rule = fate_of("bf16", params, True)
    assert rule is not None and rule.target == "/deepspeed/bf16/check_grad_overflow"
    assert rule.reason == bf16_note(params)
    assert f"check_grad_overflow {str(check).lower()}" in rule.reason
    assert "torch_autocast stays off" in rule.reason and "immediate_grad_update false" in rule.reason
    assert bf16_choice(params).reason in rule.reason


def test_bf16_false_is_plain():
    rule = fate_of("bf16", {}, False)
    assert rule is not None and rule.target == "/deepspeed/bf16/enabled"
