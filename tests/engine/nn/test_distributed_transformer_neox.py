"""GPT-NeoX replaced by ``smp.nn.DistributedTransformerLMHead`` at tensor_parallel_degree 1 (no processes):
rotary embeddings (partial, NeoX layout) and the parallel residual; logits / loss / gradients equal to
Hugging Face's for the same weights, the translators' exact round trip (q/k/v fused per head), and an SMP
state dict loading into the Hugging Face model."""

from __future__ import annotations

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.engine.core.state import ModuleManager, state
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface import gptneox as tr
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked
from tests.engine.hf_equivalence import assert_same_logits_loss_and_gradients, assert_same_state

VOCAB = 40


def hf_neox(seed: int, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=16, **overrides)
    cfg._attn_implementation = "eager"
    return tf.GPTNeoXForCausalLM(cfg)


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def test_neox_translators_round_trip_exactly(monkeypatch):
    monkeypatch.setattr(state, "module_manager", ModuleManager())  # no GPT-NeoX replaced yet for this model
    sd = hf_neox(0).state_dict()
    smp_sd = tr.translate_hf_state_dict_to_smdistributed_gptneox(sd, 4)
    assert "transformer.seq_layers.1.attention.value.bias" in smp_sd and "lm_head.weight" in smp_sd
    back = tr.translate_state_dict_to_hf_gptneox(smp_sd, num_attention_heads=4)
    assert_same_state(back, sd)
    again = tr.translate_hf_state_dict_to_smdistributed_gptneox(back, 4)
    assert_same_state(again, smp_sd)
    with pytest.raises(ValueError, match="num_attention_heads is needed to split"):
        tr.translate_hf_state_dict_to_smdistributed_gptneox(sd)
    with pytest.raises(ValueError, match="num_attention_heads is needed to fuse"):
        tr.translate_state_dict_to_hf_gptneox(smp_sd, 16)  # SMP's second argument is max_seq_len


def test_smp_signatures_take_the_head_count_of_the_replaced_model(monkeypatch):
    """As SMP's GPT-NeoX example: build the model (replaced), then translate pretrained weights with
    ``translate_hf_state_dict_to_smdistributed_gptneox(state_dict)`` and save with
    ``translate_state_dict_to_hf_gptneox(state_dict, max_seq_len)``: no head count passed."""
    monkeypatch.setattr(state, "module_manager", ModuleManager())
    with marks.tensor_parallelism(fused_softmax=True):
        new = replace_marked(hf_neox(5), ParallelContext()).eval()
    pretrained = hf_neox(6).eval()
    new.load_state_dict(tr.translate_hf_state_dict_to_smdistributed_gptneox(pretrained.state_dict()))
    ids, _ = batch(8)
    assert torch.allclose(new(input_ids=ids).logits, pretrained(input_ids=ids).logits, atol=1e-5, rtol=0)
    back = tr.translate_state_dict_to_hf_gptneox(new.state_dict(), 16)
    assert_same_state(back, pretrained.state_dict())
    older = tr.translate_hf_gptneox_state_dict_to_smdistributed(pretrained.state_dict(), 16)
    assert_same_state(older, new.state_dict())


@pytest.mark.parametrize(("parallel", "factor"), [(True, 0.25), (False, 1.0)])
def test_replaced_neox_gives_hf_logits_loss_and_gradients(parallel, factor):
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": factor, "rope_type": "default"}
    with marks.tensor_parallelism(fused_softmax=True):
        net = hf_neox(4, use_parallel_residual=parallel, rope_parameters=rope)
    ref = hf_neox(4, use_parallel_residual=parallel, rope_parameters=rope)
    new = replace_marked(net, ParallelContext())
    assert isinstance(new, smp.nn.DistributedTransformerLMHead) and new.config is net.config
    assert new.transformer.seq_layers[0].parallel is parallel
    ids, mask = batch()
    assert_same_logits_loss_and_gradients(new, ref, ids, mask,
                                          lambda sd: tr.translate_hf_state_dict_to_smdistributed_gptneox(sd, 4))
    with pytest.raises(SMPUnsupportedError, match="takes no position_ids"):
        new(input_ids=ids, position_ids=torch.arange(9)[None])


def test_smp_neox_state_dict_loads_into_hf_with_the_same_logits():
    with marks.tensor_parallelism(fused_softmax=True):
        new = replace_marked(hf_neox(5), ParallelContext()).eval()
    hf = hf_neox(6).eval()
    hf.load_state_dict(tr.translate_state_dict_to_hf_gptneox(new.state_dict(), num_attention_heads=4), strict=True)
    ids, _ = batch(8)
    assert torch.allclose(hf(input_ids=ids).logits, new(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_scaled_rotary_is_refused():
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "linear", "factor": 2.0}
    with marks.tensor_parallelism(fused_softmax=True):
        net = hf_neox(0, rope_parameters=rope)
    with pytest.raises(SMPUnsupportedError, match="rope_type='linear' \\(scaled rotary\\) is not supported"):
        replace_marked(net, ParallelContext())
