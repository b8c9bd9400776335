"""GPT-J replaced by ``smp.nn.DistributedTransformerLMHead`` at tensor_parallel_degree 1 (no processes):
interleaved rotary embeddings, one layer norm shared by the parallel attention and MLP, no q/k/v bias,
an untied head with a bias; logits / loss / gradients equal to Hugging Face's for the same weights,
the translators' exact round trip, and an SMP state dict loading into the Hugging Face model."""

from __future__ import annotations

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface import gptj as tr
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked
from tests.engine.hf_equivalence import assert_same_logits_loss_and_gradients, assert_same_state

VOCAB = 40


def hf_gptj(seed: int, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    settings = {"rotary_dim": 4, **overrides}
    cfg = tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, **settings)
    cfg._attn_implementation = "eager"
    return tf.GPTJForCausalLM(cfg)


def test_gptj_translators_round_trip_exactly():
    sd = hf_gptj(0).state_dict()
    smp_sd = tr.translate_hf_state_dict_to_smdistributed_gptj(sd)
    assert {"lm_head_bias", "transformer.seq_layers.1.attention.query.weight"} <= set(smp_sd)
    back = tr.translate_state_dict_to_hf_gptj(smp_sd, 16)  # SMP's signature: (state_dict, max_seq_len=None)
    assert_same_state(back, sd)
    older = tr.translate_hf_gptj_state_dict_to_smdistributed(sd, 16)  # SMP's older name
    assert_same_state(older, smp_sd)
    with pytest.raises(KeyError, match="'transformer.h.0.attn.odd.weight' is not a GPT-J parameter name"):
        tr.translate_hf_state_dict_to_smdistributed_gptj({"transformer.h.0.attn.odd.weight": torch.zeros(1)})


def test_replaced_gptj_gives_hf_logits_loss_and_gradients():
    with marks.tensor_parallelism(fused_softmax=True):
        net = hf_gptj(4)
    ref = hf_gptj(4)
    new = replace_marked(net, ParallelContext())
    assert isinstance(new, smp.nn.DistributedTransformerLMHead) and new.config is net.config
    layer = new.transformer.seq_layers[0]
    assert layer.parallel and layer.output.layernorm is None and layer.attention.query.bias is None
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    assert_same_logits_loss_and_gradients(new, ref, ids, mask, tr.translate_hf_state_dict_to_smdistributed_gptj)
    new.eval()
    hf = hf_gptj(9).eval()
    hf.load_state_dict(tr.translate_state_dict_to_hf_gptj(new.state_dict()), strict=True)
    assert torch.allclose(hf(input_ids=ids).logits, new(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_gptj_without_rotary_dim_is_refused():
    with marks.tensor_parallelism(fused_softmax=True):
        net = hf_gptj(0, rotary_dim=0)
    with pytest.raises(SMPUnsupportedError, match="GPT-J with rotary_dim=0 is not supported"):
        replace_marked(net, ParallelContext())
