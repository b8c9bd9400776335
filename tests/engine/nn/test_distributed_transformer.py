"""SMP's distributed transformer at tensor_parallel_degree 1 (no processes): the GPT-2 translators,
the modules against Hugging Face GPT-2 (logits, loss and gradients), the replacement SMP does for
a marked ``GPT2LMHeadModel``, and the refusals of what is not implemented (message text)."""

from __future__ import annotations

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError
from smp2ds.engine.nn.huggingface import gpt2 as tr
from smp2ds.engine.nn.huggingface.gpt2 import gpt2_arguments
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked
from tests.engine.hf_equivalence import assert_same_state

VOCAB = 40


def hf_gpt2(seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
    cfg._attn_implementation = "eager"
    return tf.GPT2LMHeadModel(cfg).eval()


def smp_twin(hf):
    """A DistributedTransformerLMHead built from the HF config, loaded with the translated weights."""
    m = smp.nn.DistributedTransformerLMHead(**gpt2_arguments(hf.config, {})).eval()
    m.load_state_dict(tr.translate_hf_state_dict_to_smdistributed_gpt2(hf.state_dict()), strict=True)
    return m


def ids(rows: int = 3, seq: int = 10, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def test_translators_round_trip_exactly_both_ways_whole_model_and_layer():
    hf = hf_gpt2()
    sd = hf.state_dict()
    smp_sd = tr.translate_hf_state_dict_to_smdistributed_gpt2({**sd, "_smp_is_partial": False})
    assert "transformer.seq_layers.1.attention.query.weight" in smp_sd and "lm_head.weight" not in smp_sd
    assert smp_sd["transformer.seq_layers.0.output.dense1.weight"].shape == (64, 16)  # [out, in]
    back = tr.translate_state_dict_to_hf_gpt2(smp_sd, max_seq_len=16)
    assert_same_state(back, sd)
    again = tr.translate_hf_state_dict_to_smdistributed_gpt2(back)
    assert_same_state(again, smp_sd)
    older = tr.translate_hf_state_dict_to_smdistributed(sd, 16)  # SMP's older name and signature
    assert_same_state(older, smp_sd)
    block = {k[len("transformer.h.0."):]: v for k, v in sd.items() if k.startswith("transformer.h.0.")}
    layer = tr.translate_hf_state_dict_to_smdistributed_gpt2_layer(block)
    assert set(layer) == {k[len("transformer.seq_layers.0."):] for k in smp_sd
                          if k.startswith("transformer.seq_layers.0.")}
    block_back = tr.translate_state_dict_to_hf_gpt2_layer(layer)
    assert_same_state(block_back, block)
    with pytest.raises(KeyError, match="'transformer.h.0.attn.extra' is not a GPT-2 parameter name"):
        tr.translate_hf_state_dict_to_smdistributed_gpt2({"transformer.h.0.attn.extra": torch.zeros(1)})
    with pytest.raises(KeyError, match="translate_state_dict_to_hf_gpt2: 'foo.weight' is not a GPT-2"):
        tr.translate_state_dict_to_hf_gpt2({"foo.weight": torch.zeros(1)})


def test_smp_transformer_gives_hf_gpt2_logits_loss_and_gradients_at_tp1():
    hf = hf_gpt2(seed=1).train()
    m = smp_twin(hf).train()
    x = ids()
    mask = torch.ones_like(x)
    mask[0, 7:] = 0  # right padding in one row
    want = hf(input_ids=x, attention_mask=mask, labels=x)
    logits = m((x, 1 - mask, None, None))
    keep = mask.bool()
    assert torch.allclose(logits[keep], want.logits[keep], atol=1e-6, rtol=0)
    unpadded = m(x)
    assert torch.allclose(unpadded, hf(input_ids=x).logits, atol=1e-6, rtol=0)
    loss, _ = m((x, None, None, None, x))
    ref = hf(input_ids=x, labels=x).loss
    assert torch.allclose(loss, ref, atol=1e-6)
    loss.backward()
    ref.backward()
    hf_grads = tr.translate_hf_state_dict_to_smdistributed_gpt2({n: p.grad for n, p in hf.named_parameters()})
    for name, p in m.named_parameters():
        assert torch.allclose(p.grad, hf_grads[name], atol=1e-6, rtol=1e-5), name


def test_full_smp_state_dict_loads_into_hf_gpt2_with_the_same_logits():
    m = smp.nn.DistributedTransformerLMHead(**gpt2_arguments(hf_gpt2().config, {})).eval()  # fresh SMP weights
    hf = hf_gpt2(seed=9)
    hf.load_state_dict(tr.translate_state_dict_to_hf_gpt2(m.state_dict()), strict=True)
    x = ids(seed=6)
    assert torch.allclose(hf(input_ids=x).logits, m(x), atol=1e-6, rtol=0)


def test_marked_gpt2_with_smp_settings_is_replaced_and_keeps_the_hf_call_contract():
    with marks.tensor_parallelism(fused_softmax=True, attention_in_fp32=True):
        net = hf_gpt2(seed=2)
    ref = hf_gpt2(seed=2)
    new = replace_marked(net, ParallelContext())
    assert isinstance(new, smp.nn.DistributedTransformerLMHead) and new.config is net.config
    layers = list(new.transformer.seq_layers.children())
    assert len(layers) == 2 and isinstance(layers[0], smp.nn.DistributedTransformerLayer)
    assert isinstance(layers[0].attention, smp.nn.DistributedAttentionLayer)
    assert isinstance(layers[0].output, smp.nn.DistributedTransformerOutputLayer)
    x = ids(seed=7)
    out, want = new(input_ids=x, attention_mask=torch.ones_like(x), labels=x), ref(input_ids=x, labels=x)
    assert torch.allclose(out["loss"], want.loss, atol=1e-6) and torch.allclose(out.logits, want.logits, atol=1e-6)
    with pytest.raises(SMPUnsupportedError, match="does not take token_type_ids"):
        new(input_ids=x, token_type_ids=x)
    # the in-place route stays for a plain marking, and unmarked models are left alone
    with marks.tensor_parallelism():
        plain = hf_gpt2()
    assert replace_marked(plain, ParallelContext()) is plain
    wrapper = torch.nn.ModuleDict({"lm": net})
    with marks.tensor_parallelism(fused_softmax=True):
        wrapper["lm"] = hf_gpt2()
    assert isinstance(replace_marked(wrapper, ParallelContext())["lm"], smp.nn.DistributedTransformerLMHead)


def test_replacement_refuses_cross_attention():
    with marks.tensor_parallelism(fused_softmax=True):
        cross = hf_gpt2(add_cross_attention=True)
    with pytest.raises(SMPUnsupportedError, match="add_cross_attention=True cannot be replaced"):
        replace_marked(cross, ParallelContext())


@pytest.mark.parametrize(("kwargs", "error", "text"), [
    ({"single_pre_layernorm": True}, SMPUnsupportedError,
     r"single_pre_layernorm=True\) is implemented with parallel_attn_output=True only"),
    ({"rotary_pct": 0.5}, SMPUnsupportedError, r"rotary_pct=0.5\): rotary_pct \(give rotary_dim, .*\) is not implemented"),
    ({"use_alibi": True}, SMPUnsupportedError, r"use_alibi=True\): ALiBi attention biases is not implemented"),
    ({"attention_layers_type": ["local"]}, SMPInvalidArgumentError, r"window_size=None\): local attention layers"),
    ({"parallel_attn_output": True}, SMPUnsupportedError, r"parallel_attn_output=True\) needs pre_layernorm=True"),
    ({"add_cross_attention": True}, SMPUnsupportedError, "cross attention .* is not implemented"),
    ({"activation": "silu"}, SMPInvalidArgumentError, r"activation='silu'\): supported are 'gelu', 'relu'"),
    ({"pre_layernorm": True, "post_layernorm": True}, SMPUnsupportedError,
     "exactly one of pre_layernorm / post_layernorm must be True"),
    ({"no_such_option": 1}, SMPInvalidArgumentError, "unknown keyword argument 'no_such_option'=1"),
])
def test_unimplemented_options_are_refused_naming_the_option(kwargs, error, text):
    with pytest.raises(error, match=text):
        smp.nn.DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4,
                                            hidden_size=8, intermediate_size=16, vocab_size=VOCAB, num_positions=8,
                                            **kwargs)


def test_implemented_options_change_the_maths_as_documented():
    base = {"num_layers": 1, "num_attention_heads": 2, "attention_head_size": 4, "hidden_size": 8,
            "intermediate_size": 16, "vocab_size": VOCAB, "num_positions": 8, "causal_mask_size": 8,
            "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0, "embedding_dropout_prob": 0.0}
    torch.manual_seed(0)
    ref = smp.nn.DistributedTransformerLMHead(**base)
    x = ids(2, 6)
    for same in ({"fused_softmax": False, "fused_bias_gelu": True, "fused_dropout": True},
                 {"attention_in_fp32": True, "query_key_layer_scaling": True, "fp32_residual_addition": True}):
        torch.manual_seed(0)
        other = smp.nn.DistributedTransformerLMHead(**base, **same)
        other.load_state_dict(ref.state_dict())
        assert torch.allclose(other(x), ref(x), atol=1e-6), same  # kernels / precision only: same fp32 maths
    attn = {"num_attention_heads": 2, "attention_head_size": 4, "hidden_size": 8, "attention_dropout_prob": 0.0,
            "hidden_dropout_prob": 0.0}
    plain, unscaled = smp.nn.DistributedAttentionLayer(**attn), smp.nn.DistributedAttentionLayer(
        **attn, scale_attention_scores=False)
    with torch.no_grad():  # weights large enough for the 1/sqrt(head size) scaling to show
        for p in plain.parameters():
            p.mul_(20)
    unscaled.load_state_dict(plain.state_dict())
    h = torch.randn(2, 5, 8)
    assert not torch.allclose(plain(h), unscaled(h), atol=1e-2)
    untied = smp.nn.DistributedTransformerLMHead(**base, tie_input_output_embedding=False, use_lm_head_bias=True)
    assert {"lm_head.weight", "lm_head_bias"} <= set(untied.state_dict())
    layer = smp.nn.DistributedTransformerLayer(num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                               intermediate_size=16)
    h, mask = torch.randn(2, 5, 8), torch.zeros(2, 1, 1, 5)
    out, mask_out = layer((h, mask))
    assert out.shape == h.shape and mask_out is mask
    assert smp.nn.DistributedAttentionLayer(num_attention_heads=2, attention_head_size=4,
                                            hidden_size=8)((h, mask)).shape == h.shape
