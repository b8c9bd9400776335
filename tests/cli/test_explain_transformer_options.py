"""``smp2ds explain`` lists the fate of each distributed-transformer setting scripts pass to
``smp.model_creation``, and that table (``translator/transformer_options.py``) is what the engine does:
refused values raise naming the setting, kernel choices and ``use_normal_initialization`` change nothing,
fp32 attention changes bf16 results, ``fp32_residual_addition`` keeps an fp16 residual stream from
overflowing, ``distribute_embedding`` is taken by the LM head only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.cli import main
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn import transformer_options as engine_options
from smp2ds.translator import transformer_options as table

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
SETTINGS = {"attention_in_fp32", "fp32_residual_addition", "query_key_layer_scaling", "fused_softmax",
            "fused_dropout", "fused_bias_gelu", "use_alibi", "attention_layers_type", "window_size",
            "distribute_embedding", "flash_attention", "triton_flash_attention", "use_normal_initialization"}
FATE = {o.option: o for o in table.OPTIONS}
SIZES = {"num_layers": 1, "num_attention_heads": 2, "attention_head_size": 4, "hidden_size": 8,
         "intermediate_size": 16, "vocab_size": 12, "num_positions": 8, "causal_mask_size": 8,
         "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0, "embedding_dropout_prob": 0.0}
REFUSED_VALUES = {"use_alibi": True}


def test_explain_shows_every_setting_when_tensor_parallelism_is_configured(capsys):
    assert main(["explain", str(EXAMPLES / "gpt3_175b_tp_pp_004.json")]) == 0
    text = capsys.readouterr().out
    section = text[text.index("distributed transformer settings"):]
    lines = {line.split()[0]: line.split()[1] for line in section.splitlines()[3:3 + len(SETTINGS)]}
    assert lines == {o: FATE[o].fate.split()[0] for o in SETTINGS}
    assert "use_normal_initialization  no effect" in section and "accepted: False, None" in section
    assert main(["explain", str(EXAMPLES / "gpt3_175b_tp_pp_004.json"), "--format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)["transformer_options"]
    assert {o["option"]: o["fate"] for o in listed} == {o: FATE[o].fate for o in SETTINGS}
    assert main(["explain", str(EXAMPLES / "bert_pipeline_000.json")]) == 0  # no tensor_parallel_degree
    assert "distributed transformer settings" not in capsys.readouterr().out


def _lm(seed: int = 0, dtype: torch.dtype = torch.float32, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    return smp.nn.DistributedTransformerLMHead(**SIZES, **extra).to(dtype)


def _ids() -> torch.Tensor:
    return torch.randint(0, 12, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("option", sorted(o for o in SETTINGS if FATE[o].fate == table.REFUSED))
def test_refused_settings_raise_naming_the_setting_and_accept_their_off_values(option):
    assert set(FATE[option].accepted) == set(engine_options._REFUSED_UNLESS[option])
    with pytest.raises(SMPUnsupportedError, match=f"{option}="):
        _lm(**{option: REFUSED_VALUES[option]})
    for value in FATE[option].accepted:
        _lm(**{option: value})


@pytest.mark.parametrize("option", sorted(o for o in SETTINGS if FATE[o].fate in (table.KERNEL, table.NO_EFFECT)))
def test_kernel_choices_and_no_effect_settings_change_nothing(option):
    assert (option in engine_options.KERNEL_CHOICES) == (FATE[option].fate == table.KERNEL)
    on, off = _lm(**{option: True}), _lm(**{option: False})
    assert all(torch.equal(a, b) for a, b in zip(on.state_dict().values(), off.state_dict().values()))
    assert torch.equal(on(_ids()), off(_ids()))


def _bf16_logits(**extra) -> torch.Tensor:
    """Logits of a bf16 model with weights large enough for score rounding to show (same weights each time)."""
    model = _lm(dtype=torch.bfloat16, pre_layernorm=True, post_layernorm=False, **extra)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)
    return model(_ids())


def test_fp32_attention_settings_change_bf16_results():
    assert {"attention_in_fp32", "query_key_layer_scaling"} <= set(engine_options.Options.__dataclass_fields__)
    fp32_attention = _bf16_logits(attention_in_fp32=True)
    assert not torch.equal(_bf16_logits(), fp32_attention)
    assert torch.equal(_bf16_logits(query_key_layer_scaling=True), fp32_attention)


@pytest.mark.parametrize("parallel", [False, True])
def test_fp32_residual_addition_keeps_an_fp16_stream_from_overflowing(parallel):
    """Residual 60000 + branch outputs of ~8000 each: beyond fp16's 65504. With the setting the stream is
    fp32 and finite; without it, not finite."""
    outputs = {}
    for on in (False, True):
        torch.manual_seed(0)
        layer = smp.nn.DistributedTransformerLayer(
            num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16,
            attention_dropout_prob=0.0, hidden_dropout_prob=0.0, pre_layernorm=True, post_layernorm=False,
            parallel_attn_output=parallel, fp32_residual_addition=on).half()
        with torch.no_grad():
            layer.attention.dense.bias.fill_(8000.0)
            layer.output.dense2.bias.fill_(8000.0)
        hidden = torch.full((2, 5, 8), 60000.0, dtype=torch.float16) + torch.randn(2, 5, 8).half()
        outputs[on] = layer((hidden, None))[0]
    assert outputs[False].dtype == torch.float16 and not torch.isfinite(outputs[False]).all()
    assert outputs[True].dtype == torch.float32 and torch.isfinite(outputs[True]).all()
    assert float(outputs[True].detach().min()) > 70000


def test_distribute_embedding_is_the_lm_heads():
    assert FATE["distribute_embedding"].fate == table.IMPLEMENTED
    _lm(distribute_embedding=True)
    with pytest.raises(SMPUnsupportedError, match="distribute_embedding=True"):
        smp.nn.DistributedTransformer(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                      intermediate_size=16, distribute_embedding=True)
